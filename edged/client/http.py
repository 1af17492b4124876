"""A small synchronous KServe v2 client over HTTP/1.1 (TCP or a Unix socket) on raw sockets.

It exists so that ``edged infer --transport http`` and scripts need nothing beyond
edged's runtime dependencies (tritonclient works too, but pulls gevent). It writes
requests with one ``sendmsg`` of [head, JSON header, tensor buffers] (no joining,
no copies of the tensors) and parses answers with httptools: ``http.client`` spent
more time parsing headers than the daemon spent serving. Tensors go as Triton's
binary extension by default; ``binary=False`` sends and asks for plain JSON.
One persistent connection; a lock makes a client safe to share between threads,
but one client per thread is faster. ``timeout`` bounds each request's whole answer. A kept
connection the server closed while idle is replaced before the request goes out; when one closes
under a request without answering, only a request that did not go out whole, or an idempotent
one (GET...), is sent again: a POST the daemon may have acted on raises UNAVAILABLE instead.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httptools
import numpy as np
import orjson

from edged import datatypes
from edged.errors import EdgedError, ErrorCode
from edged.protocol.v2 import bytes_from_buffer, bytes_to_buffer

_CODES = {400: ErrorCode.INVALID_ARGUMENT, 401: ErrorCode.UNAUTHENTICATED, 403: ErrorCode.PERMISSION_DENIED,
          404: ErrorCode.NOT_FOUND, 409: ErrorCode.FAILED_PRECONDITION,
          413: ErrorCode.INVALID_ARGUMENT, 504: ErrorCode.DEADLINE_EXCEEDED, 507: ErrorCode.RESOURCE_EXHAUSTED}
_RECV = 1 << 18
# Methods that may be sent again when a reused connection closes before any answer (RFC 9110 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})


class HttpStatusError(EdgedError):
    """The server answered with an error status; ``status`` is the HTTP code, ``code`` its ErrorCode."""

    def __init__(self, status: int, message: str, code: ErrorCode) -> None:
        super().__init__(message, code=code)
        self.status = status


class _ClosedError(Exception):
    """The server closed the connection before a complete answer."""


class Response:
    """One parsed HTTP response (httptools callbacks fill it)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._chunks: list[bytes] = []
        self.body = b""
        self.complete = False

    def header(self, name: str) -> str | None:
        v = self.headers.get(name.lower().encode())
        return None if v is None else v.decode("latin-1")

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        self.complete = True


def parse_url(url: str) -> tuple[str, str, int]:
    """-> (kind, host or socket path, port): ``http://h:p``, ``h:p``, ``unix:/path`` or ``/path``."""
    if url.startswith("unix:"):
        return "unix", url[5:], 0
    if url.startswith("/"):
        return "unix", url, 0
    rest = url.removeprefix("http://").rstrip("/")
    if "://" in rest or "/" in rest:
        raise EdgedError(f"unsupported URL {url!r}: use host:port, http://host:port or a Unix socket path",
                         code=ErrorCode.INVALID_ARGUMENT)
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.startswith("[")):
        host, port = rest, "8000"
    return "tcp", host.strip("[]") or "127.0.0.1", int(port)


def _raw(arr: np.ndarray) -> bytes | memoryview:
    if arr.dtype == np.object_:
        return bytes_to_buffer(arr)
    return np.ascontiguousarray(arr).reshape(-1).data.cast("B")


