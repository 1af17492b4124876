"""What devices call: enroll, poll their desired state, report, send their facts, rotate their credential.

Polls, reports and fact updates run on the event loop: one short read-only query each, then the
cached snapshot or the report writer's queue (see :mod:`edged.registry.api`). Their work is in the
functions at the end. :mod:`edged.registry.fastpath` sits in front of the application and serves
these three calls itself with those functions, so their routes here are what the OpenAPI schema
shows (and would answer only if the fast path were taken out of the middleware stack).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy import bindparam, select

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import (
    API_PREFIX,
    MAX_FACTS,
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
from edged.registry.service import RegistryError

log = logging.getLogger(__name__)
_STORED_FACTS = select(DeviceRow.facts, DeviceRow.serving).where(DeviceRow.id == bindparam("id"))
_BEARER: dict[str, Any] = {"security": [{"HTTPBearer": []}]}


def devices_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["device"])

    @router.post(f"{API_PREFIX}/enroll", response_model=EnrollResponse)
    def enroll(req: EnrollRequest) -> EnrollResponse:
        if len(req.facts) > MAX_FACTS:  # before the token is spent or anything is stored
            raise RegistryError(f"facts: at most {MAX_FACTS} keys ({len(req.facts)} sent)", 413,
                                ErrorCode.INVALID_ARGUMENT)
        with ctx.tx() as s:
            out = service.enroll(s, req)
        log.info("device %s enrolled", req.device_id)
        return out

    @router.get(f"{API_PREFIX}/device/desired-state", response_model=DesiredState,
                responses={304: {"description": "unchanged since the ETag in If-None-Match"}},
                openapi_extra={**_BEARER, "parameters": [
                    {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}}]})
    async def desired(request: Request) -> Response:
        status, headers, body = poll(ctx, request.headers.get("authorization"), request.headers.get("if-none-match"))
        return Response(body, status_code=status, headers=headers,
                        media_type="application/json" if status == 200 else None)

    @router.post(f"{API_PREFIX}/device/reports", response_model=Accepted, openapi_extra=_BEARER)
    async def reports(batch: ReportBatch, request: Request) -> Accepted:
        return await take_reports(ctx, request.headers.get("authorization"), batch)

    @router.put(f"{API_PREFIX}/device/facts", response_model=Accepted, openapi_extra=_BEARER)
    async def facts(upd: DeviceFactsUpdate, request: Request) -> Accepted:
        return await take_facts(ctx, request.headers.get("authorization"), upd)

    @router.post(f"{API_PREFIX}/device/credential", response_model=EnrollResponse, openapi_extra=_BEARER)
    def rotate_credential(auth: Bearer) -> EnrollResponse:
        """A new credential for the device holding the current one (which stops working)."""
        with ctx.tx() as s:
            out = service.rotate_credential(device_of(s, auth))
        log.info("device %s rotated its credential", out.device_id)
        return out

    return router


# ---- the device calls themselves: served by these routes and by the fast path (edged/registry/fastpath.py) ----
def poll(ctx: AppContext, authorization: str | None, if_none_match: str | None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a desired-state poll: one short read-only query on the event loop."""
    with ctx.ro_engine.connect() as conn:
        d = ctx.decide(conn, authorization)
    etag = d.etag()
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
        return 304, headers, b""
    return 200, headers, d.body()


async def take_reports(ctx: AppContext, authorization: str | None, batch: ReportBatch) -> Accepted:
    with ctx.ro_engine.connect() as conn:
        view = ctx.authenticate(conn, authorization)
    ctx.last_seen.note(view.id, view.last_seen_at)
    return Accepted(accepted=await asyncio.wrap_future(ctx.report_writer.submit(view.id, batch.events)))


async def take_facts(ctx: AppContext, authorization: str | None, upd: DeviceFactsUpdate) -> Accepted:
    # Devices resend their facts periodically; most of the time nothing changed and nothing is written.
    # A change goes through the report writer's group commit (a download wave changes thousands).
    service.refuse_self_labels(upd)
    with ctx.ro_engine.connect() as conn:
        view = ctx.authenticate(conn, authorization)
        stored = conn.execute(_STORED_FACTS, {"id": view.id}).one()
    ctx.last_seen.note(view.id, view.last_seen_at)
    write = service.facts_write(upd)
    if stored.facts == write.facts and stored.serving == write.serving:
        return Accepted(accepted=0)
    return Accepted(accepted=await asyncio.wrap_future(ctx.report_writer.submit_facts(view.id, write)))
