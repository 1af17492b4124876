"""The fleet, for the operator client: enrollment, devices, labels, pins, status and telemetry figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import TypeAdapter

from edged.protocol.fleet.messages import (
    DeviceInfo,
    EnrollmentTokenRequest,
    EnrollmentTokenResponse,
    LabelsUpdate,
    PinRequest,
    ReenrollRequest,
    RegistryStatus,
)
from edged.registry.admin_http import AdminHttp, wire

if TYPE_CHECKING:
    from edged.protocol.fleet.telemetry_answers import ModelSummary


class FleetApi(AdminHttp):
    def enrollment_token(self, uses: int = 1, ttl_s: float = 86400, labels: dict[str, str] | None = None
                         ) -> EnrollmentTokenResponse:
        req = wire(EnrollmentTokenRequest, uses=uses, ttl_s=ttl_s, labels=labels or {})
        r = self._send("POST", "/enrollment-tokens", req)
        return EnrollmentTokenResponse.model_validate_json(r.content)

    def decommission(self, device_id: str) -> DeviceInfo:
        """Revoke a device's credential for good and take it out of rollouts; its history stays."""
        return DeviceInfo.model_validate_json(self._call("POST", f"/devices/{device_id}/decommission").content)

    def reenroll(self, device_id: str, ttl_s: float = 86400) -> EnrollmentTokenResponse:
        """Revoke a device's credential and get a single-use token that enrolls that id again."""
        r = self._send("POST", f"/devices/{device_id}/reenroll", wire(ReenrollRequest, ttl_s=ttl_s))
        return EnrollmentTokenResponse.model_validate_json(r.content)

    def devices(self, labels: dict[str, str] | None = None) -> list[DeviceInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return TypeAdapter(list[DeviceInfo]).validate_json(self._call("GET", "/devices", params=params).content)

    def device(self, device_id: str, events: int = 50) -> DeviceInfo:
        r = self._call("GET", f"/devices/{device_id}", params={"events": events})
        return DeviceInfo.model_validate_json(r.content)

    def set_labels(self, device_id: str, labels: dict[str, str | None]) -> DeviceInfo:
        r = self._send("PATCH", f"/devices/{device_id}/labels", LabelsUpdate(labels=labels))
        return DeviceInfo.model_validate_json(r.content)

    def pin(self, device_id: str, model: str, release: int | None) -> DeviceInfo:
        r = self._send("PUT", f"/devices/{device_id}/models/{model}/pin", PinRequest(release=release))
        return DeviceInfo.model_validate_json(r.content)

    def status(self, model: str | None = None) -> RegistryStatus:
        r = self._call("GET", "/status", params={"model": model} if model else None)
        return RegistryStatus.model_validate_json(r.content)

    def telemetry_summary(self, model: str, *, version: int | None = None, device_id: str | None = None,
                          since: float | None = None, labels: dict[str, str] | None = None) -> ModelSummary:
        from edged.protocol.fleet.telemetry_answers import ModelSummary

        params: list[tuple[str, str | int | float]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        for key, value in (("version", version), ("device_id", device_id), ("since", since)):
            if value is not None:
                params.append((key, value))
        r = self._call("GET", f"/models/{model}/telemetry/summary", params=params)
        return ModelSummary.model_validate_json(r.content)