def _send_all(sock: socket.socket, chunks: list[bytes | memoryview]) -> None:
    """sendmsg as much as the kernel takes, then finish piece by piece (large tensors go out partially)."""
    sent = sock.sendmsg(chunks)
    for chunk in chunks:
        n = len(chunk)
        if sent >= n:
            sent -= n
            continue
        sock.sendall(memoryview(chunk)[sent:])
        sent = 0


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _stale(sock: socket.socket) -> bool:
    """Whether an idle kept-alive connection has something to read: the server closed it (or sent what
    no request asked for). Either way it must not carry the next request."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class HttpClient:
    def __init__(self, url: str = "127.0.0.1:8000", *, timeout: float = 60.0, token: str | None = None) -> None:
        """``token``: the management credential ([control] token), sent with every request."""
        self.url = url
        self.timeout = timeout
        self._auth = b"" if token is None else b"Authorization: Bearer %s\r\n" % token.encode("latin-1")
        self._kind, self._addr, self._port = parse_url(url)
        self._host_header = (self._addr if self._kind == "tcp" else "localhost").encode()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._shortened = False  # the connection's read timeout was cut to a request's remaining time
        self._heads: dict[tuple[object, ...], bytes] = {}  # infer(): see there
        self._layouts: dict[bytes, list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]]] = {}

    # ---- connection -------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self._kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect(self._addr)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self._addr, self._port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Kernel timeouts instead of Python's timeout mode, which polls before every send and recv.
        sock.settimeout(None)
        tv = _timeval(self.timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        return sock

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Sequence[bytes | memoryview] = (),
                headers: Mapping[str, str] | None = None) -> Response:
        """Send one request (body given as chunks, sent without joining) and read the whole answer."""
        chunks = [memoryview(b).cast("B") if isinstance(b, memoryview) else b for b in body]
        return self._round_trip(method, [self._head(method, path, sum(len(c) for c in chunks), headers), *chunks])

    def _head(self, method: str, path: str, length: int, headers: Mapping[str, str] | None) -> bytes:
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n" % (
            method.encode(), path.encode(), self._host_header, length), self._auth]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        return b"".join(head)

    def _round_trip(self, method: str, message: list[bytes | memoryview]) -> Response:
        """Send ``message`` (the head, then the body's chunks) and read the whole answer."""
        with self._lock:
            deadline = time.monotonic() + self.timeout
            for attempt in (0, 1):
                sent = answered = reused = False
                try:
                    sock, reused = self._connection()
                    _send_all(sock, message)
                    sent = True
                    resp = Response()
                    parser = httptools.HttpResponseParser(resp)
                    while not resp.complete:
                        data = sock.recv(_RECV)
                        if not data:
                            raise _ClosedError
                        answered = True
                        parser.feed_data(data)
                        if not resp.complete:  # ``timeout`` bounds the whole answer, not each read
                            self._shorten(sock, deadline - time.monotonic())
                    resp.status = parser.get_status_code()
                    # (httptools resets its keep-alive flag once a message completes: read the header)
                    if resp.headers.get(b"connection", b"").lower() == b"close" or \
                            parser.get_http_version() == "1.0":
                        self._drop()
                    return resp
                except (_ClosedError, BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as e:
                    self._drop()
                    # Send again only on a reused connection, and only what cannot have been acted on twice:
                    # a request that did not go out whole, or an idempotent one that got no answer.
                    if attempt or not reused or answered or (sent and method not in _IDEMPOTENT):
                        raise EdgedError(f"connection to edged at {self.url} failed: "
                                         f"{e or 'closed by the server'}", code=ErrorCode.UNAVAILABLE) from None
                except httptools.HttpParserError as e:
                    self._drop()
                    raise EdgedError(f"edged at {self.url} sent a malformed HTTP response: {e}",
                                     code=ErrorCode.INTERNAL) from None
                except (BlockingIOError, TimeoutError):
                    self._drop()
                    raise EdgedError(f"edged at {self.url} did not answer within {self.timeout:g} s",
                                     code=ErrorCode.DEADLINE_EXCEEDED) from None
                except OSError as e:
                    self._drop()
                    raise EdgedError(f"cannot reach edged at {self.url}: {e.strerror or e}",
                                     code=ErrorCode.UNAVAILABLE) from None
                except BaseException:
                    # Interrupted (a signal, KeyboardInterrupt) with the request out: its answer may still
                    # come on this connection, where the next request would read it as its own.
                    self._drop()
                    raise
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[socket.socket, bool]:  # lock held
        """The connection for the next request, and whether it is one kept from an earlier request."""
        if self._sock is not None and _stale(self._sock):
            self._drop()  # closed by the server while it was idle
        if self._sock is None:
            self._sock = self._connect()
            return self._sock, False
        if self._shortened:  # the last answer cut its read timeout
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))
            self._shortened = False
        return self._sock, True

    def _shorten(self, sock: socket.socket, left: float) -> None:  # lock held
        """Bound the next read by what is left of the request's deadline (the next request restores it)."""
        if left <= 0:
            raise TimeoutError
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(max(left, 1e-3)))
        self._shortened = True

    def _drop(self) -> None:  # lock held
        self._shortened = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        chunks = [orjson.dumps(body)] if body is not None else []
        resp = self.request(method, path, chunks, {"Content-Type": "application/json"})
        _check(resp)
        return orjson.loads(resp.body) if resp.body else None

    # ---- API --------------------------------------------------------------------------------
    def live(self) -> bool:
        return self.request("GET", "/v2/health/live").status == 200

    def ready(self, model: str | None = None, version: int | None = None) -> bool:
        """Server readiness, or one model's when ``model`` is given."""
        path = "/v2/health/ready" if model is None else _model_path(model, version) + "/ready"
        return self.request("GET", path).status == 200

    def server_metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = self._json("GET", "/v2")
        return out

    def metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self._json("GET", _model_path(model, version))
        return out

    def config(self, model: str, version: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self._json("GET", _model_path(model, version) + "/config")
        return out

    def statistics(self, model: str | None = None) -> list[dict[str, Any]]:
        path = "/v2/models/stats" if model is None else _model_path(model, None) + "/stats"
        out: list[dict[str, Any]] = self._json("GET", path)["model_stats"]
        return out

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None,
              binary: bool = True, *, outputs: Sequence[str] | None = None,
              timeout_us: int | None = None) -> dict[str, np.ndarray]:
        """Run one inference; raises :class:`HttpStatusError` (an EdgedError) when the server refuses.

        A binary request of the same model, input names, shapes and dtypes, outputs and timeout as one
        before has the same head and JSON header: they are kept (``_heads``), so such a call only sends
        its tensors' bytes after them; an answer whose JSON header repeats an earlier one's is read by
        that one's layout (``_layouts``)."""
        key = _head_key(model, version, inputs, outputs, timeout_us) if binary else None
        head = self._heads.get(key) if key is not None else None
        if head is not None:
            message: list[bytes | memoryview] = [head]
            for value in inputs.values():
                message.append(_raw(value))
        else:
            hjson, tails = _encode_inputs(inputs, binary, outputs, timeout_us)
            headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
            if binary:
                headers["Inference-Header-Content-Length"] = str(len(hjson))
            path = _model_path(model, version) + "/infer"
            first = self._head("POST", path, len(hjson) + sum(len(t) for t in tails), headers) + hjson
            message = [first, *tails]
            if key is not None:
                if len(self._heads) >= _KEPT:
                    self._heads.clear()
                self._heads[key] = first
        resp = self._round_trip("POST", message)
        _check(resp)
        return self._decode(resp)

    def _decode(self, resp: Response) -> dict[str, np.ndarray]:
        """The answer's outputs; a JSON header seen before is not parsed again (see :func:`_layout`)."""
        hlen_text = resp.header("Inference-Header-Content-Length")
        body = resp.body
        if hlen_text is None:
            return decode_response(body, None)
        try:
            hlen = int(hlen_text)
        except ValueError:
            return decode_response(body, hlen_text)  # (raises: malformed)
        hkey = body[:hlen]
        layout = self._layouts.get(hkey)
        if layout is None or (layout and layout[-1][4] > len(body) - hlen):  # (a short tail: decoded, refused)
            out = decode_response(body, hlen_text)
            kept = _layout(orjson.loads(hkey), len(body) - hlen)
            if kept is not None:
                if len(self._layouts) >= _KEPT:
                    self._layouts.clear()
                self._layouts[hkey] = kept
            return out
        tail = memoryview(body)[hlen:]
        return {name: np.frombuffer(tail[a:b], dtype=dt).reshape(shape) for name, dt, shape, a, b in layout}


