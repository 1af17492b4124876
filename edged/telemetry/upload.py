"""Upload buffered telemetry to the registry in batches, with back-off, in order, at least once.

The registry stores samples keyed by (device, buffer id, seq), so a batch resent after a
lost acknowledgement is stored once. Samples leave the buffer only when a batch is
acknowledged. The device credential is the one the sync agent enrolled and keeps in
``<state_dir>/sync/credential.json``; until it exists (or while the registry refuses it)
samples simply wait in the buffer. A batch the registry refuses as invalid is halved
until the one bad sample is found, which is then dropped and counted as rejected, so one
bad sample cannot block everything behind it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from edged.backoff import Backoff
from edged.config import Config
from edged.errors import EdgedError
from edged.protocol.fleet.telemetry import INGEST_PATH, MAX_BATCH_ITEMS, UploadAck
from edged.telemetry.buffer import Pending, TelemetryBuffer

log = logging.getLogger(__name__)

# The defaults of [telemetry] upload_interval_s and [registry] request_timeout_s / retry_max_s.
DEFAULT_UPLOAD_INTERVAL_S = 60.0
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_MAX_S = 300.0


class Outcome(enum.Enum):
    SENT = "sent"
    EMPTY = "empty"
    NOT_ENROLLED = "not enrolled"
    RETRY_SMALLER = "retry smaller"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class UploadSettings:
    url: str
    state_dir: Path
    interval_s: float = DEFAULT_UPLOAD_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    min_backoff_s: float = 2.0
    max_backoff_s: float = DEFAULT_RETRY_MAX_S
    max_items: int = 500
    max_bytes: int = 2 << 20
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    @property
    def sync_dir(self) -> Path:
        return self.state_dir / "sync"

    @classmethod
    def from_config(cls, cfg: Config) -> UploadSettings | None:
        """None when uploads are off: telemetry or its upload disabled, or no registry configured."""
        tel, reg = cfg.telemetry, cfg.registry
        if not (tel.enabled and tel.upload and reg.enabled and reg.url):
            return None
        return cls(url=reg.url.rstrip("/"), state_dir=cfg.device.state_dir, interval_s=tel.upload_interval_s,
                   timeout_s=reg.request_timeout_s, max_backoff_s=reg.retry_max_s, ca_file=reg.ca_file,
                   client_cert=reg.client_cert, client_key=reg.client_key)


@dataclass(frozen=True)
class UploadStats:
    state: str  # the last outcome
    uploaded_total: int
    batches_total: int
    failures_total: int
    rejected_total: int
    last_success_wall: float | None
    last_error: str | None


def batch_body(p: Pending) -> bytes:
    """The UploadBatch JSON, spliced from the stored sample bodies without re-encoding them."""
    head = f'{{"buffer_id":"{p.buffer_id}","dropped":{p.dropped},"dropped_total":{p.dropped_total},"items":['
    return head.encode() + b",".join(body for _, body in p.items) + b"]}"


class Uploader:
    def __init__(self, settings: UploadSettings, buffer: TelemetryBuffer) -> None:
        from edged.sync.capped_http import RegistryHttp
        from edged.sync.state import StateStore

        self.settings = settings
        self.buffer = buffer
        self.http = RegistryHttp(settings.url, timeout=settings.timeout_s, ca_file=settings.ca_file,
                                 client_cert=settings.client_cert, client_key=settings.client_key)
        self.store = StateStore(settings.sync_dir)
        self.max_items = min(settings.max_items, MAX_BATCH_ITEMS)
        self._lock = threading.Lock()
        self._state = "idle"
        self._uploaded = self._batches = self._failures = self._rejected = 0
        self._last_success: float | None = None
        self._last_error: str | None = None
        self._logged_state: str | None = None

    # ---- one attempt ----------------------------------------------------------------------------
    def _credential(self) -> str | None:
        cred = self.store.load_credential()
        if cred is None or cred.url.rstrip("/") != self.settings.url:
            return None
        return cred.credential

    def upload_once(self) -> Outcome:
        """Send the oldest batch once; blocking (call from a thread)."""
        with self._lock:
            pending = self.buffer.peek(self.max_items, self.settings.max_bytes)
            if not pending.items:
                return self._done(Outcome.EMPTY)
            token = self._credential()
            if token is None:
                return self._done(Outcome.NOT_ENROLLED, "the device is not enrolled with this registry yet")
            try:
                status, _h, data = self.http.request("POST", INGEST_PATH, token=token, body=batch_body(pending))
            except EdgedError as e:
                return self._done(Outcome.UNREACHABLE, str(e))
            if 200 <= status < 300:
                try:
                    UploadAck.model_validate_json(data)
                except ValidationError:
                    return self._done(Outcome.REFUSED, f"registry answered {status} without an acknowledgement")
                self.buffer.ack(pending.last_seq, pending.dropped)
                self._uploaded += len(pending.items)
                self._batches += 1
                self._last_success = time.time()
                self.max_items = min(self.max_items * 2, self.settings.max_items, MAX_BATCH_ITEMS)
                return self._done(Outcome.SENT)
            message = _error_message(data)
            if status in (400, 413, 422):
                if len(pending.items) > 1:
                    self.max_items = max(1, len(pending.items) // 2)
                    return self._done(Outcome.RETRY_SMALLER, f"{status}: {message}")
                seq = pending.items[0][0]
                self.buffer.ack(seq, 0)
                self._rejected += 1
                log.error("telemetry sample %d refused by the registry and dropped: %s", seq, message)
                return self._done(Outcome.RETRY_SMALLER, f"{status}: {message}")
            what = {401: "device credential refused", 403: "device credential refused",
                    404: "the registry has no telemetry endpoint"}.get(status, f"registry answered {status}")
            return self._done(Outcome.REFUSED, f"{what}: {message}")

    def _done(self, outcome: Outcome, error: str | None = None) -> Outcome:
        self._state = outcome.value
        if outcome in (Outcome.SENT, Outcome.EMPTY):
            if self._logged_state not in (None, "ok"):
                log.info("telemetry upload resumed")
            self._logged_state = "ok"
            return outcome
        self._failures += outcome is not Outcome.RETRY_SMALLER
        self._last_error = error
        if self._logged_state != outcome.value and outcome is not Outcome.RETRY_SMALLER:
            n = self.buffer.stats().samples
            log.warning("telemetry upload paused (%s); %d sample(s) kept in the buffer", error, n)
            self._logged_state = outcome.value
        return outcome

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event, wake: threading.Event) -> None:
        """Upload until ``stop`` is set; ``wake`` cuts a wait short (set it together with ``stop``)."""
        backoff = Backoff(self.settings.min_backoff_s, self.settings.max_backoff_s)
        while not stop.is_set():
            try:
                outcome = self.upload_once()
            except Exception:  # a bug here must not end telemetry for the life of the daemon
                log.exception("telemetry upload failed unexpectedly")
                outcome = Outcome.REFUSED
            if outcome in (Outcome.SENT, Outcome.RETRY_SMALLER):
                backoff.reset()
                if self.buffer.stats().samples:
                    continue
                delay = self.settings.interval_s
            elif outcome is Outcome.EMPTY:
                backoff.reset()
                delay = self.settings.interval_s
            else:
                delay = backoff.next_delay()
            wake.wait(delay)
            wake.clear()
        self.http.close()

    def stats(self) -> UploadStats:
        return UploadStats(self._state, self._uploaded, self._batches, self._failures, self._rejected,
                           self._last_success, self._last_error)


def _error_message(data: bytes) -> str:
    """The registry's ``{"error": {"message": ...}}``, else the start of the body."""
    import json

    try:
        doc = json.loads(data)
        return str(doc["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")
