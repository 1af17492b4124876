"""The registry HTTP API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Three callers, three kinds of credential in ``Authorization: Bearer``: operators (the admin
token) publish; devices (their per-device credential) read only their own desired state and
the files of the releases meant for them, and write only their own reports; anyone may
enroll with a valid enrollment token. The app holds no state of its own, so several
processes may serve one PostgreSQL database and one shared blob folder (what it caches —
the release snapshot, small blobs, model ids — is checked against the database or
immutable).

A fleet's traffic is polls, then reports and downloads when a rollout step starts. Those
endpoints run on the event loop: one short read-only query each (the write lock is never
involved), then the cached snapshot; reports are handed to one writer thread that commits
many per transaction (:mod:`edged.registry.writer`). The operators' endpoints run in the
thread pool. Rollouts are evaluated by a background thread (:mod:`edged.registry.evaluator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import text
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edged import __version__
from edged.errors import ErrorCode
from edged.protocol.fleet.messages import (
    API_PREFIX,
    Accepted,
    DesiredState,
    DeviceFactsUpdate,
    DeviceInfo,
    EnrollmentTokenRequest,
    EnrollmentTokenResponse,
    EnrollRequest,
    EnrollResponse,
    LabelsUpdate,
    MissingBlobsRequest,
    MissingBlobsResponse,
    ModelInfo,
    NextRelease,
    PinRequest,
    PushVersionRequest,
    ReenrollRequest,
    RegistryStatus,
    ReleaseInfo,
    ReportBatch,
    VersionInfo,
)
from edged.protocol.fleet.nudge import Nudger
from edged.protocol.fleet.release import SignedRelease
from edged.registry import desired as desired_state
from edged.registry import rollouts, service
from edged.registry.auth import bearer_token, is_admin, token_hash
from edged.registry.blobs import SHA256_RE, BlobError, BlobStore, SmallBlobCache
from edged.registry.db import DeviceRow, make_engine, make_sessionmaker, readonly
from edged.registry.deps import Bearer, admin_check, credential, transaction
from edged.registry.evaluator import Evaluator, tick
from edged.registry.lastseen import LastSeen
from edged.registry.migrate import upgrade
from edged.registry.rollout_wire import RolloutAction, RolloutCreate, RolloutInfo, RolloutStatus
from edged.registry.service import RegistryError
from edged.registry.settings import RegistrySettings
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
    read_sessions = make_sessionmaker(ro_engine)
    snapshots = desired_state.SnapshotCache()
    last_seen = LastSeen(engine, flush_s=settings.last_seen_flush_s)
    report_writer = ReportWriter(engine)
    store = BlobStore(settings.blobs)
    blob_cache = SmallBlobCache(store)
    nudger = Nudger(settings.nudge_mqtt_url, settings.nudge_topic_prefix) if settings.nudge_mqtt_url else None
    max_upload = int(settings.max_upload_mb * (1 << 20))

    def rollout_changed(changes: dict[int, str]) -> None:
        for rid, what in changes.items():
            nudge({"rollout": rid, "change": what})

    evaluator = Evaluator(sessions, settings.rollout_tick_s, on_change=rollout_changed, read_sessions=read_sessions)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        last_seen.start()
        report_writer.start()
        evaluator.start()
        yield
        await asyncio.to_thread(evaluator.stop)
        await asyncio.to_thread(report_writer.stop)
        await asyncio.to_thread(last_seen.stop)
        if nudger is not None:
            nudger.close()
        engine.dispose()

    app = FastAPI(title="edged registry", version=__version__, lifespan=lifespan,
                  description="Model versions, signed releases, device enrollment, desired state and reports.")
    app.add_middleware(BodyLimit, limit=MAX_JSON_BYTES, exempt_prefix=f"{API_PREFIX}/blobs/")

    def tx() -> contextlib.AbstractContextManager[Session]:
        return transaction(sessions)

    @contextlib.contextmanager
    def rtx() -> Iterator[Session]:
        """For reads only: on SQLite it does not wait for, or hold, the write lock."""
        with read_sessions() as s, s.begin():
            yield s

    admin = Depends(admin_check(admin_hash))

    def unauthorized() -> RegistryError:
        return RegistryError("a valid device credential is required", 401, ErrorCode.INVALID_ARGUMENT)

    def authenticate(conn: Any, request: Request) -> desired_state.DeviceView:
        token = bearer_token(request.headers.get("authorization"))
        view, _rev = desired_state.lookup_credential(conn, token_hash(token)) if token else (None, 0)
        if view is None:
            raise unauthorized()
        return view

    def decide(conn: Any, request: Request) -> desired_state.Desired:
        """The hot path of a large fleet: one read-only query, the cached snapshot, no write."""
        token = bearer_token(request.headers.get("authorization"))
        view, rev = desired_state.lookup_credential(conn, token_hash(token)) if token else (None, 0)
        if view is None:
            raise unauthorized()
        out = desired_state.decide(snapshots.get(conn, rev), view)
        last_seen.note(view.id, view.last_seen_at)
        return out

    def device_of(s: Session, auth: HTTPAuthorizationCredentials | None) -> DeviceRow:
        dev = service.device_for_credential(s, auth.credentials) if auth is not None else None
        if dev is None:
            raise RegistryError("a valid device credential is required", 401, ErrorCode.INVALID_ARGUMENT)
        return dev

    def nudge(payload: dict[str, Any]) -> None:
        if nudger is not None:
            try:
                nudger.nudge(payload)
            except Exception as e:  # a nudge is an optimisation; never fail the release over it
                log.warning("MQTT nudge not sent: %s", e)

    from edged.registry.telemetry_ingest import telemetry_router

    app.include_router(telemetry_router(sessions, admin_hash))

    # ---- errors -------------------------------------------------------------------------------
    @app.exception_handler(RegistryError)
    async def _registry_error(_r: Request, e: RegistryError) -> JSONResponse:
        return _error(e.status, e.code.value, e.message)

    @app.exception_handler(BlobError)
    async def _blob_error(_r: Request, e: BlobError) -> JSONResponse:
        return _error(400, e.code.value, e.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, e: RequestValidationError) -> JSONResponse:
        # Built from locations and messages only: the offending input (maybe a token) is never echoed.
        problems = [".".join(str(p) for p in err.get("loc", ())) + ": " + str(err.get("msg", "")) for err in e.errors()]
        return _error(422, ErrorCode.INVALID_ARGUMENT.value, "; ".join(problems)[:2000])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, "http", str(e.detail))

    # ---- health -------------------------------------------------------------------------------
    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        with tx() as s:
            s.execute(text("SELECT 1"))
        return {"status": "ok"}

    # ---- devices ------------------------------------------------------------------------------
    @app.post(f"{API_PREFIX}/enroll", tags=["device"], response_model=EnrollResponse)
    def enroll(req: EnrollRequest) -> EnrollResponse:
        with tx() as s:
            out = service.enroll(s, req)
        log.info("device %s enrolled", req.device_id)
        return out

    @app.get(f"{API_PREFIX}/device/desired-state", tags=["device"], response_model=DesiredState,
             responses={304: {"description": "unchanged since the ETag in If-None-Match"}},
             openapi_extra={"security": [{"HTTPBearer": []}], "parameters": [
                 {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}}]})
    async def desired(request: Request) -> Response:
        # Runs on the event loop: one short read-only query, no thread hand-off (see the module docstring).
        with ro_engine.connect() as conn:
            d = decide(conn, request)
        etag = d.etag()
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if_none_match = request.headers.get("if-none-match")
        if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
            return Response(status_code=304, headers=headers)
        return Response(d.body(), media_type="application/json", headers=headers)

    @app.post(f"{API_PREFIX}/device/reports", tags=["device"], response_model=Accepted,
              openapi_extra={"security": [{"HTTPBearer": []}]})
    async def reports(batch: ReportBatch, request: Request) -> Accepted:
        with ro_engine.connect() as conn:
            view = authenticate(conn, request)
        last_seen.note(view.id, view.last_seen_at)
        n = await asyncio.wrap_future(report_writer.submit(view.id, batch.events))
        return Accepted(accepted=n)

    @app.put(f"{API_PREFIX}/device/facts", tags=["device"], response_model=Accepted,
             openapi_extra={"security": [{"HTTPBearer": []}]})
    async def facts(upd: DeviceFactsUpdate, request: Request) -> Accepted:
        # Devices resend their facts periodically; most of the time nothing changed and nothing is written.
        with read_sessions() as s:
            view = authenticate(s.connection(), request)
            service.refuse_self_labels(upd)
            dev = s.get_one(DeviceRow, view.id)
            if not service.facts_changed(dev, upd):
                last_seen.note(dev.id, dev.last_seen_at)
                return Accepted(accepted=0)

        def write() -> None:
            with tx() as s:
                service.update_facts(s, s.get_one(DeviceRow, view.id), upd)

        await asyncio.to_thread(write)
        return Accepted(accepted=1)

    @app.post(f"{API_PREFIX}/device/credential", tags=["device"], response_model=EnrollResponse,
              openapi_extra={"security": [{"HTTPBearer": []}]})
    def rotate_credential(auth: Bearer) -> EnrollResponse:
        """A new credential for the device holding the current one (which stops working)."""
        with tx() as s:
            out = service.rotate_credential(device_of(s, auth))
        log.info("device %s rotated its credential", out.device_id)
        return out

    @app.get(f"{API_PREFIX}/blobs/{{sha256}}", tags=["device", "admin"],
             responses={200: {"content": {"application/octet-stream": {}}}, 206: {"description": "a byte range"}})
    async def get_blob(sha256: str, auth: Bearer, request: Request) -> Response:
        if not SHA256_RE.match(sha256):
            raise service.invalid("not a lower-case hex sha256")
        if not is_admin(credential(auth), admin_hash):
            with ro_engine.connect() as conn:
                if not desired_state.blob_allowed(conn, decide(conn, request), sha256, snapshots):
                    raise RegistryError("this file is not part of a release for this device", 403,
                                        ErrorCode.NOT_FOUND)
        headers = {"ETag": f'"{sha256}"', "Cache-Control": "private, max-age=31536000, immutable",
                   "Accept-Ranges": "bytes"}
        if "range" not in request.headers:
            data = blob_cache.get(sha256)
            if data is None:
                data = await asyncio.to_thread(blob_cache.load, sha256)
            if data is not None:
                return Response(data, media_type="application/octet-stream", headers=headers)
        path = store.path(sha256)
        if not await asyncio.to_thread(path.is_file):
            raise service.not_found("blob")
        # Starlette answers Range / If-Range itself (206, 416); the digest is the strong ETag.
        return FileResponse(path, media_type="application/octet-stream", headers=headers)

    # ---- publishing (admin) -------------------------------------------------------------------
    @app.post(f"{API_PREFIX}/blobs/missing", tags=["admin"], response_model=MissingBlobsResponse, dependencies=[admin])
    def blobs_missing(req: MissingBlobsRequest) -> MissingBlobsResponse:
        with rtx() as s:
            return MissingBlobsResponse(missing=service.missing_blobs(s, store, req.sha256))

    @app.put(f"{API_PREFIX}/blobs/{{sha256}}", tags=["admin"], dependencies=[admin], status_code=201)
    async def put_blob(sha256: str, request: Request,
                       content_length: Annotated[int | None, Header()] = None) -> dict[str, Any]:
        if not SHA256_RE.match(sha256):
            raise service.invalid("not a lower-case hex sha256")
        if content_length is not None and content_length > max_upload:
            raise RegistryError(f"upload over the {settings.max_upload_mb:g} MB limit", 413,
                                ErrorCode.INVALID_ARGUMENT)
        writer = await asyncio.to_thread(store.begin, sha256)
        try:
            async for chunk in request.stream():
                if writer.size + len(chunk) > max_upload:
                    raise RegistryError(f"upload over the {settings.max_upload_mb:g} MB limit", 413,
                                        ErrorCode.INVALID_ARGUMENT)
                if chunk:
                    await asyncio.to_thread(writer.write, chunk)
            await asyncio.to_thread(writer.commit, content_length)
        finally:
            await asyncio.to_thread(writer.abort)
        size = writer.size

        def record() -> None:
            with tx() as s:
                service.record_blob(s, sha256, size)

        await asyncio.to_thread(record)
        return {"sha256": sha256, "size": size}

    @app.put(f"{API_PREFIX}/models/{{model}}/versions/{{version}}", tags=["admin"], response_model=VersionInfo,
             dependencies=[admin])
    def push_version(model: str, version: int, req: PushVersionRequest, response: Response) -> VersionInfo:
        with tx() as s:
            info = service.push_version(s, store, model, version, req.files)
        response.status_code = 201 if info.created else 200
        if info.created:
            log.info("model %s version %d pushed (%d files, %d bytes)", model, version, len(info.files),
                     info.total_size)
        return info

    @app.get(f"{API_PREFIX}/models", tags=["admin"], response_model=list[ModelInfo], dependencies=[admin])
    def models() -> list[ModelInfo]:
        with rtx() as s:
            return service.list_models(s)

    @app.get(f"{API_PREFIX}/models/{{model}}/versions/{{version}}", tags=["admin"], response_model=VersionInfo,
             dependencies=[admin])
    def get_version(model: str, version: int) -> VersionInfo:
        with rtx() as s:
            return service.get_version(s, model, version)

    @app.get(f"{API_PREFIX}/models/{{model}}/releases", tags=["admin"], response_model=list[ReleaseInfo],
             dependencies=[admin])
    def releases(model: str, signed: bool = False) -> list[ReleaseInfo]:
        with rtx() as s:
            return service.list_releases(s, model, signed)

    @app.get(f"{API_PREFIX}/models/{{model}}/next-release", tags=["admin"], response_model=NextRelease,
             dependencies=[admin])
    def next_release(model: str) -> NextRelease:
        with rtx() as s:
            return NextRelease(model=model, release=service.next_release_number(s, model))

    @app.post(f"{API_PREFIX}/releases", tags=["admin"], response_model=ReleaseInfo, status_code=201,
              dependencies=[admin])
    def create_release(signed: SignedRelease) -> ReleaseInfo:
        with tx() as s:
            info = service.create_release(s, signed, settings.public_keys)
        log.info("release %d of model %s (version %d) created, key %s", info.release, info.model, info.version,
                 info.key_id)
        nudge({"model": info.model, "release": info.release})
        return info

    @app.post(f"{API_PREFIX}/models/{{model}}/releases/{{number}}/revoke", tags=["admin"],
              response_model=ReleaseInfo, dependencies=[admin])
    def revoke(model: str, number: int) -> ReleaseInfo:
        with tx() as s:
            info = service.revoke_release(s, model, number)
        log.info("release %d of model %s revoked", number, model)
        nudge({"model": model, "revoked": number})
        return info

    @app.post(f"{API_PREFIX}/enrollment-tokens", tags=["admin"], response_model=EnrollmentTokenResponse,
              status_code=201, dependencies=[admin])
    def enrollment_token(req: EnrollmentTokenRequest) -> EnrollmentTokenResponse:
        with tx() as s:
            return service.create_enrollment_token(s, req)

    @app.get(f"{API_PREFIX}/devices", tags=["admin"], response_model=list[DeviceInfo], dependencies=[admin])
    def devices(label: Annotated[list[str] | None, Query()] = None) -> list[DeviceInfo]:
        wanted = dict(item.split("=", 1) for item in label or [] if "=" in item)
        with rtx() as s:
            return service.list_devices(s, wanted)

    @app.get(f"{API_PREFIX}/devices/{{device_id}}", tags=["admin"], response_model=DeviceInfo, dependencies=[admin])
    def device(device_id: str, events: int = 50) -> DeviceInfo:
        with rtx() as s:
            return service.get_device(s, device_id, max(0, min(events, 1000)))

    @app.patch(f"{API_PREFIX}/devices/{{device_id}}/labels", tags=["admin"], response_model=DeviceInfo,
               dependencies=[admin])
    def labels(device_id: str, req: LabelsUpdate) -> DeviceInfo:
        with tx() as s:
            return service.set_admin_labels(s, device_id, req.labels)

    @app.post(f"{API_PREFIX}/devices/{{device_id}}/reenroll", tags=["admin"], response_model=EnrollmentTokenResponse,
              status_code=201, dependencies=[admin])
    def reenroll(device_id: str, req: ReenrollRequest) -> EnrollmentTokenResponse:
        with tx() as s:
            out = service.reenroll_token(s, device_id, req)
        log.info("device %s: credential revoked by an operator, re-enrollment token issued", device_id)
        return out

    @app.put(f"{API_PREFIX}/devices/{{device_id}}/models/{{model}}/pin", tags=["admin"], response_model=DeviceInfo,
             dependencies=[admin])
    def pin(device_id: str, model: str, req: PinRequest) -> DeviceInfo:
        with tx() as s:
            return service.pin_release(s, device_id, model, req.release)

    @app.get(f"{API_PREFIX}/status", tags=["admin"], response_model=RegistryStatus, dependencies=[admin])
    def status(model: str | None = None) -> RegistryStatus:
        with rtx() as s:
            return service.registry_status(s, model)

    # ---- rollouts (admin) ---------------------------------------------------------------------
    @app.post(f"{API_PREFIX}/rollouts", tags=["admin", "rollouts"], response_model=RolloutInfo, status_code=201,
              dependencies=[admin])
    def create_rollout(req: RolloutCreate) -> RolloutInfo:
        with tx() as s:
            info = rollouts.create_rollout(s, req, settings.public_keys)
        log.info("rollout %d of model %s release %d (version %d) started: %d step(s), %d device(s) in the first",
                 info.id, info.model, info.release, info.version, len(info.steps), info.members)
        nudge({"model": info.model, "release": info.release, "rollout": info.id})
        return info

    @app.get(f"{API_PREFIX}/rollouts", tags=["admin", "rollouts"], response_model=list[RolloutInfo],
             dependencies=[admin])
    def list_rollouts(model: str | None = None, state: str | None = None) -> list[RolloutInfo]:
        with rtx() as s:
            return rollouts.list_rollouts(s, model, state)

    @app.get(f"{API_PREFIX}/rollouts/{{rollout_id}}", tags=["admin", "rollouts"], response_model=RolloutStatus,
             dependencies=[admin])
    def rollout_status(rollout_id: int) -> RolloutStatus:
        with rtx() as s:
            return rollouts.rollout_status(s, rollout_id)

    @app.post(f"{API_PREFIX}/rollouts/evaluate", tags=["admin", "rollouts"], dependencies=[admin])
    def evaluate_rollouts() -> dict[str, str]:
        """Evaluate every running rollout now (the registry also does it every ``rollout_tick_s``)."""
        changes = tick(sessions, read_sessions=read_sessions)
        rollout_changed(changes)
        return {str(k): v for k, v in changes.items()}

    @app.post(f"{API_PREFIX}/rollouts/{{rollout_id}}/{{action}}", tags=["admin", "rollouts"],
              response_model=RolloutInfo, dependencies=[admin])
    def rollout_action(rollout_id: int, action: str, req: RolloutAction | None = None) -> RolloutInfo:
        with tx() as s:
            info = rollouts.act(s, rollout_id, action, req.reason if req else "")
        log.info("rollout %d: %s by an operator (now %s)", rollout_id, action, info.state)
        nudge({"rollout": rollout_id, "change": info.state})
        return info

    # ---- the dashboard (/ui), after the error handlers so its errors become pages ---------------
    from edged.registry.web import install as install_dashboard

    install_dashboard(app, settings=settings, admin_hash=admin_hash, sessions=sessions, read_sessions=read_sessions,
                      snapshots=snapshots, on_rollout_change=lambda rid, what: rollout_changed({rid: what}))
    return app
