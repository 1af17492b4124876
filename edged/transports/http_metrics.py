"""Prometheus exposition for ``/metrics``: a collector that reads the service's statistics at scrape time.

Nothing is counted twice: the scheduler already keeps Triton-style statistics, so
this collector only renames them into Prometheus families (cumulative counters
and current gauges). The telemetry work extends this module with more families.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from edged.core.models import ModelState
from edged.core.service import InferenceService

_LABELS = ["model", "version"]
# (family infix, Triton inference_stats key, what is timed): each becomes a seconds counter; the first two
# are also request counts.
_DURATIONS = (
    ("request_success", "success", "successful requests, end to end (queue included)"),
    ("request_failure", "fail", "failed requests"),
    ("queue", "queue", "requests waiting in the scheduler queue"),
    ("compute_input", "compute_input", "preparing engine inputs (batch assembly)"),
    ("compute_infer", "compute_infer", "running the engine"),
    ("compute_output", "compute_output", "splitting engine outputs"),
)


class ServiceCollector:
    """Reads :meth:`InferenceService.statistics` and model states on every scrape."""

    def __init__(self, service: InferenceService, prefix: str = "edged") -> None:
        self.service = service
        self.prefix = prefix

    def collect(self) -> Iterable[Metric]:
        p = self.prefix
        stats = self.service.statistics()
        counts = {key: CounterMetricFamily(f"{p}_inference_{name}", f"Number of {text}", labels=_LABELS)
                  for name, key, text in _DURATIONS if key in ("success", "fail")}
        seconds = {key: CounterMetricFamily(f"{p}_inference_{name}_duration_seconds", f"Seconds spent on {text}",
                                            labels=_LABELS)
                   for name, key, text in _DURATIONS}
        failures = CounterMetricFamily(f"{p}_inference_failures", "Failed requests by error code",
                                       labels=[*_LABELS, "code"])
        inferences = CounterMetricFamily(f"{p}_inference_count", "Inferences (batch elements) computed",
                                         labels=_LABELS)
        executions = CounterMetricFamily(f"{p}_inference_exec_count", "Engine executions (batches)",
                                         labels=_LABELS)
        pending = GaugeMetricFamily(f"{p}_inference_pending_requests", "Requests queued or running now",
                                    labels=_LABELS)
        for s in stats:
            labels = [str(s["name"]), str(s["version"])]
            inf: dict[str, Any] = s["inference_stats"]
            for key, fam in counts.items():
                fam.add_metric(labels, float(inf[key]["count"]))
            for key, fam in seconds.items():
                fam.add_metric(labels, inf[key]["ns"] / 1e9)
            for code, n in sorted(s.get("failures_by_code", {}).items()):
                failures.add_metric([*labels, code], float(n))
            inferences.add_metric(labels, float(s["inference_count"]))
            executions.add_metric(labels, float(s["execution_count"]))
            pending.add_metric(labels, float(s.get("in_flight", 0)))
        ready = GaugeMetricFamily(f"{p}_model_ready", "1 when the model version serves requests", labels=_LABELS)
        for mv in self.service.manager.table.all():
            ready.add_metric([mv.name, str(mv.version)], 1.0 if mv.state is ModelState.READY else 0.0)
        yield from counts.values()
        yield from seconds.values()
        yield from (failures, inferences, executions, pending, ready)


class MetricsEndpoint:
    """One registry per transport (never the global one, so tests and embedders stay isolated)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: InferenceService) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServiceCollector(service))
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
