"""Bearer tokens: generated with ``secrets``, stored only as sha256, compared in constant time.

Tokens carry 256 random bits, so a plain sha256 is enough to keep a leaked database from
revealing them (no password stretching needed), and lookups can use the hash as an index.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ADMIN_PREFIX = "edga_"
DEVICE_PREFIX = "edgd_"
ENROLL_PREFIX = "edge_"
TOKEN_PREFIX = "edgt_"  # a named operator token (edged.registry.api_tokens)


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    return token


def is_admin(authorization: str | None, admin_hash: str) -> bool:
    token = bearer_token(authorization)
    # Hash even when absent so the time taken does not say whether a token was sent.
    return same_hash(token_hash(token or ""), admin_hash) and token is not None
