"""The device's conversation with the registry: enroll, poll desired state (ETag), send reports and facts.

Reports go to a persistent outbox first (in the sync state) and are sent in order of
their sequence numbers; the registry ignores numbers it has already seen, so resending
after a lost answer or a crash is harmless.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from edged import __version__
from edged.protocol.fleet.messages import (
    API_PREFIX,
    DesiredState,
    DeviceFactsUpdate,
    EnrollRequest,
    EnrollResponse,
    QualityReport,
    ReportBatch,
    ReportEvent,
    ServingModel,
)
from edged.sync.capped_http import RegistryHttp, SyncHttpError, parse_retry_after
from edged.sync.settings import SyncSettings
from edged.sync.state import Credential, StateStore, SyncState

log = logging.getLogger(__name__)
REPORT_BATCH = 200
FAILED_STEPS = frozenset({"failed", "rolled-back"})  # reports that carry the device's last log lines
FLUSH_RETRY_S = 5.0


def _error_message(data: bytes) -> str:
    try:
        import orjson

        err = orjson.loads(data)["error"]
        return str(err["message"])[:300]
    except Exception:
        return data[:200].decode("utf-8", "replace")


def retry_after_s(headers: dict[str, str]) -> float:
    """How long a 503 asks the outbox to wait: its Retry-After, else the outbox's own retry."""
    wait = parse_retry_after(headers.get("retry-after"))
    return FLUSH_RETRY_S if wait is None else wait


