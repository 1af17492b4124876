"""Reports to the registry: a persistent outbox (in the sync state) sent in order by its own thread.

Reports are sent in order of their sequence numbers; the registry ignores numbers it has
already seen, so resending after a lost answer or a crash is harmless. A report is sent only
once its number is on disk (a number sent, then lost in a crash, would be reused for another
report, which the registry would ignore). A slow or unreachable registry never holds up an
update: the sending thread retries on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from edged.protocol.fleet.messages import API_PREFIX, QualityReport, ReportBatch, ReportEvent
from edged.sync.capped_http import SyncHttpError, parse_retry_after
from edged.sync.enrollment import DeviceAuth, error_message
from edged.sync.state import StateStore, SyncState

log = logging.getLogger(__name__)
REPORT_BATCH = 200
FLUSH_RETRY_S = 5.0


def retry_after_s(headers: dict[str, str]) -> float:
    """How long a 503 asks the outbox to wait: its Retry-After, else the outbox's own retry."""
    wait = parse_retry_after(headers.get("retry-after"))
    return FLUSH_RETRY_S if wait is None else wait


class ReportOutbox:
    def __init__(self, auth: DeviceAuth, store: StateStore, state: SyncState) -> None:
        self.auth, self.store, self.state = auth, store, state
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy_until = 0.0  # monotonic: the registry said it is busy (503 + Retry-After) until then

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="edged-sync-reports", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
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

    def report(  # noqa: PLR0913  one keyword per field of the report event (protocol.fleet ReportEvent)
        self,
        model: str,
        step: str,
        *,
        version: int | None,
        release: int | None,
        reason: str | None = None,
        detail: dict[str, Any] | None = None,
        quiet: bool = False,
        quality: QualityReport | None = None,
        logs: list[str] | None = None,
        later: bool = False,
    ) -> None:
        """Queue a report for the registry; ``quiet``: the caller logs it (one line per event); ``logs``:
        the device's last log lines, for a failed update (edged.logring); ``later``: saved with the poll's
        other changes (:meth:`StateStore.save_later`), for a report the next poll would make again."""
        with self.store.lock:
            self.state.seq += 1
            ev = ReportEvent(
                seq=self.state.seq,
                model=model,
                step=step,
                version=version,
                release=release,
                reason=reason[:4000] if reason else None,
                detail=detail or {},
                quality=quality,
                logs=logs or [],
                at=time.time(),
            )
            self.state.outbox.append(ev)
            if later:
                self.store.save_later()
            else:
                self.store.save(self.state)
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "model=%s release=%s version=%s %s%s",
            model,
            release,
            version,
            step,
            f": {reason}" if reason else "",
        )
        if self._thread is not None:
            self._kick.set()
        else:
            self.flush()

    def flush(self) -> bool:
        """Send queued reports (those saved: the rest wait for the save); False when the registry could not
        take them now (they stay queued)."""
        with self._lock:
            while True:
                if time.monotonic() < self._busy_until:
                    return False  # the registry asked us to come back later; the outbox keeps everything
                with self.store.lock:
                    saved = self.store.saved_seq
                    batch = [e for e in self.state.outbox[:REPORT_BATCH] if e.seq <= saved]
                if not batch:
                    return True
                if not self._send(batch):
                    return False

    def _send(self, batch: list[ReportEvent]) -> bool:
        try:
            status, hdrs, data = self.auth.request(
                "POST", f"{API_PREFIX}/device/reports", body=ReportBatch(events=batch).model_dump_json().encode()
            )
        except SyncHttpError as e:
            log.debug("reports not sent: %s", e)
            return False
        if status == 503:
            self._busy_until = time.monotonic() + retry_after_s(hdrs)
            log.info("registry busy: %d report(s) wait %.0f s", len(batch), self._busy_until - time.monotonic())
            return False
        if status != 200:
            log.warning("registry refused reports (%d): %s", status, error_message(data))
            return False
        sent = batch[-1].seq
        with self.store.lock:
            self.state.outbox = [e for e in self.state.outbox if e.seq > sent]
            self.store.save(self.state)
        return True
