"""What a v2 server says about its models: the plain data core hands over, and its v2/Triton wire form.

Core describes a model version, its statistics and the repository in these typed records; the v2
transports (HTTP, gRPC) and the other faces that show them (MQTT, shm) turn them into Triton's
shapes here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RepositoryEntry:
    """One row of the repository index: a version in the table, or a model folder not loaded."""

    name: str
    version: int | None  # None: on disk, not loaded
    state: str  # edged's state name (``ready``, ``unavailable``, ...)
    reason: str = ""


def index_response(entries: Sequence[RepositoryEntry], ready_only: bool) -> list[dict[str, Any]]:
    """Triton's repository index: name, version, state (upper case) and reason, sorted by name and version."""
    out = [
        {
            "name": e.name,
            "version": "" if e.version is None else str(e.version),
            "state": e.state.upper(),
            "reason": e.reason,
        }
        for e in entries
    ]
    out.sort(key=lambda e: (e["name"], e["version"]))
    return [e for e in out if e["state"] == "READY"] if ready_only else out


@dataclass(frozen=True)
class TensorDescription:
    name: str
    datatype: str
    shape: tuple[int, ...]  # one request's shape, without the batch dimension


@dataclass(frozen=True)
class ModelDescription:
    """One model version as a v2 server describes it, plus where it runs (``details``: edged's own
    fields, passed to the wire as they are)."""

    name: str
    versions: tuple[int, ...]
    platform: str
    batched: bool  # max_batch_size > 0: every tensor has a leading batch dimension
    inputs: tuple[TensorDescription, ...]
    outputs: tuple[TensorDescription, ...]
    details: Mapping[str, Any] = field(default_factory=dict)


def metadata_response(d: ModelDescription) -> dict[str, Any]:
    """The v2 model metadata response (a batched model's tensors lead with -1), edged's details as parameters."""
    lead = [-1] if d.batched else []

    def tensors(specs: Sequence[TensorDescription]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": s.datatype, "shape": lead + list(s.shape)} for s in specs]

    return {
        "name": d.name,
        "versions": [str(v) for v in d.versions],
        "platform": d.platform,
        "inputs": tensors(d.inputs),
        "outputs": tensors(d.outputs),
        "parameters": dict(d.details),
    }


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True)
class BatchTimes:
    """The compute times of the engine runs of one batch size."""

    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass(frozen=True)
class VersionStatistics:
    """One model version's counters, taken at one moment."""

    name: str
    version: int
    last_inference_ms: int  # wall clock, milliseconds since the epoch
    inference_count: int  # samples (batch elements)
    execution_count: int  # engine runs
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    batches: tuple[BatchTimes, ...]
    failures_by_code: Mapping[str, int]
    internal_requests: Mapping[str, int]  # requests the daemon sent itself, by source
    in_flight: int
    inline_count: int
    batching: Mapping[str, Any] | None  # the scheduler's batching decision


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def statistics_entry(s: VersionStatistics) -> dict[str, Any]:
    """Triton's statistics extension entry for one version (edged's extra counters alongside)."""
    return {
        "name": s.name,
        "version": str(s.version),
        "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": _duration(s.success),
            "fail": _duration(s.fail),
            "queue": _duration(s.queue),
            "compute_input": _duration(s.compute_input),
            "compute_infer": _duration(s.compute_infer),
            "compute_output": _duration(s.compute_output),
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": b.batch_size,
                "compute_input": _duration(b.compute_input),
                "compute_infer": _duration(b.compute_infer),
                "compute_output": _duration(b.compute_output),
            }
            for b in s.batches
        ],
        "failures_by_code": dict(s.failures_by_code),
        "internal_requests": dict(s.internal_requests),
        "in_flight": s.in_flight,
        "inline_count": s.inline_count,
        "batching": None if s.batching is None else dict(s.batching),
    }


def statistics_response(stats: Sequence[VersionStatistics]) -> dict[str, Any]:
    """The v2 statistics extension's response body."""
    return {"model_stats": [statistics_entry(s) for s in stats]}
