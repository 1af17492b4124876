"""The blob server: release files leave through their own process, never through the API's event loop.

``edged-registry serve`` with ``blob_listen`` set starts ``edged-registry serve-blobs`` beside
the API (or run it as a unit of its own, or put any static server or CDN that forwards the
query string to it in front). It serves ``GET``/``HEAD /blobs/<sha256>?exp=&sig=`` for a URL
the API signed (:mod:`edged.registry.blob_urls`), with ranges and ``If-Range`` for resumed
downloads, and holds no database connection: a download wave costs the API one redirect per
file while the bytes flow here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from edged.errors import ErrorCode
from edged.registry.blob_urls import UrlSigner, signing_key
from edged.registry.blobs import SHA256_RE, BlobStore
from edged.registry.settings import RegistrySettings

PARENT_CHECK_S = 1.0


def _error(status: int, code: ErrorCode, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code.value, "message": message}}, status_code=status)


def create_blob_app(settings: RegistrySettings) -> Starlette:
    store = BlobStore(settings.blobs)
    signer = UrlSigner(signing_key(settings.blobs))

    async def blob(request: Request) -> Response:
        sha256 = request.path_params["sha256"]
        if not SHA256_RE.fullmatch(sha256):
            return _error(404, ErrorCode.NOT_FOUND, "not a lower-case hex sha256")
        why = signer.refusal(sha256, request.query_params.get("exp"), request.query_params.get("sig"), time.time())
        if why is not None:
            return _error(403, ErrorCode.PERMISSION_DENIED, why)
        path = store.path(sha256)
        if not await asyncio.to_thread(path.is_file):
            return _error(404, ErrorCode.NOT_FOUND, "blob not found")
        # Starlette answers Range / If-Range (206, 416) and HEAD; the digest is the strong ETag.
        return FileResponse(path, media_type="application/octet-stream", headers={
            "ETag": f'"{sha256}"', "Cache-Control": "private, max-age=31536000, immutable"})

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/blobs/{sha256}", blob, methods=["GET", "HEAD"]),
                             Route("/healthz", healthz, methods=["GET"])])


def exit_with_parent(parent: int) -> None:
    """Stop (as on SIGTERM) when the process that started this one is gone, however it went."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
