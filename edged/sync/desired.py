"""The device's desired state, polled with an ETag so an unchanged one costs a 304."""

from __future__ import annotations

from pydantic import ValidationError

from edged.protocol.fleet.messages import API_PREFIX, DesiredState
from edged.sync.capped_http import SyncHttpError
from edged.sync.enrollment import DeviceAuth, error_message


class DesiredStateError(SyncHttpError):
    """The registry's desired state is refused whole: malformed, naming a model no repository may hold, or
    longer than :data:`~edged.protocol.fleet.messages.MAX_DESIRED` entries. Nothing of it is acted on."""


class DesiredStatePoller:
    def __init__(self, auth: DeviceAuth, device_id: str) -> None:
        self.auth, self.device_id = auth, device_id
        self.etag: str | None = None
        self.last: DesiredState | None = None  # the last one received

    def poll(self) -> DesiredState | None:
        """The desired state when it changed since the last poll, else None."""
        headers = {"If-None-Match": self.etag} if self.etag and self.last is not None else None
        status, hdrs, data = self.auth.request("GET", f"{API_PREFIX}/device/desired-state", headers=headers)
        if status == 304:
            return None
        if status != 200:
            raise SyncHttpError(f"desired state: {status} {error_message(data)}", status)
        try:
            desired = DesiredState.model_validate_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])[:200]
            raise DesiredStateError(f"desired state refused ({e.error_count()} problems; "
                                    f"{where}: {first['msg'][:200]})") from None
        if desired.device_id != self.device_id:
            raise DesiredStateError("desired state is for another device")
        self.etag, self.last = hdrs.get("etag"), desired
        return desired
