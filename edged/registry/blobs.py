"""Content-addressed blob store: ``<root>/sha256/<first 2 hex>/<sha256>``.

A blob is written to a temp file beside its final place, hashed while it streams in,
fsynced, and renamed only when its digest and size match what the uploader announced,
so a reader never sees a partial or wrong blob. Several registry processes may share
the folder (e.g. over NFS): identical content lands at the identical name. Folders are
0700 and blobs 0400 whatever the umask: only the registry's user reads what operators uploaded.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO

from edged.errors import EdgedError, ErrorCode
from edged.fsutil import fsync_dir, make_private_dir

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobError(EdgedError):
    code = ErrorCode.INVALID_ARGUMENT


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, sha256: str) -> Path:
        if not SHA256_RE.fullmatch(sha256):
            raise BlobError("not a lower-case hex sha256")
        return self.root / "sha256" / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        return self.path(sha256).stat().st_size

    def begin(self, sha256: str) -> BlobWriter:
        return BlobWriter(self, sha256)


class BlobWriter:
    """Receives one blob in chunks; :meth:`commit` checks digest and size, then publishes it."""

    def __init__(self, store: BlobStore, sha256: str) -> None:
        self.final = store.path(sha256)
        self.sha256 = sha256
        make_private_dir(self.final.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{sha256[:16]}.", suffix=".part", dir=self.final.parent)
        self.tmp = Path(tmp)
        self._file: BinaryIO = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def commit(self, expected_size: int | None = None) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            actual = self._hash.hexdigest()
            if actual != self.sha256:
                raise BlobError(f"upload does not match its sha256 (got {actual[:12]}...)")
            if expected_size is not None and self.size != expected_size:
                raise BlobError(f"upload is {self.size} bytes, {expected_size} announced")
            os.chmod(self.tmp, 0o400)
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)
        finally:
            self.abort()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


class SmallBlobCache:
    """Recently served small blobs, in memory: content-addressed, so never stale.

    When a step of a rollout starts, every device in it fetches the same few files within
    seconds; serving them from memory spares a file open and read per request.
    """

    def __init__(self, store: BlobStore, *, max_file: int = 1 << 20, max_total: int = 64 << 20) -> None:
        self.store, self.max_file, self.max_total = store, max_file, max_total
        self._data: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, sha256: str) -> bytes | None:
        with self._lock:
            data = self._data.get(sha256)
            if data is not None:
                self._data.move_to_end(sha256)
            return data

    def load(self, sha256: str) -> bytes | None:
        """Read a small blob from disk into the cache (blocking); None when absent or too big to cache."""
        path = self.store.path(sha256)
        try:
            if path.stat().st_size > self.max_file:
                return None
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            if sha256 not in self._data:
                self._data[sha256] = data
                self._total += len(data)
                while self._total > self.max_total and self._data:
                    _, old = self._data.popitem(last=False)
                    self._total -= len(old)
        return data
