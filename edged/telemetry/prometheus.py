"""``/metrics`` in the Prometheus text format: model, device and telemetry families, read at scrape time.

Names and labels are listed in docs/telemetry.md. Model series carry ``model``,
``version`` and ``backend``; counters come from :class:`~edged.telemetry.model_metrics.ModelMetrics`,
which keeps them monotonic when a version is reloaded. Latency histograms use the
scheduler's own buckets (seconds), so nothing is observed twice.

The daemon makes one :class:`MetricsRenderer` per start and hands it to what feeds it (the
telemetry agent, the MQTT transport: each binds its part while it runs) and to the HTTP
transport, which serves it; nothing is looked up in a module-level table. The renderer keeps the
service's one :class:`~edged.telemetry.model_metrics.ModelMetrics` (the agent reads its windows
and status from the same one), so it lives as long as the daemon: a renderer made later would
not know the carry-over of reloads that happened before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from edged.core.public import ModelState
from edged.core.service import InferenceService
from edged.protocol.fleet.telemetry import HistCounts, MqttWindow
from edged.telemetry.device import DeviceSampler
from edged.telemetry.model_metrics import ModelMetrics
from edged.telemetry.readings import DeviceReading

if TYPE_CHECKING:
    from edged.telemetry.buffer import BufferStats
    from edged.telemetry.upload import UploadStats

log = logging.getLogger(__name__)
CONTENT_TYPE = CONTENT_TYPE_LATEST
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_MODEL = ["model", "version", "backend"]
_ACC = ["accelerator", "kind"]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _hist_buckets(h: HistCounts) -> list[tuple[str, float]]:
    return [(_le(bound), float(acc)) for bound, acc in h.cumulative()]


def _batch_buckets(batches: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    out = []
    for bound in (*BATCH_BUCKETS, float("inf")):
        out.append((_le(bound), float(sum(n for bs, n in batches.items() if bs <= bound))))
    return out, float(sum(bs * n for bs, n in batches.items()))


class TelemetryCounts(Protocol):
    """What ``/metrics`` reads of the telemetry agent (which binds itself while it runs)."""

    samples_total: int
    publish_failures: int

    def buffer_stats(self) -> BufferStats | None: ...

    def upload_stats(self) -> UploadStats | None: ...


class EdgedCollector:
    """A prometheus_client collector: model metrics always, device metrics with a sampler, telemetry when bound."""

    def __init__(self, service: InferenceService, device_sampler: DeviceSampler | None = None, *,
                 telemetry: TelemetryCounts | None = None, prefix: str = "edged") -> None:
        """Keeps the service's one :class:`ModelMetrics` (the telemetry agent reads it from here)."""
        self.service = service
        self.sampler = device_sampler
        self.telemetry = telemetry
        self.mqtt: Callable[[], MqttWindow] | None = None  # bound by the MQTT transport while it runs
        self.prefix = prefix
        self.models = ModelMetrics(service)

    def collect(self) -> Iterator[Metric]:
        yield from self._model_families()
        yield from self._memory_families()
        if self.sampler is not None:
            try:
                reading = self.sampler.read()
            except Exception:  # a broken sensor must not take the model metrics down with it
                log.exception("device metrics unavailable for this scrape")
            else:
                yield from self._device_families(reading)
        if self.telemetry is not None:
            yield from self._telemetry_families(self.telemetry)
        if self.mqtt is not None:
            yield from self._mqtt_families(self.mqtt())

    def _memory_families(self) -> Iterable[Metric]:
        """The request memory budget ([limits] memory_mb): what requests hold now, at most, and refusals."""
        b, p = self.service.budget, self.prefix
        for name, text, value in (("limit", "what requests in progress may hold together", b.limit),
                                  ("used", "what requests in progress hold now", b.used),
                                  ("peak", "the most requests held at once since start", b.peak)):
            g = GaugeMetricFamily(f"{p}_request_memory_{name}_bytes", f"Request memory budget: {text}")
            g.add_metric([], float(value))
            yield g
        c = CounterMetricFamily(f"{p}_request_memory_refused", "Requests refused because the request memory "
                                "budget was full (overloaded) or too small for them (resource_exhausted)")
        c.add_metric([], float(b.refused))
        yield c

    # ---- models ---------------------------------------------------------------------------------
    def _model_families(self) -> Iterable[Metric]:
        p = self.prefix
        success = CounterMetricFamily(f"{p}_inference_request_success", "Successful requests", labels=_MODEL)
        failure = CounterMetricFamily(f"{p}_inference_request_failure", "Failed requests by error code",
                                      labels=[*_MODEL, "code"])
        inferences = CounterMetricFamily(f"{p}_inference_count", "Inferences computed (batch elements)", labels=_MODEL)
        executions = CounterMetricFamily(f"{p}_inference_exec_count", "Engine runs (batches)", labels=_MODEL)
        latency = HistogramMetricFamily(f"{p}_inference_request_duration_seconds",
                                        "End-to-end time of successful requests, queue included", labels=_MODEL)
        queue = HistogramMetricFamily(f"{p}_inference_queue_duration_seconds",
                                      "Time requests waited in the scheduler queue", labels=_MODEL)
        compute = HistogramMetricFamily(f"{p}_inference_compute_duration_seconds",
                                        "Time of one engine run (input preparation, inference, output split)",
                                        labels=_MODEL)
        parts = {name: CounterMetricFamily(f"{p}_inference_compute_{name}_duration_seconds", text, labels=_MODEL)
                 for name, text in (("input", "Time preparing engine inputs, summed over requests"),
                                    ("infer", "Time in the engine, summed over requests"),
                                    ("output", "Time splitting engine outputs, summed over requests"))}
        batch = HistogramMetricFamily(f"{p}_inference_batch_size", "Batch size of engine runs", labels=_MODEL)
        internal = CounterMetricFamily(f"{p}_inference_internal_requests",
                                       "Requests the daemon sent itself (self-test, watchdog probe), by source; "
                                       "not counted as requests served", labels=[*_MODEL, "source"])
        pending = GaugeMetricFamily(f"{p}_inference_pending_requests", "Requests queued or running now",
                                    labels=_MODEL)
        for s in self.models.snapshot():
            lv = [s.model, str(s.version), s.backend]
            c = s.counters
            # Counters restart with each activation of a version; _created says when (Prometheus
            # treats the drop as a reset, and rate() stays right across a re-activation).
            created = s.activated_at or None
            success.add_metric(lv, float(c.success), created=created)
            for code, n in sorted(c.failures_by_code.items()):
                failure.add_metric([*lv, code], float(n), created=created)
            for source, n in sorted(c.internal.items()):
                internal.add_metric([*lv, source], float(n), created=created)
            inferences.add_metric(lv, float(c.inferences), created=created)
            executions.add_metric(lv, float(c.executions), created=created)
            latency.add_metric(lv, _hist_buckets(c.latency), c.latency.total)
            queue.add_metric(lv, _hist_buckets(c.queue), c.queue.total)
            compute.add_metric(lv, _hist_buckets(c.compute), c.compute.total)
            for name, value in (("input", c.compute_input_s), ("infer", c.compute_infer_s),
                                ("output", c.compute_output_s)):
                parts[name].add_metric(lv, value, created=created)
            buckets, total = _batch_buckets(c.batches)
            batch.add_metric(lv, buckets, total)
            pending.add_metric(lv, float(s.in_flight))
        ready = GaugeMetricFamily(f"{p}_model_ready", "1 when the model version serves requests",
                                  labels=["model", "version"])
        info = GaugeMetricFamily(f"{p}_model_info", "Where each model version runs and its state (always 1)",
                                 labels=["model", "version", "backend", "device", "precision", "state"])
        for v in self.models.versions():
            ready.add_metric([v.model, str(v.version)], 1.0 if v.state == ModelState.READY.value else 0.0)
            info.add_metric([v.model, str(v.version), v.backend, v.device, v.precision, v.state], 1.0)
        return [success, failure, internal, inferences, executions, latency, queue, compute, *parts.values(), batch,
                pending, ready, info]

    # ---- device ---------------------------------------------------------------------------------
    def _device_families(self, r: DeviceReading) -> Iterable[Metric]:
        p = self.prefix
        out: list[Metric] = []

        def gauge(name: str, text: str, value: float | None, labels: dict[str, str] | None = None) -> None:
            if value is None:
                return
            fam = GaugeMetricFamily(f"{p}_{name}", text, labels=list(labels or {}))
            fam.add_metric(list((labels or {}).values()), float(value))
            out.append(fam)

        cpu = CounterMetricFamily(f"{p}_device_cpu_seconds", "CPU time of all cores since boot, by mode",
                                  labels=["mode"])
        for mode, secs in sorted(r.cpu_seconds.items()):
            cpu.add_metric([mode], secs)
        out.append(cpu)
        gauge("device_cpus", "Logical CPUs", r.cpu_count)
        load = GaugeMetricFamily(f"{p}_device_load_average", "System load average", labels=["period"])
        for period, value in zip(("1m", "5m", "15m"), r.load_average, strict=True):
            load.add_metric([period], value)
        out.append(load)
        gauge("device_memory_total_bytes", "Physical memory", r.memory_total)
        gauge("device_memory_available_bytes", "Memory available to start new work without swapping",
              r.memory_available)
        gauge("device_swap_total_bytes", "Swap space", r.swap_total)
        gauge("device_swap_used_bytes", "Swap in use", r.swap_used)
        gauge("device_disk_total_bytes", "Size of the filesystem holding the state dir", r.disk_total,
              {"volume": "state"})
        gauge("device_disk_free_bytes", "Free space on the filesystem holding the state dir", r.disk_free,
              {"volume": "state"})
        temps = GaugeMetricFamily(f"{p}_device_temperature_celsius", "Temperature sensors and thermal zones",
                                  labels=["sensor"])
        for sensor, c in sorted(r.temperatures_c.items()):
            temps.add_metric([sensor], c)
        out.append(temps)
        gauge("process_threads", "Threads of the edged process", r.process_threads)
        out += self._accelerator_families(r)
        return out

    def _accelerator_families(self, r: DeviceReading) -> list[Metric]:
        p = self.prefix
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "utilization": GaugeMetricFamily(f"{p}_accelerator_utilization_ratio", "Busy share, 0 to 1", labels=_ACC),
            "freq": GaugeMetricFamily(f"{p}_accelerator_frequency_hertz", "Current clock", labels=_ACC),
            "max_freq": GaugeMetricFamily(f"{p}_accelerator_max_frequency_hertz", "Clock ceiling now allowed",
                                          labels=_ACC),
            "mem_used": GaugeMetricFamily(f"{p}_accelerator_memory_used_bytes", "Device memory in use", labels=_ACC),
            "mem_total": GaugeMetricFamily(f"{p}_accelerator_memory_total_bytes", "Device memory", labels=_ACC),
            "power": GaugeMetricFamily(f"{p}_accelerator_power_watts", "Power draw", labels=_ACC),
            "temp": GaugeMetricFamily(f"{p}_accelerator_temperature_celsius", "Temperature", labels=_ACC),
            "idle": CounterMetricFamily(f"{p}_accelerator_idle_seconds", "Time in the idle power state (RC6)",
                                        labels=_ACC),
        }
        for a in r.accelerators:
            lv = [a.name, a.kind]
            for key, value in (("utilization", a.utilization), ("freq", a.freq_hz), ("max_freq", a.max_freq_hz),
                               ("mem_used", a.memory_used_bytes), ("mem_total", a.memory_total_bytes),
                               ("power", a.power_w), ("temp", a.temperature_c), ("idle", a.idle_s)):
                if value is not None:
                    fams[key].add_metric(lv, float(value))
        rails = {
            "power": GaugeMetricFamily(f"{p}_device_rail_power_watts", "Power of a monitored rail", labels=["rail"]),
            "voltage": GaugeMetricFamily(f"{p}_device_rail_voltage_volts", "Voltage of a monitored rail",
                                         labels=["rail"]),
            "current": GaugeMetricFamily(f"{p}_device_rail_current_amperes", "Current of a monitored rail",
                                         labels=["rail"]),
        }
        for rail in r.rails:
            for key, value in (("power", rail.power_w), ("voltage", rail.voltage_v), ("current", rail.current_a)):
                if value is not None:
                    rails[key].add_metric([rail.name], value)
        out: list[Metric] = [f for f in (*fams.values(), *rails.values()) if f.samples]
        if r.emc is not None:
            for name, text, value in (("emc_frequency_hertz", "Memory controller clock", r.emc.freq_hz),
                                      ("emc_utilization_ratio", "Memory controller busy share", r.emc.utilization)):
                if value is not None:
                    fam = GaugeMetricFamily(f"{p}_device_{name}", text)
                    fam.add_metric([], value)
                    out.append(fam)
        return out

    # ---- MQTT transport -------------------------------------------------------------------------
    def _mqtt_families(self, m: MqttWindow) -> list[Metric]:
        p = self.prefix
        counters = (("requests", "MQTT inference requests received", m.requests),
                    ("replies", "MQTT answers handed to the broker", m.replies),
                    ("error_replies", "MQTT error replies (overloaded included)", m.error_replies),
                    ("overloaded", "MQTT requests refused with 'overloaded' (max_pending_replies)", m.overloaded),
                    ("replies_dropped", "MQTT replies dropped: the broker did not take them", m.replies_dropped),
                    ("requests_dropped", "MQTT requests dropped: no usable reply address", m.requests_dropped),
                    ("replies_refused", "MQTT requests refused: response topic outside the reply namespace",
                     m.replies_refused))
        out: list[Metric] = [CounterMetricFamily(f"{p}_mqtt_{name}", text, value=float(v))
                             for name, text, v in counters]
        out.append(GaugeMetricFamily(f"{p}_mqtt_backlog", "MQTT requests computing plus replies the broker has "
                                     "not taken yet", value=float(m.backlog)))
        if m.streams:
            labels = ["topic", "model"]
            fams = {k: GaugeMetricFamily(f"{p}_stream_{k}", text, labels=labels) for k, text in (
                ("fps", "stream binding: answers per second over its recent window"),
                ("latency_ms_p50", "stream binding: arrival to result published, median over its recent window"),
                ("latency_ms_p99", "stream binding: arrival to result published, p99 over its recent window"))}
            counts = {k: CounterMetricFamily(f"{p}_stream_{k}", f"stream binding: messages {k}", labels=labels)
                      for k in ("received", "processed", "dropped", "errors")}
            for st in m.streams:
                for k, gauge in fams.items():
                    gauge.add_metric([st.topic, st.model], float(getattr(st, k)))
                for k, counter in counts.items():
                    counter.add_metric([st.topic, st.model], float(getattr(st, k)))
            out += [*fams.values(), *counts.values()]
        out.append(GaugeMetricFamily(f"{p}_mqtt_broker_delayed_ack_stall", "1 once replies were seen held at the "
                                     "broker's delayed-ACK interval (see edged status)",
                                     value=1.0 if m.broker_stall else 0.0))
        return out

    # ---- telemetry ------------------------------------------------------------------------------
    def _telemetry_families(self, agent: TelemetryCounts) -> Iterable[Metric]:
        p = self.prefix
        out: list[Metric] = []

        def add(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, text: str,
                value: float | None) -> None:
            if value is not None:
                out.append(kind(f"{p}_telemetry_{name}", text, value=float(value)))

        add(CounterMetricFamily, "samples", "Telemetry samples taken", agent.samples_total)
        add(CounterMetricFamily, "publish_failures", "Telemetry messages MQTT did not take", agent.publish_failures)
        b = agent.buffer_stats()
        if b is not None:
            add(GaugeMetricFamily, "buffer_samples", "Samples waiting in the store-and-forward buffer", b.samples)
            add(GaugeMetricFamily, "buffer_bytes", "Bytes the waiting samples take", b.bytes)
            add(GaugeMetricFamily, "buffer_capacity_bytes", "Size budget of the buffer ([telemetry] buffer_mb)",
                b.capacity_bytes)
            add(CounterMetricFamily, "dropped_samples", "Oldest samples dropped because the buffer was full "
                "(kept across restarts)", b.dropped_total)
        u = agent.upload_stats()
        if u is not None:
            add(CounterMetricFamily, "uploaded_samples", "Samples the registry acknowledged", u.uploaded_total)
            add(CounterMetricFamily, "upload_failures", "Upload attempts that failed", u.failures_total)
            add(CounterMetricFamily, "rejected_samples", "Samples the registry refused as invalid (dropped)",
                u.rejected_total)
            add(GaugeMetricFamily, "last_upload_timestamp_seconds", "When the registry last acknowledged a batch",
                u.last_success_wall)
        return out


class MetricsRenderer:
    """One isolated registry (never the global one): the edged collector plus the standard process metrics."""

    content_type = CONTENT_TYPE

    def __init__(self, service: InferenceService, sampler: DeviceSampler | None = None) -> None:
        self.collector = EdgedCollector(service, sampler)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