_KEPT = 32  # request heads and answer layouts a client keeps


def _head_key(model: str, version: int | None, inputs: Mapping[str, Any], outputs: Sequence[str] | None,
              timeout_us: int | None) -> tuple[object, ...] | None:
    """What makes a binary request's head and JSON header (None: not keyed; arrays of objects (BYTES)
    vary in length with their contents)."""
    key: list[object] = [model, version, None if outputs is None else tuple(outputs), timeout_us]
    for name, value in inputs.items():
        if type(value) is not np.ndarray or value.dtype.kind == "O":
            return None
        key += (name, value.dtype, value.shape)
    return tuple(key)


def _encode_inputs(inputs: Mapping[str, np.ndarray], binary: bool, outputs: Sequence[str] | None,
                   timeout_us: int | None) -> tuple[bytes, list[bytes | memoryview]]:
    """The request's JSON header, and its tensors' bytes when ``binary``."""
    entries: list[dict[str, Any]] = []
    tails: list[bytes | memoryview] = []
    for name, value in inputs.items():
        arr = np.asarray(value)
        dt = datatypes.from_numpy(arr.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": dt, "shape": list(arr.shape)}
        if binary:
            raw = _raw(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            tails.append(raw)
        elif dt == "BYTES":
            entry["data"] = [b.decode("utf-8") if isinstance(b, bytes) else str(b) for b in arr.ravel()]
        else:
            entry["data"] = np.ascontiguousarray(arr).ravel()
        entries.append(entry)
    header: dict[str, Any] = {"inputs": entries, "parameters": {"binary_data_output": binary}}
    if outputs is not None:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    if timeout_us:
        header["parameters"]["timeout"] = int(timeout_us)
    return orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY), tails


def _layout(header: Any, tail_len: int) -> list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]] | None:
    """Where each output of an answer lies in its binary tail, when every output is a numeric binary one
    that fits it exactly (what :func:`decode_outputs` checked); None otherwise (decoded afresh each time)."""
    out = []
    pos = 0
    for o in header["outputs"]:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if o["datatype"] == "BYTES" or not isinstance(size, int):
            return None
        out.append((o["name"], datatypes.to_numpy(o["datatype"]), tuple(o["shape"]), pos, pos + size))
        pos += size
    return out if pos <= tail_len else None


