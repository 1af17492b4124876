"""The daemon's side of a measurement: queue and compute time from ``/v2/models/{m}/stats``.

The statistics are cumulative counters, so a snapshot at each window boundary and
the difference over the windows that count give the server's split for exactly
those requests. Every transport feeds the same counters, so the HTTP endpoint
serves shm and MQTT runs too, when it is reachable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from edged.errors import EdgedError

_INFER_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Snapshot:
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0

    @classmethod
    def from_triton(cls, model_stats: Iterable[Mapping[str, Any]]) -> Snapshot:
        """Sum over the versions listed (a request without a version may reach any of them)."""
        acc = dict.fromkeys((f.name for f in fields(cls)), 0)
        for st in model_stats:
            inf = st["inference_stats"]
            acc["success_count"] += int(inf["success"]["count"])
            acc["success_ns"] += int(inf["success"]["ns"])
            acc["fail_count"] += int(inf["fail"]["count"])
            for key in _INFER_STATS[2:]:
                acc[f"{key}_ns"] += int(inf[key]["ns"])
            acc["inference_count"] += int(st.get("inference_count", 0))
            acc["execution_count"] += int(st.get("execution_count", 0))
        return cls(**acc)


@dataclass(frozen=True)
class ServerSplit:
    """Means over an interval, in microseconds: queue and total per request, compute per engine run."""

    requests: int
    request_us: float  # time in the daemon's core: queue + compute
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    avg_batch: float  # inferences per engine run

    @property
    def compute_us(self) -> float:
        return self.compute_input_us + self.compute_infer_us + self.compute_output_us


def split(before: Snapshot, after: Snapshot) -> ServerSplit | None:
    n = after.success_count - before.success_count
    if n <= 0:
        return None
    runs = after.execution_count - before.execution_count
    inferences = after.inference_count - before.inference_count

    def us(attr: str, per: int) -> float:
        return float(getattr(after, attr) - getattr(before, attr)) / per / 1e3

    # The engine's time is counted once per engine run (a batch of requests); each request in that
    # batch waited for all of it, so per run is what a request experienced.
    per_run = runs if runs > 0 else n
    return ServerSplit(n, us("success_ns", n), us("queue_ns", n), us("compute_input_ns", per_run),
                       us("compute_infer_ns", per_run), us("compute_output_ns", per_run),
                       inferences / runs if runs > 0 else 0.0)


class StatsReader:
    """Reads one model's counters over HTTP; says why when it cannot."""

    def __init__(self, url: str | None, model: str, version: int | None, *, timeout: float = 2.0,
                 unavailable_reason: str = "") -> None:
        self.url, self.model, self.version = url, model, version
        self.reason = unavailable_reason
        self._client: Any = None
        if url is not None:
            from edged.client.http import HttpClient

            self._client = HttpClient(url, timeout=timeout)

    @property
    def available(self) -> bool:
        return self._client is not None

    def snapshot(self) -> Snapshot | None:
        """Current counters, or None (and ``available`` turns False with a reason) when unreadable."""
        if self._client is None:
            return None
        try:
            stats = self._client.statistics(self.model)
        except EdgedError as e:
            self.reason = f"the statistics endpoint at {self.url} did not answer: {e}"
            self.close()
            return None
        if self.version is not None:
            stats = [s for s in stats if str(s.get("version")) == str(self.version)]
        try:
            return Snapshot.from_triton(stats)
        except (KeyError, TypeError, ValueError) as e:
            self.reason = f"the statistics at {self.url} are not in Triton's format: {e}"
            self.close()
            return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