class DeviceClient:
    def __init__(self, settings: SyncSettings, http: RegistryHttp, store: StateStore, state: SyncState) -> None:
        self.s, self.http, self.store, self.state = settings, http, store, state
        self.cred: Credential | None = None
        self.etag: str | None = None
        self.desired: DesiredState | None = None
        self._cred_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._kick = threading.Event()
        self._stopping = threading.Event()
        self._flusher: threading.Thread | None = None
        self._busy_until = 0.0  # monotonic: the registry said it is busy (503 + Retry-After) until then
        self.extra_facts: dict[str, Any] = {}  # device profile and hardware facts, for rollout targets
        # The daemon's last log lines (edged.logring), attached to a failed update's report: what the device said
        # around the failure, for the operator who has no shell on it.
        self.log_tail: Callable[[], list[str]] | None = None
        if settings.labels:
            log.warning("[registry] labels (%s) are not sent: labels are set by operators "
                        "(edged-registry label, or enroll-token --label); a device never labels itself",
                        ", ".join(sorted(settings.labels)))

    # ---- background sending -----------------------------------------------------------------
    def start(self) -> None:
        """Reports are sent by their own thread, so a slow or unreachable registry never holds up an update."""
        self._flusher = threading.Thread(target=self._flush_loop, name="edged-sync-reports", daemon=True)
        self._flusher.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._kick.set()
        if self._flusher is not None:
            self._flusher.join(timeout)

    def _flush_loop(self) -> None:
        while not self._stopping.is_set():
            self._kick.wait(FLUSH_RETRY_S)
            self._kick.clear()
            try:
                self.flush()
            except Exception:
                log.exception("sending reports failed")
        try:
            self.flush()  # last chance for what the final steps reported
        except Exception:
            pass

    # ---- enrollment -------------------------------------------------------------------------
    def credential(self) -> str:
        s = self.s
        with self._cred_lock:
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
        req = EnrollRequest(token=s.enrollment_token, device_id=s.device_id, facts=self.facts())
        status, _, data = self.http.request("POST", f"{API_PREFIX}/enroll", body=req.model_dump_json().encode())
        if status != 200:
            raise SyncHttpError(f"enrollment refused ({status}): {_error_message(data)}", status)
        resp = EnrollResponse.model_validate_json(data)
        cred = Credential(device_id=resp.device_id, credential=resp.credential, url=s.url)
        self.store.save_credential(cred)
        log.info("enrolled with the registry at %s as %s", s.url, resp.device_id)
        return cred

    def _authed(self, method: str, path: str, *, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        status, hdrs, data = self.http.request(method, path, token=self.credential(), body=body, headers=headers)
        if status == 401:
            # Our credential no longer works (revoked by an operator's `edged-registry reenroll`): enrolling
            # again needs the re-enrollment token the operator issued for this device.
            with self._cred_lock:
                self.cred = None
                self.store.forget_credential()
            raise SyncHttpError(f"registry refused the device credential: {_error_message(data)}", status)
        return status, hdrs, data

    # ---- desired state ----------------------------------------------------------------------
    def poll(self) -> DesiredState | None:
        """The desired state when it changed since the last poll, else None."""
        headers = {"If-None-Match": self.etag} if self.etag and self.desired is not None else None
        status, hdrs, data = self._authed("GET", f"{API_PREFIX}/device/desired-state", headers=headers)
        if status == 304:
            return None
        if status != 200:
            raise SyncHttpError(f"desired state: {status} {_error_message(data)}", status)
        try:
            desired = DesiredState.model_validate_json(data)
        except ValidationError as e:
            raise SyncHttpError(f"desired state is malformed ({e.error_count()} problems)") from None
        if desired.device_id != self.s.device_id:
            raise SyncHttpError("desired state is for another device")
        self.etag, self.desired = hdrs.get("etag"), desired
        return desired

    # ---- reports ----------------------------------------------------------------------------
    def report(self, model: str, step: str, *, version: int | None, release: int | None,
               reason: str | None = None, detail: dict[str, Any] | None = None, quiet: bool = False,
               quality: QualityReport | None = None) -> None:
        """Queue a report for the registry; ``quiet``: the caller logs it (one line per event)."""
        logs = self.log_tail() if self.log_tail is not None and step in FAILED_STEPS else []
        with self.store.lock:
            self.state.seq += 1
            ev = ReportEvent(seq=self.state.seq, model=model, step=step,
                             version=version, release=release, reason=reason[:4000] if reason else None,
                             detail=detail or {}, quality=quality, logs=logs, at=time.time())
            self.state.outbox.append(ev)
            self.store.save(self.state)
        log.log(logging.DEBUG if quiet else logging.INFO, "model=%s release=%s version=%s %s%s", model, release,
                version, step, f": {reason}" if reason else "")
        if self._flusher is not None:
            self._kick.set()
        else:
            self.flush()

    def flush(self) -> bool:
        """Send queued reports; False when the registry could not take them now (they stay queued)."""
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> bool:
        while True:
            if time.monotonic() < self._busy_until:
                return False  # the registry asked us to come back later; the outbox keeps everything
            with self.store.lock:
                batch = list(self.state.outbox[:REPORT_BATCH])
            if not batch:
                return True
            try:
                status, hdrs, data = self._authed("POST", f"{API_PREFIX}/device/reports",
                                               body=ReportBatch(events=batch).model_dump_json().encode())
            except SyncHttpError as e:
                log.debug("reports not sent: %s", e)
                return False
            if status == 503:
                self._busy_until = time.monotonic() + retry_after_s(hdrs)
                log.info("registry busy: %d report(s) wait %.0f s", len(batch), self._busy_until - time.monotonic())
                return False
            if status != 200:
                log.warning("registry refused reports (%d): %s", status, _error_message(data))
                return False
            sent = batch[-1].seq
            with self.store.lock:
                self.state.outbox = [e for e in self.state.outbox if e.seq > sent]
                self.store.save(self.state)

    # ---- facts ------------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        return {**self.extra_facts, "edged_version": __version__, "hostname": socket.gethostname()}

    def send_facts(self, serving: list[ServingModel]) -> bool:
        """True when the registry took them; a busy registry (503) hears them at a later poll."""
        upd = DeviceFactsUpdate(facts=self.facts(), serving=serving)
        status, _, data = self._authed("PUT", f"{API_PREFIX}/device/facts", body=upd.model_dump_json().encode())
        if status == 503:
            log.debug("registry busy: facts sent again at the next poll")
            return False
        if status != 200:
            log.warning("registry refused facts (%d): %s", status, _error_message(data))
        return True