def _model_path(model: str, version: int | None) -> str:
    path = "/v2/models/" + quote(model, safe="")
    return path if version is None else f"{path}/versions/{int(version)}"


def _check(resp: Response) -> None:
    status = resp.status
    if status == 200:
        return
    try:
        message = str(orjson.loads(resp.body)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = f"HTTP status {status}"
    if status == 503:
        code = ErrorCode.OVERLOADED if resp.header("Retry-After") else ErrorCode.UNAVAILABLE
    else:
        code = _CODES.get(status, ErrorCode.INTERNAL)
    raise HttpStatusError(status, message, code)


def decode_response(data: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """Outputs of a v2 response body (JSON, or JSON header + binary tail); binary ones are read-only views."""
    try:
        hlen = int(header_length) if header_length is not None else len(data)
        header = orjson.loads(memoryview(data)[:hlen])
    except (orjson.JSONDecodeError, ValueError) as e:
        raise EdgedError(f"malformed inference response: {e}", code=ErrorCode.INTERNAL) from None
    return decode_outputs(header, memoryview(data)[hlen:])


def decode_outputs(header: Any, tail: Any) -> dict[str, np.ndarray]:
    """The outputs a v2 response header names, binary ones read-only views of ``tail`` (the bytes after
    the header), as every transport's answer carries them. INTERNAL when they do not add up: the answer
    is wrong, not the request."""
    view = memoryview(tail)
    try:
        out: dict[str, np.ndarray] = {}
        pos = 0
        for o in header["outputs"]:
            dt, shape = o["datatype"], tuple(o["shape"])
            size = (o.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                chunk = view[pos:pos + size]
                pos += size
                if dt == "BYTES":
                    out[o["name"]] = bytes_from_buffer(chunk, math.prod(shape), o["name"]).reshape(shape)
                else:
                    out[o["name"]] = np.frombuffer(chunk, dtype=datatypes.to_numpy(dt)).reshape(shape)
            elif "data" in o:
                if dt == "BYTES":
                    arr = np.array([s.encode() if isinstance(s, str) else s for s in o["data"]], dtype=object)
                    out[o["name"]] = arr.reshape(shape)
                else:
                    out[o["name"]] = np.asarray(o["data"], dtype=datatypes.to_numpy(dt)).reshape(shape)
        return out
    except (KeyError, TypeError, ValueError, AttributeError, EdgedError) as e:
        # (an EdgedError here is the decoders' InvalidInputError: the answer is wrong, not the request)
        raise EdgedError(f"malformed inference response: {e}", code=ErrorCode.INTERNAL) from None
