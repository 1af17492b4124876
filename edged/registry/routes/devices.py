"""What devices call: enroll, poll their desired state, report, send their facts, rotate their credential.

Polls, reports and fact updates run on the event loop: one short read-only query each, then the
cached snapshot or the report writer's queue (see :mod:`edged.registry.api`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request, Response

from edged.protocol.fleet.messages import (
    API_PREFIX,
    Accepted,
    DesiredState,
    DeviceFactsUpdate,
    EnrollRequest,
    EnrollResponse,
    ReportBatch,
)
from edged.registry import service
from edged.registry.db import DeviceRow
from edged.registry.deps import AppContext, Bearer, device_of

log = logging.getLogger(__name__)
_BEARER: dict[str, Any] = {"security": [{"HTTPBearer": []}]}


def devices_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["device"])

    @router.post(f"{API_PREFIX}/enroll", response_model=EnrollResponse)
    def enroll(req: EnrollRequest) -> EnrollResponse:
        with ctx.tx() as s:
            out = service.enroll(s, req)
        log.info("device %s enrolled", req.device_id)
        return out

    @router.get(f"{API_PREFIX}/device/desired-state", response_model=DesiredState,
                responses={304: {"description": "unchanged since the ETag in If-None-Match"}},
                openapi_extra={**_BEARER, "parameters": [
                    {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}}]})
    async def desired(request: Request) -> Response:
        # Runs on the event loop: one short read-only query, no thread hand-off.
        with ctx.ro_engine.connect() as conn:
            d = ctx.decide(conn, request)
        etag = d.etag()
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if_none_match = request.headers.get("if-none-match")
        if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
            return Response(status_code=304, headers=headers)
        return Response(d.body(), media_type="application/json", headers=headers)

    @router.post(f"{API_PREFIX}/device/reports", response_model=Accepted, openapi_extra=_BEARER)
    async def reports(batch: ReportBatch, request: Request) -> Accepted:
        with ctx.ro_engine.connect() as conn:
            view = ctx.authenticate(conn, request)
        ctx.last_seen.note(view.id, view.last_seen_at)
        n = await asyncio.wrap_future(ctx.report_writer.submit(view.id, batch.events))
        return Accepted(accepted=n)

    @router.put(f"{API_PREFIX}/device/facts", response_model=Accepted, openapi_extra=_BEARER)
    async def facts(upd: DeviceFactsUpdate, request: Request) -> Accepted:
        # Devices resend their facts periodically; most of the time nothing changed and nothing is written.
        with ctx.read_sessions() as s:
            view = ctx.authenticate(s.connection(), request)
            service.refuse_self_labels(upd)
            dev = s.get_one(DeviceRow, view.id)
            if not service.facts_changed(dev, upd):
                ctx.last_seen.note(dev.id, dev.last_seen_at)
                return Accepted(accepted=0)

        def write() -> None:
            with ctx.tx() as s:
                service.update_facts(s, s.get_one(DeviceRow, view.id), upd)

        await asyncio.to_thread(write)
        return Accepted(accepted=1)

    @router.post(f"{API_PREFIX}/device/credential", response_model=EnrollResponse, openapi_extra=_BEARER)
    def rotate_credential(auth: Bearer) -> EnrollResponse:
        """A new credential for the device holding the current one (which stops working)."""
        with ctx.tx() as s:
            out = service.rotate_credential(device_of(s, auth))
        log.info("device %s rotated its credential", out.device_id)
        return out

    return router
