"""The device's identity at the registry: enroll once, then send every request with that credential.

The credential is kept in the sync folder. A registry that refuses it (401: an operator
revoked it with ``edged-registry reenroll``) makes the device forget it; enrolling again
needs the re-enrollment token the operator issued for this device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from edged.protocol.fleet.messages import API_PREFIX, EnrollRequest, EnrollResponse
from edged.sync.capped_http import RegistryHttp, SyncHttpError
from edged.sync.settings import SyncSettings
from edged.sync.state import Credential, StateStore

log = logging.getLogger(__name__)
Answer = tuple[int, dict[str, str], bytes]


def error_message(data: bytes) -> str:
    """The registry's error message from an error answer's body (or the body's start)."""
    try:
        import orjson

        err = orjson.loads(data)["error"]
        return str(err["message"])[:300]
    except Exception:
        return data[:200].decode("utf-8", "replace")


class DeviceAuth:
    """Requests to the registry as this device; ``facts``: what enrollment tells the registry about it."""

    def __init__(
        self, settings: SyncSettings, http: RegistryHttp, store: StateStore, facts: Callable[[], dict[str, Any]]
    ) -> None:
        self.s, self.http, self.store, self._facts = settings, http, store, facts
        self.cred: Credential | None = None
        self._lock = threading.Lock()

    def credential(self) -> str:
        """The device credential: the stored one for this registry and device id, else a new enrollment."""
        s = self.s
        with self._lock:
            if self.cred is None:
                cred = self.store.load_credential()
                if cred is not None and cred.url == s.url and cred.device_id == s.device_id:
                    self.cred = cred
            if self.cred is None:
                self.cred = self._enroll()
            return self.cred.credential

    def _enroll(self) -> Credential:
        s = self.s
        if not s.enrollment_token:
            raise SyncHttpError("not enrolled and no [registry] enrollment_token is configured")
        req = EnrollRequest(token=s.enrollment_token, device_id=s.device_id, facts=self._facts())
        status, _, data = self.http.request("POST", f"{API_PREFIX}/enroll", body=req.model_dump_json().encode())
        if status != 200:
            raise SyncHttpError(f"enrollment refused ({status}): {error_message(data)}", status)
        resp = EnrollResponse.model_validate_json(data)
        cred = Credential(device_id=resp.device_id, credential=resp.credential, url=s.url)
        self.store.save_credential(cred)
        log.info("enrolled with the registry at %s as %s", s.url, resp.device_id)
        return cred

    def request(
        self, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Answer:
        """One request with the device credential; a refused credential is forgotten and raised."""
        status, hdrs, data = self.http.request(method, path, token=self.credential(), body=body, headers=headers)
        if status == 401:
            with self._lock:
                self.cred = None
                self.store.forget_credential()
            raise SyncHttpError(f"registry refused the device credential: {error_message(data)}", status)
        return status, hdrs, data
