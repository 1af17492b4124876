"""Dashboard sessions and CSRF tokens: signed, bound to the credential that signed in, and open in the database.

A session is a cookie ``v1.<expiry>.<nonce>.<who>.<mac>``: ``who`` is ``admin`` (signed in
with the admin token) or an operator's name. The MAC key is derived from the admin token's
hash, and an operator's MAC also covers that operator's password hash, so several registry
processes sharing one configuration accept each other's cookies, rotating the admin token
ends every session, and removing an operator or changing their password ends theirs. A valid
cookie is honoured only while its session is open in the database
(:mod:`edged.registry.web.session_store`): signing out closes it. The CSRF token is a second MAC
over the session's nonce: a page can only post an action with a token it was served inside the
session, and a cross-site form (which the ``SameSite=Strict`` cookie already keeps out) could not
guess it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE = "edged_session"
ADMIN = "admin"  # operators cannot take this name: passwords.NAME allows it, settings refuse it
SESSION_S = 12 * 3600
_MAX_COOKIE = 256


@dataclass(frozen=True)
class Session:
    nonce: str
    expires_at: int
    csrf: str
    who: str = ADMIN


class Sessions:
    """Issues and checks session cookies (whether one is still open is the session store's to say)."""

    def __init__(self, admin_hash: str, lifetime_s: int = SESSION_S, operators: dict[str, str] | None = None) -> None:
        self._key = hashlib.sha256(b"edged-dashboard-session\0" + admin_hash.encode("ascii")).digest()
        self.lifetime_s = lifetime_s
        self.operators = dict(operators or {})

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "\0".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()

    def _binding(self, who: str) -> str | None:
        """What the session's MAC covers besides its own fields: the operator's current password hash."""
        if who == ADMIN:
            return ""
        return self.operators.get(who)

    def issue(self, who: str = ADMIN) -> tuple[str, Session]:
        """A new cookie value and its session for the admin or a configured operator."""
        binding = self._binding(who)
        if binding is None:
            raise ValueError(f"no operator {who!r}")
        nonce = secrets.token_urlsafe(18)
        expires = int(time.time()) + self.lifetime_s
        value = f"v1.{expires}.{nonce}.{who}.{self._mac('session', str(expires), nonce, who, binding)}"
        return value, Session(nonce, expires, self._mac("csrf", nonce), who)

    def check(self, cookie: str | None) -> Session | None:
        """The session a cookie value proves, or None (absent, forged, expired, malformed, operator gone)."""
        if not cookie or len(cookie) > _MAX_COOKIE:
            return None
        parts = cookie.split(".")
        if len(parts) != 5 or parts[0] != "v1" or not parts[1].isdigit():
            return None
        _, expires, nonce, who, mac = parts
        binding = self._binding(who)
        if binding is None:
            return None
        if not hmac.compare_digest(mac.encode("ascii", "replace"),
                                   self._mac("session", expires, nonce, who, binding).encode()):
            return None
        if int(expires) < time.time():
            return None
        return Session(nonce, int(expires), self._mac("csrf", nonce), who)

    @staticmethod
    def csrf_ok(session: Session, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(session.csrf.encode(), token.encode("utf-8", "replace"))
