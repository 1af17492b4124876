"""Publishing and fetching: blobs, model versions and signed releases.

Operators upload blobs and publish; a device may fetch a blob only when it belongs to a release
its desired state names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import (
    API_PREFIX,
    MissingBlobsRequest,
    MissingBlobsResponse,
    ModelInfo,
    NextRelease,
    PushVersionRequest,
    ReleaseInfo,
    VersionInfo,
)
from edged.protocol.fleet.release import SignedRelease
from edged.registry import audit, service
from edged.registry import desired as desired_state
from edged.registry.access import Actor
from edged.registry.blobs import SHA256_RE
from edged.registry.deps import AppContext, PathNumber
from edged.registry.release_states import release_states
from edged.registry.service import RegistryError

log = logging.getLogger(__name__)


def releases_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()
    _blob_routes(router, ctx)
    _release_routes(router, ctx)
    return router


def _blob_routes(router: APIRouter, ctx: AppContext) -> None:
    """Blobs: devices download them (or are sent to the blob server), operators upload them."""
    settings = ctx.settings
    max_upload = int(settings.max_upload_mb * (1 << 20))

    @router.get(f"{API_PREFIX}/blobs/{{sha256}}", tags=["device", "admin"],
                responses={200: {"content": {"application/octet-stream": {}}}, 206: {"description": "a byte range"}})
    async def get_blob(sha256: str, request: Request) -> Response:
        if not SHA256_RE.fullmatch(sha256):
            raise service.invalid("not a lower-case hex sha256")
        if getattr(request.state, "principal", None) is None:  # not an operator (access.Guard): a device
            with ctx.ro_engine.connect() as conn:
                if not desired_state.blob_allowed(conn, ctx.decide(conn, request.headers.get("authorization")), sha256,
                                                  ctx.snapshots):
                    raise RegistryError("this file is not part of a release for this device", 403,
                                        ErrorCode.PERMISSION_DENIED)
            base = settings.blob_base(request.url.hostname)
            if ctx.blob_signer is not None and base is not None:
                # The device's client keeps its Range / If-Range headers and drops its credential on the way.
                return Response(status_code=307, headers={
                    "Location": f"{base}/blobs/{sha256}?{ctx.blob_signer.query(sha256, time.time())}",
                    "Cache-Control": "no-store"})
        headers = {"ETag": f'"{sha256}"', "Cache-Control": "private, max-age=31536000, immutable",
                   "Accept-Ranges": "bytes"}
        if "range" not in request.headers:
            data = ctx.blob_cache.get(sha256)
            if data is None:
                data = await asyncio.to_thread(ctx.blob_cache.load, sha256)
            if data is not None:
                return Response(data, media_type="application/octet-stream", headers=headers)
        path = ctx.store.path(sha256)
        if not await asyncio.to_thread(path.is_file):
            raise service.not_found("blob")
        # Starlette answers Range / If-Range itself (206, 416); the digest is the strong ETag.
        return FileResponse(path, media_type="application/octet-stream", headers=headers)

    @router.post(f"{API_PREFIX}/blobs/missing", tags=["admin"], response_model=MissingBlobsResponse)
    def blobs_missing(req: MissingBlobsRequest) -> MissingBlobsResponse:
        with ctx.rtx() as s:
            return MissingBlobsResponse(missing=service.missing_blobs(s, ctx.store, req.sha256))

    @router.put(f"{API_PREFIX}/blobs/{{sha256}}", tags=["admin"], status_code=201)
    async def put_blob(sha256: str, request: Request, who: Actor,
                       content_length: Annotated[int | None, Header()] = None) -> dict[str, Any]:
        if not SHA256_RE.fullmatch(sha256):
            raise service.invalid("not a lower-case hex sha256")
        too_large = RegistryError(f"upload over the {settings.max_upload_mb:g} MB limit", 413,
                                  ErrorCode.INVALID_ARGUMENT)
        if content_length is not None and content_length > max_upload:
            raise too_large
        writer = await asyncio.to_thread(ctx.store.begin, sha256)
        try:
            async for chunk in request.stream():
                if writer.size + len(chunk) > max_upload:
                    raise too_large
                if chunk:
                    await asyncio.to_thread(writer.write, chunk)
            await asyncio.to_thread(writer.commit, content_length)
        finally:
            await asyncio.to_thread(writer.abort)
        size = writer.size

        def record() -> None:
            with ctx.tx() as s:
                service.record_blob(s, sha256, size)
                audit.record(s, who, "blob.upload", f"blob {sha256}", f"{size} bytes")

        await asyncio.to_thread(record)
        return {"sha256": sha256, "size": size}


def _release_routes(router: APIRouter, ctx: AppContext) -> None:
    """Model versions and their signed releases."""
    settings = ctx.settings

    @router.put(f"{API_PREFIX}/models/{{model}}/versions/{{version}}", tags=["admin"], response_model=VersionInfo)
    def push_version(model: str, version: PathNumber, req: PushVersionRequest, response: Response,
                     who: Actor) -> VersionInfo:
        with ctx.tx() as s:
            info = service.push_version(s, ctx.store, model, version, req.files)
            if info.created:
                audit.record(s, who, "version.push", f"model {model} version {version}",
                             f"{len(info.files)} files, {info.total_size} bytes")
        response.status_code = 201 if info.created else 200
        if info.created:
            log.info("model %s version %d pushed (%d files, %d bytes)", model, version, len(info.files),
                     info.total_size)
        return info

    @router.get(f"{API_PREFIX}/models", tags=["admin"], response_model=list[ModelInfo])
    def models() -> list[ModelInfo]:
        with ctx.rtx() as s:
            return service.list_models(s)

    @router.get(f"{API_PREFIX}/models/{{model}}/versions/{{version}}", tags=["admin"], response_model=VersionInfo)
    def get_version(model: str, version: PathNumber) -> VersionInfo:
        with ctx.rtx() as s:
            return service.get_version(s, model, version)

    @router.get(f"{API_PREFIX}/models/{{model}}/releases", tags=["admin"], response_model=list[ReleaseInfo])
    def releases(model: str, signed: bool = False) -> list[ReleaseInfo]:
        with ctx.rtx() as s:
            out = service.list_releases(s, model, signed)
            states = release_states(s, service.get_model(s, model).id)
        for r in out:
            r.state = states.get(r.release, "")
        return out

    @router.get(f"{API_PREFIX}/models/{{model}}/next-release", tags=["admin"], response_model=NextRelease)
    def next_release(model: str) -> NextRelease:
        with ctx.rtx() as s:
            return NextRelease(model=model, release=service.next_release_number(s, model))

    @router.post(f"{API_PREFIX}/releases", tags=["admin"], response_model=ReleaseInfo, status_code=201)
    def create_release(signed: SignedRelease, who: Actor) -> ReleaseInfo:
        with ctx.tx() as s:
            info = service.create_release(s, signed, settings.public_keys)
            audit.record(s, who, "release.create", f"model {info.model} release {info.release}",
                         f"version {info.version}, key {info.key_id}")
        log.info("release %d of model %s (version %d) created, key %s", info.release, info.model, info.version,
                 info.key_id)
        ctx.nudge({"model": info.model, "release": info.release})
        return info

    @router.post(f"{API_PREFIX}/models/{{model}}/releases/{{number}}/revoke", tags=["admin"],
                 response_model=ReleaseInfo)
    def revoke(model: str, number: PathNumber, who: Actor) -> ReleaseInfo:
        with ctx.tx() as s:
            info = service.revoke_release(s, model, number)
            audit.record(s, who, "release.revoke", f"model {model} release {number}")
        log.info("release %d of model %s revoked", number, model)
        ctx.nudge({"model": model, "revoked": number})
        return info
