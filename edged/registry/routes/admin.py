"""Operators' fleet management: enrollment tokens, devices and their labels, pins and re-enrollment,
the registry's status; and the unauthenticated health check."""

from __future__ import annotations

import json
import logging
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import text
from sqlalchemy.orm import Session

from edged.protocol.fleet.messages import (
    API_PREFIX,
    DeviceInfo,
    EnrollmentTokenRequest,
    EnrollmentTokenResponse,
    LabelsUpdate,
    PinRequest,
    ReenrollRequest,
    RegistryStatus,
    ServingInfo,
)
from edged.registry import audit, service
from edged.registry.access import Actor
from edged.registry.decommission import decommission
from edged.registry.deps import AppContext
from edged.registry.release_states import release_states, with_rollback_reasons

log = logging.getLogger(__name__)


def health_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        with ctx.tx() as s:
            s.execute(text("SELECT 1"))
        return {"status": "ok"}

    return router


def admin_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["admin"])

    @router.post(f"{API_PREFIX}/enrollment-tokens", response_model=EnrollmentTokenResponse, status_code=201)
    def enrollment_token(req: EnrollmentTokenRequest, who: Actor) -> EnrollmentTokenResponse:
        with ctx.tx() as s:
            out = service.create_enrollment_token(s, req)
            audit.record(s, who, "enrollment-token.create", f"{req.uses} use(s)",
                         f"labels {json.dumps(req.labels, sort_keys=True)}" if req.labels else "")
            return out

    def with_serving(s: Session, infos: list[DeviceInfo]) -> list[DeviceInfo]:
        """What each device serves and should serve, worked out as the dashboard does (so both agree)."""
        from edged.registry.web.views import fleet_rows

        rows = fleet_rows(s, ctx.snapshots.get(s.connection()), online_s=ctx.settings.dashboard_online_s)
        by_id = {r.id: r for r in rows.rows}
        for info in infos:
            row = by_id.get(info.device_id)
            info.serving = [ServingInfo(model=sv.model, version=sv.version, release=sv.release, state=sv.state,
                                        engine=sv.engine, desired_release=sv.want_release,
                                        desired_version=sv.want_version) for sv in (row.serving if row else [])]
        return infos

    @router.get(f"{API_PREFIX}/devices", response_model=list[DeviceInfo])
    def devices(label: Annotated[list[str] | None, Query()] = None) -> list[DeviceInfo]:
        wanted = dict(item.split("=", 1) for item in label or [] if "=" in item)
        with ctx.rtx() as s:
            return with_serving(s, service.list_devices(s, wanted))

    @router.get(f"{API_PREFIX}/devices/{{device_id}}", response_model=DeviceInfo)
    def device(device_id: str, events: int = 50) -> DeviceInfo:
        with ctx.rtx() as s:
            info = service.get_device(s, device_id, max(0, min(events, 1000)))
            info.events = with_rollback_reasons(s, info.events)
            return with_serving(s, [info])[0]

    @router.patch(f"{API_PREFIX}/devices/{{device_id}}/labels", response_model=DeviceInfo)
    def labels(device_id: str, req: LabelsUpdate, who: Actor) -> DeviceInfo:
        with ctx.tx() as s:
            out = service.set_admin_labels(s, device_id, req.labels)
            audit.record(s, who, "device.labels", f"device {device_id}", json.dumps(req.labels, sort_keys=True))
            return out

    @router.post(f"{API_PREFIX}/devices/{{device_id}}/reenroll", response_model=EnrollmentTokenResponse,
                 status_code=201)
    def reenroll(device_id: str, req: ReenrollRequest, who: Actor) -> EnrollmentTokenResponse:
        with ctx.tx() as s:
            out = service.reenroll_token(s, device_id, req)
            audit.record(s, who, "device.reenroll", f"device {device_id}")
        log.info("device %s: credential revoked by an operator, re-enrollment token issued", device_id)
        return out

    @router.post(f"{API_PREFIX}/devices/{{device_id}}/decommission", response_model=DeviceInfo)
    def decommission_device(device_id: str, who: Actor) -> DeviceInfo:
        """Revoke its credential, take it out of every rollout, keep its history (edged.registry.decommission)."""
        with ctx.tx() as s:
            decommission(s, device_id)
            audit.record(s, who, "device.decommission", f"device {device_id}")
        log.info("device %s decommissioned by an operator", device_id)
        with ctx.rtx() as s:
            return with_serving(s, [service.get_device(s, device_id)])[0]

    @router.put(f"{API_PREFIX}/devices/{{device_id}}/models/{{model}}/pin", response_model=DeviceInfo)
    def pin(device_id: str, model: str, req: PinRequest, who: Actor) -> DeviceInfo:
        with ctx.tx() as s:
            out = service.pin_release(s, device_id, model, req.release)
            audit.record(s, who, "device.pin", f"device {device_id} model {model}",
                         f"release {req.release}" if req.release is not None else "unpinned")
            return out

    @router.get(f"{API_PREFIX}/status", response_model=RegistryStatus)
    def status(model: str | None = None) -> RegistryStatus:
        with ctx.rtx() as s:
            st = service.registry_status(s, model)
            for ms in st.models:
                states = release_states(s, service.get_model(s, ms.model).id)
                for r in ms.releases:
                    r.state = states.get(r.release, "")
            return st

    return router
