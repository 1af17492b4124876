"""The registry HTTP API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Three callers, three kinds of credential in ``Authorization: Bearer``: operators (a named API
token with a role, or the bootstrap admin token) read, publish and administer, as
:mod:`edged.registry.access` allows each route, checked by one dependency of the whole app;
devices (their per-device credential) read only their own desired state and the files of the
releases meant for them, and write only their own reports; anyone may
enroll with a valid enrollment token. The app holds no state of its own, so several
processes may serve one PostgreSQL database and one shared blob folder (what it caches —
the release snapshot, small blobs, model ids — is checked against the database or
immutable).

A fleet's traffic is polls, then reports and downloads when a rollout step starts. Those
endpoints run on the event loop: one short read-only query each (the write lock is never
involved), then the cached snapshot; reports are handed to one writer thread that commits
many per transaction (:mod:`edged.registry.writer`). The operators' endpoints run in the
thread pool. Rollouts are evaluated by a background thread (:mod:`edged.registry.evaluator`).

This module builds the app's parts once (:class:`~edged.registry.deps.AppContext`) and mounts one router
per concern from :mod:`edged.registry.routes` (devices, releases and blobs, fleet admin, rollouts), the
telemetry router and the dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edged import __version__
from edged.errors import ErrorCode
from edged.protocol.fleet.messages import API_PREFIX
from edged.protocol.fleet.nudge import Nudger
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry import api_tokens
from edged.registry.access import Guard
from edged.registry.blob_urls import UrlSigner, signing_key
from edged.registry.blobs import BlobError, BlobStore, SmallBlobCache
from edged.registry.db import make_engine, make_sessionmaker, readonly
from edged.registry.deps import AppContext
from edged.registry.desired import SnapshotCache
from edged.registry.evaluator import Evaluator
from edged.registry.fastpath import DeviceFastPath, validation_status
from edged.registry.lastseen import LastSeen
from edged.registry.migrate import upgrade
from edged.registry.routes.access import access_router
from edged.registry.routes.admin import admin_router, health_router
from edged.registry.routes.devices import devices_router
from edged.registry.routes.releases import releases_router
from edged.registry.routes.rollouts import rollouts_router
from edged.registry.service import RegistryError
from edged.registry.settings import RegistrySettings
from edged.registry.shed import LoadSignal, ShedDeviceWrites
from edged.registry.telemetry_ingest import telemetry_router
from edged.registry.web import install as install_dashboard
from edged.registry.web import renderer as dashboard_renderer
from edged.registry.writer import ReportWriter

log = logging.getLogger(__name__)
MAX_JSON_BYTES = 8 << 20


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class BodyLimit:
    """Refuse JSON bodies over a limit, counted as they arrive (Content-Length may be absent or lie).

    Blob uploads (PUT under ``exempt_prefix``) have their own, larger limit in the endpoint.
    """

    def __init__(self, app: ASGIApp, limit: int, exempt_prefix: str) -> None:
        self.app, self.limit, self.exempt = app, limit, exempt_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "PUT" and scope["path"].startswith(self.exempt)):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLargeError
            return msg

        # A chunked body that grows too large aborts the request (the framework answers 400).
        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(413, ErrorCode.INVALID_ARGUMENT.value, f"request body over {self.limit} bytes")(
            scope, receive, send)


class _TooLargeError(Exception):
    pass


def create_app(settings: RegistrySettings) -> FastAPI:
    admin_hash = settings.admin_token_hash()
    settings.check_keys()
    settings.prepare_storage()
    engine = make_engine(settings.db_url)
    if settings.migrate:
        upgrade(engine)
    sessions = make_sessionmaker(engine)
    ro_engine = readonly(engine)
    store = BlobStore(settings.blobs)
    ctx = AppContext(
        settings=settings, engine=engine, sessions=sessions,
        read_sessions=make_sessionmaker(ro_engine), ro_engine=ro_engine, snapshots=SnapshotCache(),
        last_seen=LastSeen(engine, flush_s=settings.last_seen_flush_s,
                           resolution_s=settings.last_seen_resolution_s), report_writer=ReportWriter(engine),
        store=store, blob_cache=SmallBlobCache(store),
        # With a blob server, devices are redirected to it: no file's bytes cross this process's event loop.
        blob_signer=(UrlSigner(signing_key(settings.blobs), settings.blob_url_ttl_s)
                     if settings.blob_listen is not None or settings.blob_url is not None else None),
        nudger=Nudger(settings.nudge_mqtt_url, settings.nudge_topic_prefix) if settings.nudge_mqtt_url else None)
    load = LoadSignal(max_lag_s=settings.shed_loop_lag_s or float("inf"), backlog=ctx.report_writer.backlog)
    # While the registry sheds load, running rollouts let no more devices start updating.
    pages = dashboard_renderer(settings, ctx.read_sessions, ctx.snapshots)
    evaluator = Evaluator(sessions, settings.rollout_tick_s, on_change=ctx.rollout_changed,
                          read_sessions=ctx.read_sessions, busy=load.busy if settings.shed_loop_lag_s > 0 else None)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.last_seen.start()
        ctx.report_writer.start()
        evaluator.start()
        if settings.shed_loop_lag_s > 0:
            load.start()
        yield
        await load.stop()
        await asyncio.to_thread(pages.close)
        await asyncio.to_thread(evaluator.stop)
        await asyncio.to_thread(ctx.report_writer.stop)
        await asyncio.to_thread(ctx.last_seen.stop)
        if ctx.nudger is not None:
            ctx.nudger.close()
        engine.dispose()
        ro_engine.dispose()

    # Who may call what: one rule per route (edged.registry.access.RULES), checked before any handler.
    guard = Guard(admin_hash, functools.partial(api_tokens.lookup, ctx.read_sessions))
    app = FastAPI(title="edged registry", version=__version__, lifespan=lifespan, dependencies=[Depends(guard)],
                  description="Model versions, signed releases, device enrollment, desired state and reports.")
    app.state.load_signal = load
    app.add_middleware(BodyLimit, limit=MAX_JSON_BYTES, exempt_prefix=f"{API_PREFIX}/blobs/")
    app.add_middleware(DeviceFastPath, ctx=ctx, max_body=MAX_JSON_BYTES)
    if settings.shed_loop_lag_s > 0:  # outermost: a shed request costs no parsing, no authentication
        app.add_middleware(ShedDeviceWrites, signal=load, retry_after_s=settings.shed_retry_after_s,
                           # weights: at the top level (2) telemetry and facts are all shed, reports 90 %,
                           # blob requests 70 %: some updates always progress, or a wave never ends
                           routes=[("POST", INGEST_PATH, 2.0), ("PUT", f"{API_PREFIX}/device/facts", 1.0),
                                   ("POST", f"{API_PREFIX}/device/reports", 0.45),
                                   ("GET", f"{API_PREFIX}/blobs/", 0.35)])
    app.include_router(telemetry_router(sessions, settings.last_seen_resolution_s))
    _install_error_handlers(app)
    for router in (health_router, devices_router, releases_router, admin_router, rollouts_router, access_router):
        app.include_router(router(ctx))
    # The dashboard (/ui) after the error handlers, so that its errors become pages.
    install_dashboard(app, guard, settings=settings, admin_hash=admin_hash, sessions=sessions,
                      read_sessions=ctx.read_sessions, renderer=pages,
                      on_rollout_change=lambda rid, what: ctx.rollout_changed({rid: what}))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": {"code", "message"}}``, whichever layer raised it."""

    @app.exception_handler(RegistryError)
    async def _registry_error(_r: Request, e: RegistryError) -> JSONResponse:
        return _error(e.status, e.code.value, e.message)

    @app.exception_handler(BlobError)
    async def _blob_error(_r: Request, e: BlobError) -> JSONResponse:
        return _error(400, e.code.value, e.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, e: RequestValidationError) -> JSONResponse:
        # Built from locations and messages only: the offending input (maybe a token) is never echoed.
        errors = e.errors()
        problems = [".".join(str(p) for p in err.get("loc", ())) + ": " + str(err.get("msg", "")) for err in errors]
        return _error(validation_status(errors), ErrorCode.INVALID_ARGUMENT.value, "; ".join(problems)[:2000])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, "http", str(e.detail))
