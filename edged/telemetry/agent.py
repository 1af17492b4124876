"""The telemetry agent: sample on a timer, publish over MQTT, buffer for upload, keep the status file fresh.

All of it runs in two threads of its own (sampling, uploading): device reads, SQLite and
HTTP all block, and the event loop must stay free for the transports. ``start`` and
``stop`` are coroutines for the daemon; neither blocks the loop.

Cadence: the status snapshot every ``min(interval_s, 10)`` seconds; a telemetry sample
every ``[telemetry] interval_s``. Each keeps its own previous reading, so both windows
are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from edged import __version__
from edged.config import Config
from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.protocol.fleet.telemetry import ModelWindow, MqttWindow, TelemetrySample
from edged.telemetry import message, prometheus
from edged.telemetry.buffer import BufferStats, TelemetryBuffer
from edged.telemetry.counter_journal import JOURNAL_FILE, JOURNAL_INTERVAL_S, CounterJournal, JournalLine
from edged.telemetry.device import DeviceSampler
from edged.telemetry.model_metrics import Key, ModelCounters, ModelMetrics, ModelSnapshot
from edged.telemetry.readings import DeviceReading
from edged.telemetry.snapshot import (
    STATUS_FILE,
    BufferStatus,
    ModelStatus,
    StatusSnapshot,
    TelemetryStatus,
    UploadStatus,
    boot_id,
    write_snapshot,
)
from edged.telemetry.upload import Uploader, UploadSettings, UploadStats

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 10.0
BUFFER_FILE = "telemetry/buffer.db"
# The agent's threads get this long to finish at stop: an upload blocked on a slow registry must
# not hold the daemon past systemd's stop timeout (the buffer keeps what was not acknowledged).
STOP_JOIN_S = 5.0
# publish(topic, payload): False (or an exception) means not sent; None is taken as sent.
Publish = Callable[[str, bytes], bool | None]


class _Window:
    """The previous reading of one consumer (telemetry or status), to difference against.

    Model counters are kept per (model, version, backend) with the activation they belong to:
    a window differences only against the same activation, so a version loaded again starts
    from zero instead of carrying what it served before it was unloaded.
    """

    def __init__(self) -> None:
        self.device: DeviceReading | None = None
        self.models: dict[Key, ModelSnapshot] = {}
        self.ended: list[ModelSnapshot] = []

    def advance(self, device: DeviceReading, snaps: list[ModelSnapshot]) -> tuple[DeviceReading | None,
                                                                                  dict[Key, ModelCounters]]:
        prev_dev, prev = self.device, self.models
        self.device, self.models = device, {s.key: s for s in snaps}
        self.ended = [p for p in prev.values() if (s := self.models.get(p.key)) is None or s.activation != p.activation]
        return prev_dev, {s.key: p.counters for s in snaps
                          if (p := prev.get(s.key)) is not None and p.activation == s.activation}

    def pending(self, snaps: list[ModelSnapshot], metrics: ModelMetrics) -> list[ModelWindow]:
        """The model windows a sample taken now would carry, without advancing (for the counter journal)."""
        now = {s.key: s for s in snaps}
        prev = {s.key: p.counters for s in snaps
                if (p := self.models.get(s.key)) is not None and p.activation == s.activation}
        out = message.model_windows(snaps, prev)
        for p in self.models.values():
            s = now.get(p.key)
            if s is not None and s.activation == p.activation:
                continue
            final = metrics.final(p.key, p.activation)
            if final is not None:
                out.append(message.model_window(replace(p, counters=final, in_flight=0), p.counters))
        return [w for w in out if w.success or w.failures or w.executions or w.internal]

    def closing(self, metrics: ModelMetrics) -> list[ModelWindow]:
        """The last window of each activation that ended since the previous reading (after :meth:`advance`)."""
        out = []
        for p in self.ended:
            final = metrics.final(p.key, p.activation)
            if final is None:
                continue
            last = replace(p, counters=final, in_flight=0)
            w = message.model_window(last, p.counters)
            if w.success or w.failures or w.executions:
                out.append(w)
        return out


class TelemetryAgent:
    name = "telemetry"

    def __init__(self, cfg: Config, service: InferenceService, *, publish: Publish | None = None,  # noqa: PLR0913  optional keyword-only collaborators
                 profile: str | None = None, sampler: DeviceSampler | None = None,
                 upload: UploadSettings | None = None, status_interval_s: float | None = None,
                 mqtt_stats: Callable[[], MqttWindow] | None = None,
                 metrics: prometheus.MetricsRenderer | None = None) -> None:
        """``publish(topic, payload)`` sends over MQTT (any thread) and returns False when it could not;
        ``upload`` overrides what cfg says; ``mqtt_stats`` reads the MQTT transport's counts since start;
        ``metrics``, the daemon's ``/metrics`` renderer, gets this agent's families and device readings
        while it runs."""
        self.metrics = metrics
        self.cfg = cfg
        self.service = service
        self.publish = publish
        self.mqtt_stats = mqtt_stats
        self._mqtt_prev: MqttWindow | None = None
        self.profile = profile
        self.enabled = cfg.telemetry.enabled
        self.interval_s = cfg.telemetry.interval_s
        self.status_interval_s = status_interval_s or min(self.interval_s, STATUS_INTERVAL_S)
        self.topic = f"{cfg.mqtt.topic_prefix}/{cfg.device.id}/telemetry"
        self.status_path = cfg.device.runtime_dir / STATUS_FILE
        self.buffer_path = cfg.device.state_dir / BUFFER_FILE
        self.upload_settings = upload if upload is not None else UploadSettings.from_config(cfg)
        self.run_id = uuid.uuid4().hex
        self.sampler = sampler or DeviceSampler(cfg.device.state_dir)
        # One series for /metrics, the status file and the windows: the renderer's, when there is one.
        self.models = metrics.collector.models if metrics is not None else ModelMetrics(service)
        self.buffer: TelemetryBuffer | None = None
        self.journal: CounterJournal | None = None  # with a buffer: the counts since its last sample, every second
        self._last_sample_mono = time.monotonic()
        self.uploader: Uploader | None = None
        self.samples_total = 0
        self.publish_failures = 0
        self._seq = 0  # used only when nothing is buffered
        self._started_wall = time.time()
        self._started_mono = time.monotonic()
        self._boot_id = boot_id()
        self._sample_lock = threading.Lock()
        self._telemetry_window = _Window()
        self._status_window = _Window()
        self._stop = threading.Event()
        self._wake_upload = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_publish_error: str | None = None
        self._failing: set[str] = set()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._open)
        self._threads = [threading.Thread(target=self._loop, name="edged-telemetry", daemon=True)]
        if self.uploader is not None:
            self._threads.append(threading.Thread(target=self.uploader.run, args=(self._stop, self._wake_upload),
                                                  name="edged-telemetry-upload", daemon=True))
        for t in self._threads:
            t.start()

    def _open(self) -> None:
        """Telemetry trouble never stops the daemon: without a buffer or uploader it still samples and publishes."""
        if self.enabled and self.upload_settings is not None:
            self.buffer = self._open_buffer()
            if self.buffer is not None:
                self._guard("counter journal replay", self._replay_journal)
                try:
                    self.uploader = Uploader(self.upload_settings, self.buffer)
                except EdgedError as e:
                    log.error("telemetry upload disabled: %s (samples are kept in the buffer)", e)
        if self.metrics is not None:
            collector = self.metrics.collector
            collector.telemetry = self
            if collector.sampler is None:
                collector.sampler = self.sampler
        baseline = self.sampler.read(0)
        snaps = self.models.snapshot()
        # No model baseline for telemetry: the first window counts each activation from its start,
        # so what was served before the agent started is in a window too.
        self._telemetry_window.advance(baseline, [])
        self._status_window.advance(baseline, snaps)
        self._guard("status snapshot", self.write_status)

    def _replay_journal(self) -> None:
        """What the previous run counted after its last buffered sample, from its journal (counter_journal)."""
        buffer = self.buffer
        assert buffer is not None
        journal = CounterJournal(self.cfg.device.state_dir / JOURNAL_FILE)
        line = journal.last()
        if line is not None and line.models and line.after == buffer.next_seq() - 1:
            sample = TelemetrySample(device=self.cfg.device.id, run=line.run, t=round(line.t, 3),
                                     window_s=round(line.window_s, 3), uptime_s=round(line.uptime_s, 3),
                                     profile=self.profile, models=line.models)
            sample.seq = buffer.next_seq()
            buffer.append(sample.seq, sample.model_dump_json(exclude_none=True).encode(), line.t)
            log.warning("telemetry: the previous run (%s) ended without a last sample; %d request(s) it counted "
                        "in its last %.1f s recovered from the counter journal", line.run,
                        sum(w.success + w.failure_count for w in line.models), line.window_s)
        journal.clear()
        self.journal = journal

    def _open_buffer(self) -> TelemetryBuffer | None:
        capacity = int(self.cfg.telemetry.buffer_mb * (1 << 20))
        try:
            return TelemetryBuffer(self.buffer_path, capacity)
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError):  # locked, unwritable: not the file's fault
                log.error("telemetry buffer %s unusable (%s): samples will not be kept for upload",
                          self.buffer_path, e)
                return None
            aside = self.buffer_path.with_name(f"{self.buffer_path.name}.corrupt-{int(time.time())}")
            log.error("telemetry buffer %s is damaged (%s); moved to %s, starting a new one", self.buffer_path, e,
                      aside.name)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.replace(f"{self.buffer_path}{suffix}", f"{aside}{suffix}")
            try:
                return TelemetryBuffer(self.buffer_path, capacity)
            except (sqlite3.Error, OSError) as e2:
                log.error("telemetry buffer unusable (%s): samples will not be kept for upload", e2)
                return None
        except OSError as e:
            log.error("telemetry buffer %s unusable (%s): samples will not be kept for upload", self.buffer_path, e)
            return None

    async def stop(self) -> None:
        self._stop.set()
        self._wake_upload.set()
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        end = time.monotonic() + STOP_JOIN_S
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t for t in self._threads if t.is_alive()]
        sampling_done = not (self._threads and self._threads[0] in stuck)  # else it may hold the sample lock
        self._threads = []
        if stuck:
            # Daemon threads: they end with the process. The buffer stays open for them; SQLite's
            # journal keeps it consistent, and unacknowledged samples are uploaded after the restart.
            log.warning("telemetry: %s did not finish within %.0f s of the stop; not waiting for it",
                        " and ".join(t.name for t in stuck), STOP_JOIN_S)
        if sampling_done:
            if self.enabled:
                # A last window up to the stop, so a restart loses no counts (it waits in the buffer).
                self._guard("final telemetry sample", self.sample_now)
            with contextlib.suppress(OSError):
                self.write_status(state="stopped")
        if self.metrics is not None and self.metrics.collector.telemetry is self:
            self.metrics.collector.telemetry = None
            if self.metrics.collector.sampler is self.sampler:
                self.metrics.collector.sampler = None
        if self.journal is not None and sampling_done:
            self.journal.close()
            self.journal = None
        if self.buffer is not None and not stuck:
            self.buffer.close()
            self.buffer = None
        if sampling_done:
            self.sampler.close()

    def _loop(self) -> None:
        next_status = time.monotonic() + self.status_interval_s
        next_sample = time.monotonic() + self.interval_s
        next_journal = time.monotonic() + JOURNAL_INTERVAL_S
        while not self._stop.is_set():
            now = time.monotonic()
            if self.enabled and now >= next_sample:
                next_sample = max(next_sample + self.interval_s, now)
                self._guard("telemetry sample", self.sample_now)
            elif self.journal is not None and now >= next_journal:
                next_journal = max(next_journal + JOURNAL_INTERVAL_S, now)
                self._guard("counter journal", self.journal_now)
            if now >= next_status:
                next_status = max(next_status + self.status_interval_s, now)
                self._guard("status snapshot", self.write_status)
            targets = [next_status] + ([next_sample] if self.enabled else []) + (
                [next_journal] if self.journal is not None else [])
            self._stop.wait(max(0.0, min(targets) - time.monotonic()))

    def _guard(self, what: str, fn: Callable[[], object]) -> None:
        """Run one periodic job; a failure is logged once per kind of failure, and the loop goes on."""
        try:
            fn()
        except Exception as e:
            key = f"{what}: {type(e).__name__}"
            if key not in self._failing:
                self._failing.add(key)
                log.exception("%s failed (logged once; retried every interval)", what)
        else:
            self._failing = {k for k in self._failing if not k.startswith(what)}

    # ---- telemetry samples ----------------------------------------------------------------------
    def sample_now(self) -> TelemetrySample:
        """Take one sample now: publish it and buffer it for upload. Blocking; returns what was sent."""
        with self._sample_lock:
            reading = self.sampler.read(0)
            snaps = self.models.snapshot()
            prev_dev, prev_models = self._telemetry_window.advance(reading, snaps)
            window = reading.monotonic - prev_dev.monotonic if prev_dev is not None else 0.0
            sample = TelemetrySample(
                device=self.cfg.device.id, run=self.run_id, t=round(reading.wall_time, 3),
                window_s=round(max(window, 0.0), 3), uptime_s=round(reading.monotonic - self._started_mono, 3),
                profile=self.profile, system=message.system_window(reading, prev_dev),
                models=message.model_windows(snaps, prev_models) + self._telemetry_window.closing(self.models))
            if self.mqtt_stats is not None:
                cur = self.mqtt_stats()
                sample.mqtt, self._mqtt_prev = cur.minus(self._mqtt_prev), cur
            if self.buffer is not None:
                sample.seq = self.buffer.next_seq()
                body = sample.model_dump_json(exclude_none=True).encode()
                dropped = self.buffer.append(sample.seq, body, reading.wall_time)
                if dropped:
                    log.debug("telemetry buffer full: dropped the %d oldest sample(s)", dropped)
                if self.journal is not None:  # the buffer holds all of it now
                    self.journal.clear()
            else:
                self._seq += 1
                sample.seq = self._seq
                body = sample.model_dump_json(exclude_none=True).encode()
            self._last_sample_mono = reading.monotonic
            self.samples_total += 1
            if self.publish is not None:
                try:
                    sent = self.publish(self.topic, body)
                    error = None if sent is not False else "not connected to the broker, or its send queue is full"
                except Exception as e:  # the broker being away must not stop buffering and upload
                    error = str(e) or type(e).__name__
                if error is None:
                    self._last_publish_error = None
                else:
                    self.publish_failures += 1
                    if self._last_publish_error is None:
                        log.warning("telemetry not published on MQTT: %s", error)
                    self._last_publish_error = error
            return sample

    def journal_now(self) -> None:
        """Journal the counts a sample taken now would carry (fsync'ed; skipped when nothing changed)."""
        with self._sample_lock:
            journal, buffer = self.journal, self.buffer
            if journal is None or buffer is None:
                return
            snaps = self.models.snapshot()
            now = time.monotonic()
            journal.write(JournalLine(run=self.run_id, after=buffer.next_seq() - 1, t=time.time(),
                                      uptime_s=max(0.0, now - self._started_mono),
                                      window_s=max(0.0, now - self._last_sample_mono),
                                      models=self._telemetry_window.pending(snaps, self.models)))

    def upload_now(self) -> None:
        """Cut the uploader's wait short (after a burst of samples, or in tests)."""
        self._wake_upload.set()

    def buffer_stats(self) -> BufferStats | None:
        b = self.buffer
        return b.stats() if b is not None else None

    def upload_stats(self) -> UploadStats | None:
        u = self.uploader
        return u.stats() if u is not None else None

    # ---- status snapshot ------------------------------------------------------------------------
    def status(self, state: str = "running") -> StatusSnapshot:
        reading = self.sampler.read(0)
        snaps = self.models.snapshot()
        prev_dev, prev_models = self._status_window.advance(reading, snaps)
        window = reading.monotonic - prev_dev.monotonic if prev_dev is not None else 0.0
        by_key = {s.key: s for s in snaps}
        models = []
        for v in self.models.versions():
            ms = ModelStatus(model=v.model, version=v.version, state=v.state, reason=v.reason, backend=v.backend,
                             device=v.device, precision=v.precision, warmup=v.warmup, note=v.note,
                             choice=v.choice)
            snap = by_key.get((v.model, v.version, v.backend))
            if snap is not None:
                w = message.model_window(snap, prev_models.get(snap.key))
                if window > 0:
                    ms.requests_per_s = round((w.success + w.failure_count) / window, 3)
                    ms.errors_per_s = round(w.failure_count / window, 3)
                ms.p50_s, ms.p99_s, ms.in_flight = w.p50_s, w.p99_s, snap.in_flight
                ms.success_total, ms.failures_total = snap.counters.success, snap.counters.failures
                ms.activation, ms.activated_at = snap.activation, round(snap.activated_at, 3)
            models.append(ms)
        tel = TelemetryStatus(enabled=self.enabled, interval_s=self.interval_s, samples_total=self.samples_total,
                              mqtt=self.publish is not None)
        if (b := self.buffer_stats()) is not None:
            tel.buffer = BufferStatus(samples=b.samples, bytes=b.bytes, capacity_bytes=b.capacity_bytes,
                                      dropped_total=b.dropped_total, oldest_t=b.oldest_t)
        if (u := self.upload_stats()) is not None:
            tel.upload = UploadStatus(state=u.state, uploaded_total=u.uploaded_total, failures_total=u.failures_total,
                                      rejected_total=u.rejected_total, last_success_wall=u.last_success_wall,
                                      last_error=u.last_error)
        notes = list(reading.notes)
        mqtt = self.mqtt_stats() if self.mqtt_stats is not None else None
        if mqtt is not None and mqtt.broker_stall:
            notes.append(mqtt.broker_stall)
        if self._last_publish_error:
            notes.append(f"telemetry not published on MQTT: {self._last_publish_error}")
        return StatusSnapshot(
            state=state, pid=os.getpid(), device=self.cfg.device.id, profile=self.profile,
            edged_version=__version__, started_at=self._started_wall, written_at=time.time(),
            written_mono=time.monotonic(), boot_id=self._boot_id,
            interval_s=self.status_interval_s, window_s=round(window, 3),
            system=message.system_window(reading, prev_dev), models=models, telemetry=tel, mqtt=mqtt, notes=notes)

    def write_status(self, state: str = "running") -> None:
        write_snapshot(self.status_path, self.status(state))


def status_path(cfg: Config) -> Path:
    return cfg.device.runtime_dir / STATUS_FILE
