"""A small asyncio HTTP/1.1 client with a keep-alive connection pool, for the fleet simulator.

Thousands of simulated devices share one process; a general-purpose client would spend
more CPU per request than the registry under test, and the simulator's own overhead would
show up as registry latency. This one writes the request bytes directly and parses
answers with httptools (already a dependency of the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from edged.client.inflight import Inflight


class SimHttpError(Exception):
    pass


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class _Parsed:
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    done: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def exchange(self, data: bytes) -> tuple[Answer, bool]:
        import httptools

        p = _Parsed()
        parser = httptools.HttpResponseParser(p)
        self.writer.write(data)
        await self.writer.drain()
        while not p.done:
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionResetError("connection closed by the server")
            parser.feed_data(chunk)
        return Answer(parser.get_status_code(), p.headers, b"".join(p.body)), parser.should_keep_alive()


class HttpPool:
    """Keep-alive connections to one host, at most ``limit`` at a time (then requests queue in order)."""

    def __init__(self, base_url: str, *, limit: int = 4096, timeout: float = 60.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise SimHttpError("the simulator speaks plain http://host:port only")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.timeout, self.limit = timeout, limit
        self._idle: list[_Conn] = []
        self._slots = Inflight(limit)  # requests beyond the limit queue in order
        self._host_header = f"{self.host}:{self.port}".encode()

    async def request(self, method: str, path: str, *, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> Answer:
        lines = [f"{method} {self.base}{path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}".encode())
        if body is not None:
            lines.append(b"Content-Type: application/json")
            lines.append(b"Content-Length: %d" % len(body))
        data = b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")
        await self._slots.take()
        try:
            return await asyncio.wait_for(self._send(method, path, data), self.timeout)
        except asyncio.TimeoutError:
            raise SimHttpError(f"{method} {path}: no answer within {self.timeout:g}s") from None
        finally:
            self._slots.give()

    async def _send(self, method: str, path: str, data: bytes) -> Answer:
        for attempt in (0, 1):
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else _Conn(*await asyncio.open_connection(self.host, self.port))
            try:
                answer, keep = await conn.exchange(data)
            except (OSError, asyncio.IncompleteReadError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: once more on a fresh one
                raise SimHttpError(f"{method} {path}: {type(e).__name__}: {e}") from None
            except BaseException as e:  # cancelled, or a malformed answer: this connection is unusable
                conn.close()
                if isinstance(e, Exception):
                    raise SimHttpError(f"{method} {path}: {type(e).__name__}: {e}") from None
                raise
            if keep:
                self._idle.append(conn)
            else:
                conn.close()
            return answer
        raise SimHttpError("unreachable")

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
