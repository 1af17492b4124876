"""Dashboard sessions and CSRF tokens: signed, stateless, bound to the admin credential.

A session is a cookie ``v1.<expiry>.<nonce>.<mac>`` whose MAC key is derived from the admin
token's hash, so several registry processes sharing one configuration accept each other's
sessions without shared state, and rotating the admin token ends every session at once.
The CSRF token is a second MAC over the session's nonce: a page can only post an action
with a token it was served inside the session, and a cross-site form (which the
``SameSite=Strict`` cookie already keeps out) could not guess it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE = "edged_session"
SESSION_S = 12 * 3600
_MAX_COOKIE = 256


@dataclass(frozen=True)
class Session:
    nonce: str
    expires_at: int
    csrf: str


class Sessions:
    """Issues and checks session cookies; never stores anything."""

    def __init__(self, admin_hash: str, lifetime_s: int = SESSION_S) -> None:
        self._key = hashlib.sha256(b"edged-dashboard-session\0" + admin_hash.encode("ascii")).digest()
        self.lifetime_s = lifetime_s

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "\0".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()

    def issue(self) -> tuple[str, Session]:
        """A new cookie value and its session."""
        nonce = secrets.token_urlsafe(18)
        expires = int(time.time()) + self.lifetime_s
        value = f"v1.{expires}.{nonce}.{self._mac('session', str(expires), nonce)}"
        return value, Session(nonce, expires, self._mac("csrf", nonce))

    def check(self, cookie: str | None) -> Session | None:
        """The session a cookie value proves, or None (absent, forged, expired, malformed)."""
        if not cookie or len(cookie) > _MAX_COOKIE:
            return None
        parts = cookie.split(".")
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit():
            return None
        _, expires, nonce, mac = parts
        if not hmac.compare_digest(mac.encode("ascii", "replace"), self._mac("session", expires, nonce).encode()):
            return None
        if int(expires) < time.time():
            return None
        return Session(nonce, int(expires), self._mac("csrf", nonce))

    @staticmethod
    def csrf_ok(session: Session, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(session.csrf.encode(), token.encode("utf-8", "replace"))
