"""A small HTTP client for the device (standard library only), strict about sizes.

Every response body is read with a hard cap: a JSON answer beyond :data:`MAX_JSON_BYTES`
or a file longer than its release says is refused while it streams, never buffered.
Downloads resume from a partial file with ``Range`` and ``If-Range`` on the file's digest.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from edged.errors import EdgedError, ErrorCode

MAX_JSON_BYTES = 4 << 20


class SyncHttpError(EdgedError):
    """The registry could not be reached or answered with an error status."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class TransferError(EdgedError):
    """A download's content is not what the release promised (length, digest, range)."""

    code = ErrorCode.FAILED_PRECONDITION


class StoppedError(EdgedError):
    """The agent is stopping; the partial download stays for the next start."""

    code = ErrorCode.UNAVAILABLE


class RegistryHttp:
    def __init__(self, base_url: str, *, timeout: float, ca_file: Path | None = None,
                 client_cert: Path | None = None, client_key: Path | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SyncHttpError(f"registry url {base_url!r} is not http(s)://host[:port]")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.timeout = timeout
        self._ctx: ssl.SSLContext | None = None
        if self.https:
            self._ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            if client_cert is not None:
                try:
                    self._ctx.load_cert_chain(str(client_cert), str(client_key) if client_key else None)
                except (OSError, ssl.SSLError) as e:
                    raise SyncHttpError(f"registry client certificate {client_cert}: {e}") from None
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._ctx)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
              ) -> http.client.HTTPResponse:
        for attempt in (0, 1):  # one retry on a stale kept-alive connection
            conn = self._conn()
            try:
                conn.request(method, self.base + path, body=body, headers=headers)
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                self.close()
                if attempt == 1 or not isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                                      ConnectionResetError)):
                    raise SyncHttpError(f"registry unreachable: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, *, token: str | None = None, body: bytes | None = None,
                headers: dict[str, str] | None = None, max_bytes: int = MAX_JSON_BYTES
                ) -> tuple[int, dict[str, str], bytes]:
        """Send, read the whole (capped) answer; returns (status, lower-cased headers, body)."""
        h = {"Accept": "application/json", **(headers or {})}
        if token:
            h["Authorization"] = f"Bearer {token}"
        if body is not None:
            h["Content-Type"] = "application/json"
        resp = self._send(method, path, body, h)
        try:
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                self.close()
                raise TransferError(f"registry answer of {length} bytes is over the {max_bytes}-byte limit")
            data = resp.read(max_bytes + 1)
            if len(data) > max_bytes:
                self.close()
                raise TransferError(f"registry answer is over the {max_bytes}-byte limit")
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise SyncHttpError(f"registry connection broke: {e}") from None
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        if resp.will_close:
            self.close()
        return resp.status, hdrs, data

    def download(self, path: str, *, token: str, dest: Path, size: int, etag: str, chunk: int,
                 should_stop: Callable[[], bool], on_chunk: Callable[[], None] | None = None) -> int:
        """Fetch into ``dest`` (appending to what is there); returns the bytes transferred now.

        Refuses a body longer or shorter than ``size``; the caller checks the digest.
        """
        offset = dest.stat().st_size if dest.exists() else 0
        if offset > size:
            dest.unlink()
            offset = 0
        if offset == size:
            return 0
        h = {"Accept": "application/octet-stream", "Authorization": f"Bearer {token}"}
        if offset:
            h["Range"] = f"bytes={offset}-"
            h["If-Range"] = etag
        resp = self._send("GET", path, None, h)
        got = 0
        try:
            if resp.status == 416:
                resp.read(4096)
                raise TransferError(f"the registry has fewer bytes than the release's {size} (resume at {offset})")
            if resp.status not in (200, 206):
                body = resp.read(4096)
                raise SyncHttpError(f"download refused: {resp.status} {body[:200]!r}", resp.status)
            if resp.status == 200:
                offset = 0  # the server sent the whole file: start over
            else:
                crange = resp.getheader("Content-Range") or ""
                if not crange.startswith(f"bytes {offset}-"):
                    raise TransferError(f"registry answered range {crange!r} to a request from byte {offset}")
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and offset + int(length) != size:
                raise TransferError(f"file is {offset + int(length)} bytes on the registry, the release says {size}")
            with dest.open("r+b" if offset else "wb") as f:
                f.seek(offset)
                f.truncate()
                pos = offset
                while True:
                    if should_stop():
                        raise StoppedError("stopping")
                    data = resp.read(min(chunk, size - pos + 1))
                    if not data:
                        break
                    pos += len(data)
                    if pos > size:
                        raise TransferError(f"file is longer than the {size} bytes the release says")
                    f.write(data)
                    got += len(data)
                    if on_chunk is not None:
                        f.flush()
                        on_chunk()
                f.flush()
                os.fsync(f.fileno())
            if pos != size:
                raise TransferError(f"file ended at {pos} bytes, the release says {size}")
        except (OSError, http.client.HTTPException) as e:
            raise SyncHttpError(f"download broke off after {got} bytes: {e}") from None
        finally:
            if not resp.isclosed():
                self.close()  # a body left unread: the connection cannot be reused
        if resp.will_close:
            self.close()
        return got
