"""Short-lived signed blob URLs: how the API hands a download to the blob server without sharing a database.

The API decides who may fetch a blob (as before: the device's desired state names a
release that lists it) and answers with a redirect to ``<blob base>/blobs/<sha256>?exp=&sig=``.
The signature is an HMAC over the digest and the expiry with a key kept beside the blobs
(``<blob_dir>/url-signing.key``, 0400), so every API and blob-server process sharing the
blob folder signs and checks alike, and the blob server needs nothing else. A URL grants
one file's bytes until it expires, which the API had already granted to whoever asked; the
device still checks size, digest and the release's signature.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path

from edged.errors import ConfigError
from edged.fsutil import fsync_dir

KEY_NAME = "url-signing.key"
KEY_BYTES = 32


def signing_key(blob_root: Path) -> bytes:
    """The key in ``blob_root``, created (atomically, once, whoever comes first) when missing."""
    path = blob_root / KEY_NAME
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".url-key.", dir=blob_root)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(secrets.token_hex(KEY_BYTES) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o400)
            with contextlib.suppress(FileExistsError):  # another process made it first: use theirs
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
        fsync_dir(blob_root)
    try:
        key = bytes.fromhex(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable blob URL signing key ({e}); delete it to make a new one") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{path}: the blob URL signing key must be {KEY_BYTES} bytes; delete it to make a new one")
    return key


class UrlSigner:
    def __init__(self, key: bytes, ttl_s: float = 600.0) -> None:
        self._key, self.ttl_s = key, ttl_s

    def _mac(self, sha256: str, expires: int) -> str:
        return hmac.new(self._key, f"{sha256}:{expires}".encode("ascii"), hashlib.sha256).hexdigest()

    def query(self, sha256: str, now: float) -> str:
        """``exp=..&sig=..`` for one blob, valid ``ttl_s`` from ``now`` (wall clock: other processes check it)."""
        expires = int(now + self.ttl_s)
        return f"exp={expires}&sig={self._mac(sha256, expires)}"

    def refusal(self, sha256: str, exp: str | None, sig: str | None, now: float) -> str | None:
        """Why a URL is refused (None: it is good)."""
        if not exp or not sig or not exp.isdigit() or len(exp) > 12 or len(sig) != 64:
            return "a signed blob URL is required (ask the registry API for the blob)"
        if not hmac.compare_digest(self._mac(sha256, int(exp)).encode("ascii"), sig.encode("ascii", "replace")):
            return "the blob URL's signature is not valid"
        if int(exp) < now:
            return "the blob URL has expired (ask the registry API again)"
        return None
