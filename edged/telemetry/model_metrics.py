"""Model metrics from the scheduler's statistics: one series per activation of a version.

Each loaded model version owns a :class:`~edged.core.stats.ModelStats` that names its
*activation*: it starts when the version is published and ends when it leaves the table.
Reloading a version in place (same number, new files or a new engine) publishes a fresh
ModelStats that continues the activation; :class:`ModelMetrics` notices the new object and
carries the old one's totals forward, so the series only goes up. A version loaded again
later (a rollback to it, a re-activation) is a new activation: its counters start at zero
with a new ``activated_at``, which is what ``/metrics`` exposes as ``_created``, the status
file as ``activated_at`` and telemetry windows as ``activation``. Nothing of an earlier
activation can leak into a later one's windows.

One ModelMetrics per daemon start, kept by the ``/metrics`` renderer the daemon makes and read by
the telemetry agent it is handed to: ``/metrics``, ``edged status`` and the telemetry windows read
the same carry-over state, so they agree.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TypeVar

from edged.core.public import ModelState, ModelStats, ModelVersion, choice_line
from edged.core.service import InferenceService
from edged.protocol.fleet.telemetry import HistCounts

Key = tuple[str, int, str]  # model, version, backend
MAX_ENDED = 256  # ended activations remembered for their last window


K = TypeVar("K", str, int)


def _add(a: dict[K, int], b: dict[K, int], sign: int) -> dict[K, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v}


@dataclass
class ModelCounters:
    """Everything cumulative about one model version (counts, seconds, histograms)."""

    success: int = 0
    failures_by_code: dict[str, int] = field(default_factory=dict)
    inferences: int = 0  # batch elements computed
    executions: int = 0  # engine runs
    success_s: float = 0.0
    queue_s: float = 0.0
    compute_input_s: float = 0.0
    compute_infer_s: float = 0.0
    compute_output_s: float = 0.0
    batches: dict[int, int] = field(default_factory=dict)  # engine runs per batch size
    latency: HistCounts = field(default_factory=HistCounts)  # end to end, successful requests
    queue: HistCounts = field(default_factory=HistCounts)
    compute: HistCounts = field(default_factory=HistCounts)  # per engine run
    internal: dict[str, int] = field(default_factory=dict)  # the daemon's own requests by source, not served ones

    @property
    def failures(self) -> int:
        return sum(self.failures_by_code.values())

    @classmethod
    def read(cls, st: ModelStats) -> tuple[ModelCounters, int]:
        """A consistent copy of ``st`` (under its lock) and its in-flight count."""
        with st.settled() as in_flight:
            c = cls(
                success=st.success.count, failures_by_code=dict(st.failures_by_code),
                inferences=st.inference_count, executions=st.execution_count,
                success_s=st.success.ns / 1e9, queue_s=st.queue.ns / 1e9,
                compute_input_s=st.compute_input.ns / 1e9, compute_infer_s=st.compute_infer.ns / 1e9,
                compute_output_s=st.compute_output.ns / 1e9,
                batches={bs: b.compute_infer.count for bs, b in st.batches.items()},
                latency=HistCounts.of(st.total_hist), queue=HistCounts.of(st.queue_hist),
                compute=HistCounts.of(st.compute_hist), internal=dict(st.internal))
            return c, in_flight

    def _combine(self, o: ModelCounters, sign: int) -> ModelCounters:
        def h(a: HistCounts, b: HistCounts) -> HistCounts:
            return a.plus(b) if sign > 0 else a.minus(b)

        return ModelCounters(
            success=self.success + sign * o.success,
            failures_by_code=_add(self.failures_by_code, o.failures_by_code, sign),
            inferences=self.inferences + sign * o.inferences, executions=self.executions + sign * o.executions,
            success_s=self.success_s + sign * o.success_s, queue_s=self.queue_s + sign * o.queue_s,
            compute_input_s=self.compute_input_s + sign * o.compute_input_s,
            compute_infer_s=self.compute_infer_s + sign * o.compute_infer_s,
            compute_output_s=self.compute_output_s + sign * o.compute_output_s,
            batches=_add(self.batches, o.batches, sign),
            latency=h(self.latency, o.latency), queue=h(self.queue, o.queue), compute=h(self.compute, o.compute),
            internal=_add(self.internal, o.internal, sign))

    def plus(self, o: ModelCounters) -> ModelCounters:
        return self._combine(o, 1)

    def minus(self, o: ModelCounters) -> ModelCounters:
        """The window between an earlier copy ``o`` and this one."""
        return self._combine(o, -1)


@dataclass
class ModelSnapshot:
    model: str
    version: int
    backend: str
    device: str
    precision: str
    counters: ModelCounters
    in_flight: int
    activation: str = ""
    activated_at: float = 0.0

    @property
    def key(self) -> Key:
        return (self.model, self.version, self.backend)


@dataclass
class VersionState:
    """What every known version looks like now, loaded or not (for ready gauges and ``edged status``)."""

    model: str
    version: int
    state: str
    reason: str | None
    backend: str
    device: str
    precision: str
    warmup: str | None = None  # warm-up skipped or on made-up data, and how to declare real shapes
    note: str | None = None  # a declared output shape the engine's answers contradict
    choice: str | None = None  # how the engine was chosen, on what evidence (core.model_versions.choice_line)


@dataclass
class _Track:
    current: ModelStats
    activation: str
    activated_at: float
    retired: list[ModelStats] = field(default_factory=list)  # replaced in place, maybe still draining
    base: ModelCounters = field(default_factory=ModelCounters)  # folded-in totals of idle replaced objects


class ModelMetrics:
    """Reads every loaded version's statistics; make one per service and hand it to every reader."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._tracks: dict[Key, _Track] = {}
        # Activations that ended (unloaded, replaced), kept so a reader can count their last partial
        # window: what they served between its previous reading and the unload.
        self._ended: OrderedDict[tuple[Key, str], _Track] = OrderedDict()

    def _end(self, key: Key, tr: _Track) -> None:
        self._ended[(key, tr.activation)] = tr
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def final(self, key: Key, activation: str) -> ModelCounters | None:
        """The totals of an ended activation (None when unknown or long gone)."""
        with self._lock:
            tr = self._ended.get((key, activation))
            if tr is None:
                return None
            total = tr.base
            for st in (tr.current, *tr.retired):
                total = total.plus(ModelCounters.read(st)[0])
            return total

    def snapshot(self) -> list[ModelSnapshot]:
        out = []
        with self._lock:
            seen: set[Key] = set()
            for mv in self.service.versions():
                st = mv.stats
                if st is None:
                    continue
                key = (mv.name, mv.version, st.backend)
                seen.add(key)
                tr = self._tracks.get(key)
                if tr is None or tr.activation != st.activation:
                    if tr is not None:
                        self._end(key, tr)
                    tr = self._tracks[key] = _Track(current=st, activation=st.activation,
                                                    activated_at=st.activated_at)
                elif tr.current is not st:
                    tr.retired.append(tr.current)
                    tr.current = st
                total, in_flight = ModelCounters.read(st)
                total = total.plus(tr.base)
                still: list[ModelStats] = []
                for old in tr.retired:
                    counts, busy = ModelCounters.read(old)
                    if busy > 0:
                        still.append(old)
                        in_flight += busy
                        total = total.plus(counts)
                    else:
                        tr.base = tr.base.plus(counts)
                        total = total.plus(counts)
                tr.retired = still
                c = mv.candidate
                out.append(ModelSnapshot(mv.name, mv.version, st.backend, c.device if c else "",
                                         c.precision if c else "", total, in_flight, tr.activation,
                                         tr.activated_at))
            for key in set(self._tracks) - seen:  # that activation ended: a later load starts a new one
                self._end(key, self._tracks.pop(key))
        return out

    def versions(self) -> list[VersionState]:
        return [_state(mv) for mv in self.service.versions()]


def _state(mv: ModelVersion) -> VersionState:
    c = mv.candidate
    return VersionState(mv.name, mv.version, mv.state.value, mv.reason if mv.state is not ModelState.READY else None,
                        c.backend if c else "", c.device if c else "", c.precision if c else "", mv.warmup_note,
                        mv.output_note, choice_line(mv))
