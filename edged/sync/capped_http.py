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
from urllib.parse import urljoin, urlsplit

from edged.errors import EdgedError, ErrorCode

MAX_JSON_BYTES = 4 << 20
REDIRECTS = (301, 302, 303, 307, 308)
Origin = tuple[bool, str, int]  # https, host, port


class SyncHttpError(EdgedError):
    """The registry could not be reached or answered with an error status."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, message: str, status: int = 0, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # a busy registry's 503 said when to come back


def parse_retry_after(value: str | None) -> float | None:
    """A 503's Retry-After in seconds (the seconds form, capped at 5 min); None when absent or not seconds."""
    value = (value or "").strip()
    return min(300.0, float(value)) if value.isdigit() else None


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
        # Connections are per thread (http.client is not thread-safe); every thread's set is also listed
        # here so that close() reaches them all: a kept-alive connection left in a worker thread would
        # otherwise outlive the agent and hold a TLS registry's stop for its whole grace.
        self._local = threading.local()
        self._sets: list[dict[Origin, http.client.HTTPConnection]] = []
        self._sets_lock = threading.Lock()
        self.origin: Origin = (self.https, self.host, self.port)

    def _conn(self, origin: Origin | None = None) -> http.client.HTTPConnection:
        origin = origin or self.origin
        conns: dict[Origin, http.client.HTTPConnection] | None = self._local.__dict__.get("conns")
        if conns is None:
            conns = self._local.conns = {}
            with self._sets_lock:
                self._sets.append(conns)
        conn = conns.get(origin)
        if conn is None:
            https, host, port = origin
            if https:
                conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._tls())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
            conns[origin] = conn
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ctx is None:  # an http registry redirecting to an https blob server: the system's CAs
            self._ctx = ssl.create_default_context()
        return self._ctx

    def close(self) -> None:
        """Close every thread's connections (to the registry and any blob server): the agent is stopping."""
        with self._sets_lock:
            sets, self._sets = self._sets, []
            self._local = threading.local()  # a thread that goes on starts a new, listed set
        for conns in sets:
            for conn in list(conns.values()):
                conn.close()
            conns.clear()

    def _drop(self, origin: Origin | None = None) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(origin or self.origin, None)
        if conn is not None:
            conn.close()

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
              origin: Origin | None = None) -> http.client.HTTPResponse:
        for attempt in (0, 1):  # one retry on a stale kept-alive connection
            conn = self._conn(origin)
            try:
                conn.request(method, (self.base if origin is None else "") + path, body=body, headers=headers)
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                self._drop(origin)
                if attempt == 1 or not isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                                      ConnectionResetError)):
                    what = "registry" if origin is None else "blob server"
                    raise SyncHttpError(f"{what} unreachable: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def _redirect(self, location: str | None) -> tuple[Origin, str]:
        """Where a download was sent (the registry's blob server or a CDN): never from https to http."""
        parts = urlsplit(urljoin(f"{'https' if self.https else 'http'}://{self.host}:{self.port}{self.base}/",
                                 location or ""))
        if not location or parts.scheme not in ("http", "https") or not parts.hostname:
            raise SyncHttpError(f"download redirected to {location!r}, not an http(s) URL")
        if self.https and parts.scheme != "https":
            raise SyncHttpError(f"download redirected from https to {parts.scheme}: refused")
        https = parts.scheme == "https"
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        return (https, parts.hostname, parts.port or (443 if https else 80)), target

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
                self._drop()
                raise TransferError(f"registry answer of {length} bytes is over the {max_bytes}-byte limit")
            data = resp.read(max_bytes + 1)
            if len(data) > max_bytes:
                self._drop()
                raise TransferError(f"registry answer is over the {max_bytes}-byte limit")
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise SyncHttpError(f"registry connection broke: {e}") from None
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        if resp.will_close:
            self._drop()
        return resp.status, hdrs, data

    def download(  # noqa: PLR0913  where from, where to, what to expect, and the caller's two hooks
            self, path: str, *, token: str, dest: Path, size: int, etag: str, chunk: int,
            should_stop: Callable[[], bool], on_chunk: Callable[[], None] | None = None) -> int:
        """Fetch into ``dest`` (appending to what is there); returns the bytes transferred now.

        Refuses a body longer or shorter than ``size``; the caller checks the digest.
        """
        offset = dest.stat().st_size if dest.exists() else 0
        if offset > size:
            dest.unlink()
            offset = 0
        if offset == size:
            if not dest.exists():  # an empty file: nothing to fetch, but the caller verifies it like any other
                with dest.open("wb") as f:
                    os.fsync(f.fileno())
            return 0
        origin, resp = self._open_download(path, token, offset, etag)
        got = 0
        try:
            offset = _body_offset(resp, offset, size)
            got = _write_body(resp, dest, offset, size, chunk, should_stop, on_chunk)
        except (OSError, http.client.HTTPException) as e:
            raise SyncHttpError(f"download broke off after {got} bytes: {e}") from None
        finally:
            if not resp.isclosed():
                self._drop(origin)  # a body left unread: the connection cannot be reused
        if resp.will_close:
            self._drop(origin)
        return got

    def _open_download(self, path: str, token: str, offset: int, etag: str
                       ) -> tuple[Origin, http.client.HTTPResponse]:
        """The answer to the download request (a resume from ``offset``), after at most one redirect."""
        h = {"Accept": "application/octet-stream", "Authorization": f"Bearer {token}"}
        if offset:
            h["Range"] = f"bytes={offset}-"
            h["If-Range"] = etag
        resp = self._send("GET", path, None, h)
        origin = self.origin
        if resp.status in REDIRECTS:
            # The registry authorised the download and sent it to a blob server with a signed URL: the
            # credential stays here; Range / If-Range go along (size and digest are checked as ever).
            location = resp.getheader("Location")
            resp.read(4096)
            if resp.will_close or not resp.isclosed():
                self._drop()
            origin, target = self._redirect(location)
            del h["Authorization"]
            resp = self._send("GET", target, None, h, origin)
            if resp.status in REDIRECTS:
                self._drop(origin)
                raise SyncHttpError(f"download redirected twice (to {resp.getheader('Location')!r}): refused")
        return origin, resp


def _body_offset(resp: http.client.HTTPResponse, offset: int, size: int) -> int:
    """Where the answer's body starts in the file (0: the whole file came), or why it cannot be used."""
    if resp.status == 416:
        resp.read(4096)
        raise TransferError(f"the registry has fewer bytes than the release's {size} (resume at {offset})")
    if resp.status not in (200, 206):
        body = resp.read(4096)
        raise SyncHttpError(f"download refused: {resp.status} {body[:200]!r}", resp.status,
                            parse_retry_after(resp.getheader("Retry-After")) if resp.status == 503 else None)
    if resp.status == 200:
        offset = 0  # the server sent the whole file: start over
    else:
        crange = resp.getheader("Content-Range") or ""
        if not crange.startswith(f"bytes {offset}-"):
            raise TransferError(f"registry answered range {crange!r} to a request from byte {offset}")
    length = resp.getheader("Content-Length")
    if length is not None and length.isdigit() and offset + int(length) != size:
        raise TransferError(f"file is {offset + int(length)} bytes on the registry, the release says {size}")
    return offset


def _write_body(resp: http.client.HTTPResponse, dest: Path, offset: int, size: int, chunk: int,
                should_stop: Callable[[], bool], on_chunk: Callable[[], None] | None) -> int:
    """The body written from ``offset`` on, made durable; the bytes written (never past ``size``)."""
    got = 0
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
    return got
