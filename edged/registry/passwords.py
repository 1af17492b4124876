"""Operator passwords for the dashboard: scrypt hashes kept in the registry's settings, never the passwords.

``scrypt$<n>$<r>$<p>$<salt>$<hash>`` (base64): a memory-hard hash from the standard library,
so a stolen settings file costs an attacker about 16 MiB and tens of milliseconds per guess.
``edged-registry operator-hash`` prints one for ``[registry.operators]``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

_N, _R, _P = 2**14, 8, 1
_FORMAT = re.compile(r"^scrypt\$(\d{1,7})\$(\d{1,2})\$(\d{1,2})\$([A-Za-z0-9+/=]{16,88})\$([A-Za-z0-9+/=]{32,88})$")
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
MAX_PASSWORD = 1024
# checked when a login names no known operator, so that the time taken does not say which names exist
_DUMMY = "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=128 * 1024 * 1024, dklen=32)


def hash_password(password: str) -> str:
    if not password or len(password) > MAX_PASSWORD:
        raise ValueError(f"a password is 1 to {MAX_PASSWORD} characters")
    salt = secrets.token_bytes(16)
    digest = _scrypt(password, salt, _N, _R, _P)
    return f"scrypt${_N}${_R}${_P}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def is_password_hash(text: str) -> bool:
    m = _FORMAT.fullmatch(text)
    if m is None:
        return False
    n, r, p = (int(x) for x in m.groups()[:3])
    return 2**10 <= n <= 2**20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16


def check_password(password: str, stored: str | None) -> bool:
    """Whether ``password`` matches ``stored`` (None: no such operator; the same work is done anyway)."""
    candidate = stored if stored is not None and is_password_hash(stored) else _DUMMY
    m = _FORMAT.fullmatch(candidate)
    assert m is not None
    n, r, p = (int(x) for x in m.groups()[:3])
    digest = _scrypt(password[:MAX_PASSWORD], base64.b64decode(m.group(4)), n, r, p)
    return hmac.compare_digest(digest, base64.b64decode(m.group(5))) and candidate is stored
