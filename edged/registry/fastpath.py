"""The device calls a fleet makes most (poll, reports, facts) served without the web framework's layers.

At 10,000 devices the registry answers hundreds of these a second on one event loop, and in
a download wave thousands; measured there, the framework's middleware stack, routing over
every route and dependency solving cost more than the calls' own work. This ASGI middleware
matches the three paths exactly and calls the same functions the FastAPI routes call
(:mod:`edged.registry.routes.devices`), with the same checks: the body limit, JSON
validation with the same error form, the same status codes and headers. Anything else, and
any other method, goes on to the application unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import API_PREFIX, DeviceFactsUpdate, ReportBatch
from edged.protocol.fleet.telemetry import BatchTooLargeError
from edged.registry.deps import AppContext
from edged.registry.routes.devices import poll, take_facts, take_reports
from edged.registry.service import RegistryError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[dict[bytes, bytes], bytes], Awaitable[tuple[int, dict[str, str], bytes]]]


class _TooLargeError(Exception):
    pass


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, orjson.dumps({"error": {"code": code, "message": message}})


_RANGE = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"})


def validation_status(errors: Sequence[Any]) -> int:
    """413: a collection over its bound (``serving``, events, telemetry windows...); 400: a number out of
    range or not finite (counts above 2^53, NaN, infinity); 422: any other body that does not fit the schema."""
    if any(err.get("type") == "too_long" or isinstance((err.get("ctx") or {}).get("error"), BatchTooLargeError)
           for err in errors):
        return 413
    if any(err.get("type") in _RANGE for err in errors):
        return 400
    return 422


def _invalid(e: ValidationError) -> tuple[int, dict[str, str], bytes]:
    # As the application's handler words it (locations and messages, never the input), "body." first.
    errors = e.errors()
    problems = [".".join(["body", *(str(p) for p in err.get("loc", ()))]) + ": " + str(err.get("msg", ""))
                for err in errors]
    return _error(validation_status(errors), ErrorCode.INVALID_ARGUMENT.value, "; ".join(problems)[:2000])


def _json(model: BaseModel) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, model.model_dump_json().encode()


class DeviceFastPath:
    def __init__(self, app: ASGIApp, ctx: AppContext, max_body: int) -> None:
        self.app, self.ctx, self.max_body = app, ctx, max_body
        self.routes: dict[tuple[str, str], tuple[Handler, bool]] = {
            ("GET", f"{API_PREFIX}/device/desired-state"): (self._poll, False),
            ("POST", f"{API_PREFIX}/device/reports"): (self._reports, True),
            ("PUT", f"{API_PREFIX}/device/facts"): (self._facts, True),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        handler, with_body = route
        headers = dict(scope["headers"])
        try:
            body = await self._body(headers, receive) if with_body else b""
            status, out, data = await handler(headers, body)
        except _TooLargeError:
            status, out, data = _error(413, ErrorCode.INVALID_ARGUMENT.value,
                                       f"request body over {self.max_body} bytes")
        except RegistryError as e:
            status, out, data = _error(e.status, e.code.value, e.message)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            status, out, data = _error(500, ErrorCode.INTERNAL.value, "internal error")
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]
        if status != 304:
            raw.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": data if status != 304 else b""})

    async def _body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            raise _TooLargeError
        parts: list[bytes] = []
        seen, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                raise _TooLargeError
            parts.append(chunk)
            more = bool(msg.get("more_body"))
        return b"".join(parts)

    @staticmethod
    def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
        v = headers.get(name)
        return v.decode("latin-1") if v is not None else None

    async def _poll(self, headers: dict[bytes, bytes], _body: bytes) -> tuple[int, dict[str, str], bytes]:
        status, out, data = poll(self.ctx, self._header(headers, b"authorization"),
                                 self._header(headers, b"if-none-match"))
        if status == 200:
            out = {**out, "Content-Type": "application/json"}
        return status, out, data

    async def _reports(self, headers: dict[bytes, bytes], body: bytes) -> tuple[int, dict[str, str], bytes]:
        return await self._take(headers, body, ReportBatch, take_reports)

    async def _facts(self, headers: dict[bytes, bytes], body: bytes) -> tuple[int, dict[str, str], bytes]:
        return await self._take(headers, body, DeviceFactsUpdate, take_facts)

    async def _take(self, headers: dict[bytes, bytes], body: bytes, model: type[M],
                    call: Callable[[AppContext, str | None, M], Awaitable[BaseModel]]
                    ) -> tuple[int, dict[str, str], bytes]:
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as e:
            return _invalid(e)
        return _json(await call(self.ctx, self._header(headers, b"authorization"), parsed))
