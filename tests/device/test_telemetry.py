"""Telemetry on the device: sysfs readers against fixture sysroots, /metrics through the Prometheus parser with
exact counts after real inferences, the store-and-forward buffer, the agent (MQTT through a real mosquitto) and
``edged status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edged.config import ModelsSection, load_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import DeadlineExceededError
from edged.profiles import BackendPreference
from edged.protocol.fleet.telemetry import HistCounts, TelemetrySample
from edged.protocol.types import InferRequest
from edged.telemetry import jetson
from edged.telemetry.agent import TelemetryAgent
from edged.telemetry.buffer import TelemetryBuffer
from edged.telemetry.device import DeviceSampler
from edged.telemetry.intel_gpu import IntelGpuReader
from edged.telemetry.nvml import NvmlReader
from edged.telemetry.prometheus import EdgedCollector, MetricsRenderer
from edged.telemetry.snapshot import read_snapshot
from edged.telemetry.sysfs import SysRoot
from edged.telemetry.thermal import read_thermal_zones
from tests.mqtt_helpers import TestClient, running_broker
from tests.polling import wait_until_async

SYSROOTS = Path(__file__).parent.parent / "fixtures" / "sysroots"
CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


# ---- helpers ----------------------------------------------------------------------------------------
def make_service(repo: Path) -> tuple[ModelManager, InferenceService]:
    mgr = ModelManager(repo, ModelsSection(), CPU)
    mgr.load_all()
    return mgr, InferenceService(mgr)


@pytest.fixture
def digits(model_repo: Callable[..., Path]) -> Iterator[InferenceService]:
    mgr, svc = make_service(model_repo("digits"))
    yield svc
    mgr.shutdown()


def pixels(n: int = 1) -> dict[str, np.ndarray]:
    return {"pixels": np.random.default_rng(n).random((n, 64), dtype=np.float32) * 16}


def send(svc: InferenceService, n: int, *, burst: bool = False) -> None:
    """``n`` successful requests: one at a time inline, or submitted together so the batcher groups them."""
    if burst:
        futures = [svc.submit(InferRequest("digits", pixels())) for _ in range(n)]
        for f in futures:
            f.result(30)
    else:
        for _ in range(n):
            svc.infer_blocking(InferRequest("digits", pixels()))


def send_late(svc: InferenceService, n: int) -> None:
    """``n`` requests whose deadline has already passed: the scheduler fails each with deadline_exceeded."""
    for _ in range(n):
        with pytest.raises(DeadlineExceededError):
            svc.infer(InferRequest("digits", pixels(), deadline=time.monotonic() - 1.0), 30)


def families(text: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """Family name -> {(sample name, sorted labels): value}, through the Prometheus text parser."""
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
    return out


def value(fams: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]], family: str, sample: str,
          **labels: str) -> float:
    return fams[family][(sample, tuple(sorted(labels.items())))]


DIGITS = {"model": "digits", "version": "1", "backend": "onnxruntime"}


# ---- sysfs readers against the fixture sysroots ----------------------------------------------------------
@pytest.mark.parametrize(("root", "name", "util", "cur_mhz", "max_mhz"), [
    ("jetson-nano", "57000000.gpu", 0.087, 76.8, 921.6),
    ("jetson-xavier-nx", "17000000.gv11b", 0.125, 114.75, 1109.25),
    ("jetson-agx-orin", "17000000.ga10b", 0.412, 306.0, 1300.5),
    ("jetson-orin-nano", "17000000.gpu", 0.998, 306.0, 624.75),
])
def test_jetson_gpu(root: str, name: str, util: float, cur_mhz: float, max_mhz: float) -> None:
    (gpu,) = jetson.read_gpus(SysRoot(SYSROOTS / root))
    assert (gpu.name, gpu.kind) == (name, "jetson-gpu")
    assert gpu.utilization == pytest.approx(util)
    assert gpu.freq_hz == pytest.approx(cur_mhz * 1e6)
    assert gpu.min_freq_hz == pytest.approx(cur_mhz * 1e6)
    assert gpu.max_freq_hz == pytest.approx(max_mhz * 1e6)


@pytest.mark.parametrize(("root", "rails"), [
    # JetPack 4: the ina3221x IIO driver reports power itself (mW)
    ("jetson-nano", {"POM_5V_IN": (5.04, 0.624, 3.145), "POM_5V_GPU": (5.04, 0.040, 0.201),
                     "POM_5V_CPU": (5.04, 0.167, 0.841)}),
    # JetPack 5+: hwmon gives volts and amperes; power is their product
    ("jetson-xavier-nx", {"VDD_IN": (5.072, 0.952, 5.072 * 0.952), "VDD_CPU_GPU_CV": (5.064, 0.256, 5.064 * 0.256),
                          "VDD_SOC": (5.064, 0.344, 5.064 * 0.344)}),
    # two monitors, one found under the i2c driver, one under /sys/class/hwmon; "sum of shunt voltages" skipped
    ("jetson-agx-orin", {"VDD_GPU_SOC": (4.992, 1.432, 4.992 * 1.432), "VDD_CPU_CV": (4.992, 0.408, 4.992 * 0.408),
                         "VIN_SYS_5V0": (4.984, 1.232, 4.984 * 1.232),
                         "VDDQ_VDD2_1V8AO": (4.992, 0.240, 4.992 * 0.240)}),
    ("jetson-orin-nano", {"VDD_IN": (5.056, 1.184, 5.056 * 1.184), "VDD_CPU_GPU_CV": (5.048, 0.488, 5.048 * 0.488),
                          "VDD_SOC": (5.048, 0.360, 5.048 * 0.360)}),
    ("raspberry-pi-5", {}),
])
def test_power_rails(root: str, rails: dict[str, tuple[float, float, float]]) -> None:
    got = {r.name: (r.voltage_v, r.current_a, r.power_w) for r in jetson.read_rails(SysRoot(SYSROOTS / root))}
    assert set(got) == set(rails)
    for name, expected in rails.items():
        assert got[name] == pytest.approx(expected), name


@pytest.mark.parametrize(("root", "freq_mhz", "util"), [
    ("jetson-nano", 1600.0, 0.06),  # /sys/kernel/debug/clk/emc/clk_rate
    ("jetson-xavier-nx", 1866.0, 0.10),  # BPMP debugfs
    ("jetson-agx-orin", 2133.0, 0.20),
    ("jetson-orin-nano", None, None),  # no debugfs (not root): the activity count alone has no scale
    ("x86-64-nvidia-dgpu", None, None),
])
def test_emc(root: str, freq_mhz: float | None, util: float | None) -> None:
    emc = jetson.read_emc(SysRoot(SYSROOTS / root))
    if freq_mhz is None:
        assert emc is None
        return
    assert emc is not None
    assert emc.freq_hz == pytest.approx(freq_mhz * 1e6)
    assert emc.utilization == pytest.approx(util)


@pytest.mark.parametrize(("root", "zones"), [
    # PMIC-Die reports a fixed 100 C placeholder and is left out
    ("jetson-nano", {"AO-therm": 39.5, "CPU-therm": 35.5, "GPU-therm": 34.0, "PLL-therm": 33.25,
                     "thermal-fan-est": 35.1}),
    ("jetson-agx-orin", {"cpu-thermal": 45.25, "gpu-thermal": 44.0, "cv0-thermal": 43.7, "soc0-thermal": 44.5,
                         "tj-thermal": 45.9}),
    # an unconnected sensor reads -256 C
    ("jetson-orin-nano", {"cpu-thermal": 48.5, "gpu-thermal": 47.906}),
    ("x86-64-nvidia-dgpu", {"x86_pkg_temp": 52.0}),
    ("raspberry-pi-5", {}),
])
def test_thermal_zones(root: str, zones: dict[str, float]) -> None:
    assert read_thermal_zones(SysRoot(SYSROOTS / root)) == pytest.approx(zones)


def test_intel_gpu_beside_nvidia_dgpu() -> None:
    """The dGPU fixture has an Intel iGPU (card0, i915 single-GT files) and the NVIDIA card (card1), skipped."""
    (igpu,) = IntelGpuReader(SysRoot(SYSROOTS / "x86-64-nvidia-dgpu")).read()
    assert (igpu.name, igpu.kind) == ("card0", "intel-gpu")
    assert igpu.freq_hz == 350e6
    assert (igpu.min_freq_hz, igpu.max_freq_hz) == (300e6, 1150e6)
    assert igpu.idle_s == pytest.approx(123.456)
    assert igpu.utilization is None  # needs a second reading


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")


@pytest.mark.parametrize(("layout", "idle_file"), [
    ({"gt/gt0/rps_act_freq_mhz": "0", "gt/gt0/rps_cur_freq_mhz": "700", "gt/gt0/rps_min_freq_mhz": "100",
      "gt/gt0/rps_max_freq_mhz": "2250"}, "gt/gt0/rc6_residency_ms"),  # i915, per-GT (Meteor Lake and later)
    ({"device/tile0/gt0/freq0/act_freq": "700", "device/tile0/gt0/freq0/cur_freq": "700",
      "device/tile0/gt0/freq0/min_freq": "100", "device/tile0/gt0/freq0/max_freq": "2250"},
     "device/tile0/gt0/gtidle/idle_residency_ms"),  # xe
])
def test_intel_gpu_layouts_and_busy_ratio(tmp_path: Path, layout: dict[str, str], idle_file: str) -> None:
    card = "sys/class/drm/card1"
    _write(tmp_path, {f"{card}/device/vendor": "0x8086", f"{card}/{idle_file}": "5000",
                      **{f"{card}/{k}": v for k, v in layout.items()},
                      "sys/class/drm/card1-DP-1/status": "connected"})  # a connector, not a card
    reader = IntelGpuReader(SysRoot(tmp_path))
    (first,) = reader.read()
    assert first.freq_hz == 700e6  # act reads 0 while asleep: the requested clock is reported then
    assert (first.min_freq_hz, first.max_freq_hz, first.idle_s) == (100e6, 2250e6, 5.0)
    assert first.utilization is None
    # No RC6 time passes while wall time does: fully busy. (Clamped ratios: exact whatever the elapsed time.)
    time.sleep(0.25)  # sleep-ok: wall time passes with no RC6 time
    assert reader.read()[0].utilization == 1.0
    _write(tmp_path, {f"{card}/{idle_file}": str(5000 + 3_600_000)})
    time.sleep(0.25)  # sleep-ok: wall time passes, RC6 time far more
    assert reader.read()[0].utilization == 0.0


def test_nvml_only_with_the_nvidia_driver_and_explained_when_missing() -> None:
    assert NvmlReader(SysRoot(SYSROOTS / "jetson-agx-orin")).read() == []
    reader = NvmlReader(SysRoot(SYSROOTS / "x86-64-nvidia-dgpu"))
    assert reader.wanted()
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert reader.read() == []
        assert reader.note is not None and "nvidia-ml-py" in reader.note
    else:  # pragma: no cover - a machine with NVML: the fixture's driver file says a GPU exists
        reader.read()
        assert reader.note is None or "NVML" in reader.note
    reader.close()


def test_device_sampler_live_and_against_a_fixture(tmp_path: Path) -> None:
    sampler = DeviceSampler(tmp_path / "state" / "not-yet", root=SYSROOTS / "jetson-agx-orin")
    r = sampler.read()
    assert sampler.read() is r  # cached for max_age_s
    assert r.cpu_count >= 1 and r.memory_total > r.memory_used > 0
    assert r.disk_total is not None and r.disk_free is not None  # the nearest existing parent's filesystem
    assert r.process_rss > 0 and r.process_threads >= 1
    assert {"user", "system", "idle"} <= set(r.cpu_seconds)
    assert [a.name for a in r.accelerators] == ["17000000.ga10b"]
    assert len(r.rails) == 4 and r.emc is not None
    assert r.temperatures_c["tj-thermal"] == 45.9
    sampler.close()


# ---- /metrics ------------------------------------------------------------------------------------------
def test_metrics_parse_and_count_exactly(digits: InferenceService, tmp_path: Path) -> None:
    send(digits, 17)
    send(digits, 12, burst=True)
    digits.infer(InferRequest("digits", pixels(8)), 30)  # one request of batch 8
    send_late(digits, 3)
    renderer = MetricsRenderer(digits, DeviceSampler(tmp_path, root=SYSROOTS / "jetson-agx-orin"))
    fams = families(renderer.render().decode())
    ok = 17 + 12 + 1
    assert value(fams, "edged_inference_request_success", "edged_inference_request_success_total", **DIGITS) == ok
    assert value(fams, "edged_inference_request_failure", "edged_inference_request_failure_total",
                 code="deadline_exceeded", **DIGITS) == 3
    assert value(fams, "edged_inference_count", "edged_inference_count_total", **DIGITS) == ok + 7
    # Histograms: +Inf bucket == _count, buckets never decrease, seconds as the unit.
    for fam in ("edged_inference_request_duration_seconds", "edged_inference_queue_duration_seconds",
                "edged_inference_compute_duration_seconds", "edged_inference_batch_size"):
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in fams[fam].items() if k[0] == f"{fam}_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == value(fams, fam, f"{fam}_count", **DIGITS)
    assert value(fams, "edged_inference_request_duration_seconds",
                 "edged_inference_request_duration_seconds_count", **DIGITS) == ok
    assert value(fams, "edged_inference_request_duration_seconds", "edged_inference_request_duration_seconds_bucket",
                 le="10.0", **DIGITS) == ok
    executions = value(fams, "edged_inference_exec_count", "edged_inference_exec_count_total", **DIGITS)
    assert value(fams, "edged_inference_batch_size", "edged_inference_batch_size_count", **DIGITS) == executions
    assert value(fams, "edged_inference_batch_size", "edged_inference_batch_size_sum", **DIGITS) == ok + 7
    assert value(fams, "edged_inference_batch_size", "edged_inference_batch_size_bucket", le="8.0", **DIGITS) > \
        value(fams, "edged_inference_batch_size", "edged_inference_batch_size_bucket", le="4.0", **DIGITS)
    assert value(fams, "edged_model_ready", "edged_model_ready", model="digits", version="1") == 1.0
    assert value(fams, "edged_inference_pending_requests", "edged_inference_pending_requests", **DIGITS) == 0
    # Device families, including the fixture's accelerator files.
    assert value(fams, "edged_device_cpu_seconds", "edged_device_cpu_seconds_total", mode="user") > 0
    assert value(fams, "edged_process_threads", "edged_process_threads") >= 1
    assert value(fams, "edged_accelerator_utilization_ratio", "edged_accelerator_utilization_ratio",
                 accelerator="17000000.ga10b", kind="jetson-gpu") == pytest.approx(0.412)
    assert value(fams, "edged_device_rail_power_watts", "edged_device_rail_power_watts",
                 rail="VDD_GPU_SOC") == pytest.approx(4.992 * 1.432)
    assert value(fams, "edged_device_emc_utilization_ratio", "edged_device_emc_utilization_ratio") == \
        pytest.approx(0.2)
    assert value(fams, "edged_device_temperature_celsius", "edged_device_temperature_celsius",
                 sensor="cpu-thermal") == 45.25
    assert value(fams, "process_resident_memory_bytes", "process_resident_memory_bytes") > 0
    # Counters only go up between scrapes.
    send(digits, 4)
    again = families(renderer.render().decode())
    assert value(again, "edged_inference_request_success", "edged_inference_request_success_total",
                 **DIGITS) == ok + 4


def test_counters_stay_monotonic_across_a_reload(model_repo: Callable[..., Path]) -> None:
    mgr, svc = make_service(model_repo("digits"))
    try:
        renderer = MetricsRenderer(svc)
        send(svc, 6)
        send_late(svc, 1)
        first = families(renderer.render().decode())
        assert value(first, "edged_inference_request_success", "edged_inference_request_success_total",
                     **DIGITS) == 6
        old_stats = mgr.table.find("digits", 1).stats  # type: ignore[union-attr]
        mgr.load_model("digits", [1])  # same version reloaded: a new ModelStats object starting at zero
        assert mgr.table.find("digits", 1).stats is not old_stats  # type: ignore[union-attr]
        send(svc, 5)
        text = renderer.render().decode()
        after = families(text)
        assert value(after, "edged_inference_request_success", "edged_inference_request_success_total",
                     **DIGITS) == 11
        assert value(after, "edged_inference_request_failure", "edged_inference_request_failure_total",
                     code="deadline_exceeded", **DIGITS) == 1
        assert value(after, "edged_inference_request_duration_seconds",
                     "edged_inference_request_duration_seconds_count", **DIGITS) == 11
    finally:
        mgr.shutdown()


def test_a_renderer_renders_the_same_counts_on_every_scrape(digits: InferenceService) -> None:
    send(digits, 2)
    renderer = MetricsRenderer(digits)
    a = families(renderer.render().decode())
    b = families(renderer.render().decode())
    assert value(a, "edged_inference_request_success", "edged_inference_request_success_total", **DIGITS) == 2
    assert a["edged_inference_request_success"] == b["edged_inference_request_success"]
    assert isinstance(EdgedCollector(digits), EdgedCollector)


def test_histogram_quantile_interpolates() -> None:
    h = HistCounts()
    assert h.quantile(0.5) is None
    h.counts[3] = 100  # all in (0.0005, 0.001]
    assert h.quantile(0.5) == pytest.approx(0.00075)
    h.counts[-1] = 1000  # mostly past the last bound: report the last finite bound
    assert h.quantile(0.99) == 10.0


# ---- the buffer ------------------------------------------------------------------------------------------
def body(seq: int, pad: int = 0) -> bytes:
    return json.dumps({"seq": seq, "pad": os.urandom(pad).hex()}).encode()


def test_buffer_survives_reopen_and_acks_in_order(tmp_path: Path) -> None:
    path = tmp_path / "telemetry" / "buffer.db"
    b = TelemetryBuffer(path, 1 << 20)
    for _ in range(5):
        seq = b.next_seq()
        b.append(seq, body(seq))
    buffer_id = b.buffer_id
    p = b.peek(3, 1 << 20)
    assert [s for s, _ in p.items] == [1, 2, 3] and json.loads(p.items[0][1])["seq"] == 1
    assert b.ack(p.last_seq, 0) == 3
    b.close()
    # A restart: the same file, the same identity, the waiting samples, and seq carries on (never reused).
    b = TelemetryBuffer(path, 1 << 20)
    assert b.buffer_id == buffer_id
    assert [s for s, _ in b.peek(100, 1 << 20).items] == [4, 5]
    assert b.next_seq() == 6
    b.ack(5, 0)
    b.close()
    b = TelemetryBuffer(path, 1 << 20)
    assert b.peek(100, 1 << 20).items == [] and b.next_seq() == 6
    with pytest.raises(ValueError, match="not after"):
        b.append(3, body(3))
    b.close()


def test_buffer_size_cap_and_drop_counting(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    cap = int(0.25 * (1 << 20))
    b = TelemetryBuffer(path, cap)
    written, dropped, largest = 1500, 0, 0
    for _ in range(written):
        seq = b.next_seq()
        dropped += b.append(seq, body(seq, pad=300))  # ~700 bytes of incompressible JSON
        largest = max(largest, b.file_bytes())
    st = b.stats()
    assert largest <= cap, f"buffer files reached {largest} bytes, over the {cap}-byte budget"
    assert st.bytes <= b.row_budget
    assert dropped == st.dropped_total == st.dropped_unreported == written - st.samples > 0
    pending = b.peek(10_000, 1 << 30)
    seqs = [s for s, _ in pending.items]
    assert seqs == list(range(written - st.samples + 1, written + 1))  # the newest survive, in order
    assert pending.dropped == dropped
    b.close()
    b = TelemetryBuffer(path, cap)  # the counts survive a restart
    assert b.stats().dropped_total == dropped
    b.ack(seqs[10], pending.dropped - 5)  # acknowledged with five fewer drops than exist now
    assert b.stats().dropped_unreported == 5 and b.stats().dropped_total == dropped
    b.close()


_CRASH = """
import sys
from pathlib import Path
from typing import Any
from edged.telemetry.buffer import TelemetryBuffer
b = TelemetryBuffer(Path(sys.argv[1]), 1 << 20)
for _ in range(50):
    seq = b.next_seq()
    b.append(seq, b'{"seq": %d}' % seq)
print("written", flush=True)
sys.stdin.read()
"""


def test_buffer_keeps_everything_committed_when_the_process_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"written"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:  # a failed assertion above must not leave the writer running
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == -signal.SIGKILL
    b = TelemetryBuffer(path, 1 << 20)
    assert [s for s, _ in b.peek(100, 1 << 20).items] == list(range(1, 51))
    b.close()


# ---- the agent -----------------------------------------------------------------------------------------
def test_agent_publishes_on_mqtt_and_windows_add_up(model_repo: Callable[..., Path],
                                                    write_config: Callable[..., Path], tmp_path: Path) -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    repo = model_repo("digits")
    mgr, svc = make_service(repo)
    cfg = load_config(write_config(repo, "[telemetry]\ninterval_s = 0.2\n"))
    with running_broker(tmp_path / "broker") as broker:
        sub = TestClient(broker.port).wait_connected()
        sub.subscribe("edged/test-device/telemetry")
        pub = mqtt.Client(CallbackAPIVersion.VERSION2)
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()

        def publish(topic: str, payload: bytes) -> None:
            pub.publish(topic, payload, qos=1)

        agent = TelemetryAgent(cfg, svc, publish=publish, profile="x86-64-test", status_interval_s=0.2)

        async def scenario() -> None:
            await agent.start()
            await asyncio.to_thread(send, svc, 9)
            await asyncio.to_thread(send_late, svc, 2)
            await wait_until_async(lambda: agent.samples_total >= 2, 30, what="two telemetry windows published")
            await asyncio.to_thread(send, svc, 6, burst=True)
            await agent.stop()  # the last window reaches the stop

        try:
            asyncio.run(scenario())
            messages = [sub.get(10)]
            messages += sub.drain(0.5)
        finally:
            pub.loop_stop()
            pub.disconnect()
            sub.close()
            mgr.shutdown()
    samples = [TelemetrySample.model_validate_json(m.payload) for m in messages]
    assert all(m.topic == "edged/test-device/telemetry" for m in messages)
    assert len(samples) == agent.samples_total >= 3
    assert [s.seq for s in samples] == list(range(1, len(samples) + 1))  # no buffer (no registry): own counter
    assert {s.run for s in samples} == {agent.run_id} and {s.profile for s in samples} == {"x86-64-test"}
    windows = [m for s in samples for m in s.models]
    assert sum(w.success for w in windows) == 15
    assert sum(w.failures.get("deadline_exceeded", 0) for w in windows) == 2
    assert sum(w.latency.count for w in windows) == 15
    assert sum(sum(w.batch_sizes[k] * k for k in w.batch_sizes) for w in windows) == 15
    assert all(s.window_s > 0 for s in samples[1:])
    assert samples[-1].system.memory_total and samples[-1].system.process_rss
    assert len(messages[0].payload) < 4096 and b"\n" not in messages[0].payload  # compact


def test_agent_writes_the_status_file_and_edged_status_reads_it(
        model_repo: Callable[..., Path], write_config: Callable[..., Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from edged import status

    repo = model_repo("digits", "mobilenet")
    mgr, svc = make_service(repo)
    cfg_path = write_config(repo, "[telemetry]\ninterval_s = 30\n")
    cfg = load_config(cfg_path)
    sync_dir = cfg.device.state_dir / "sync"
    sync_dir.mkdir(parents=True)
    (sync_dir / "state.json").write_text(json.dumps({"models": {"digits": {"current": {"version": 1, "release": 3}},
                                                                "gone": {"current": {"version": 2}}}}))
    agent = TelemetryAgent(cfg, svc, profile="x86-64-test", status_interval_s=0.1)
    args = argparse.Namespace(config=cfg_path, json=False)
    try:
        assert status.run(args) == status.EXIT_NOT_RUNNING  # no daemon yet
        assert "not running" in capsys.readouterr().out
        asyncio.run(agent.start())
        send(svc, 20)
        svc.infer_blocking(InferRequest("mobilenet", {"image": np.zeros((1, 3, 48, 192), np.float32)}))
        before = read_snapshot(agent.status_path)
        assert before is not None
        deadline = time.monotonic() + 10
        snap = before
        while snap.written_at == before.written_at or not any(m.success_total for m in snap.models):
            assert time.monotonic() < deadline, "status file not rewritten"
            time.sleep(0.05)
            snap = read_snapshot(agent.status_path)
            assert snap is not None
        by_model = {m.model: m for m in snap.models}
        assert by_model["digits"].success_total == 20 and by_model["mobilenet"].success_total == 1
        assert snap.state == "running" and snap.pid == os.getpid() and snap.profile == "x86-64-test"
        assert status.run(args) == status.EXIT_RUNNING
        out = capsys.readouterr().out
        assert "test-device: running" in out and "profile x86-64-test" in out
        assert "digits" in out and "mobilenet" in out and "onnxruntime CPU fp32" in out
        assert "v1 r3" in out and "gone" in out  # update state from the sync agent's file
        assert len(out.splitlines()) < 25  # one screen
        assert status.run(argparse.Namespace(config=cfg_path, json=True)) == status.EXIT_RUNNING
        doc = json.loads(capsys.readouterr().out)
        assert doc["running"] and doc["snapshot"]["device"] == "test-device"
    finally:
        asyncio.run(agent.stop())
        mgr.shutdown()
    stopped = read_snapshot(agent.status_path)
    assert stopped is not None and stopped.state == "stopped"
    assert status.run(args) == status.EXIT_NOT_RUNNING
    assert "stopped" in capsys.readouterr().out


def test_status_says_when_the_daemon_is_gone(write_config: Callable[..., Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from edged import status
    from edged.telemetry.snapshot import StatusSnapshot, write_snapshot

    cfg_path = write_config(tmp_path / "models")
    cfg = load_config(cfg_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    write_snapshot(cfg.device.runtime_dir / "status.json",
                   StatusSnapshot(state="running", pid=dead.pid, device="test-device", started_at=now - 100,
                                  written_at=now - 1, interval_s=10))
    assert status.run(argparse.Namespace(config=cfg_path, json=False)) == status.EXIT_NOT_RUNNING
    assert f"pid {dead.pid} is gone" in capsys.readouterr().out
    write_snapshot(cfg.device.runtime_dir / "status.json",
                   StatusSnapshot(state="running", pid=os.getpid(), device="test-device", started_at=now - 500,
                                  written_at=now - 300, interval_s=10))
    assert status.run(argparse.Namespace(config=cfg_path, json=False)) == status.EXIT_NOT_RUNNING
    assert "not responding" in capsys.readouterr().out
    (cfg.device.runtime_dir / "status.json").write_text("{not json")
    assert status.run(argparse.Namespace(config=cfg_path, json=False)) == status.EXIT_ERROR


def test_status_age_survives_a_wall_clock_step() -> None:
    """Within one boot the age comes from the monotonic clock, whatever the wall clock did."""
    from edged import status
    from edged.telemetry.snapshot import StatusSnapshot, boot_id, snapshot_age

    boot = boot_id()
    if boot is None:
        pytest.skip("no kernel boot id here")
    now, mono = time.time(), time.monotonic()
    # Written a second ago; the wall clock was then stepped back an hour (an NTP correction).
    fresh = StatusSnapshot(state="running", pid=os.getpid(), device="d", started_at=now + 3600,
                           written_at=now + 3599, written_mono=mono - 1, boot_id=boot, interval_s=10)
    assert 1 <= snapshot_age(fresh, now) < 60
    assert status.liveness(fresh, now) == ("running", True)
    # Written five minutes ago by a daemon that hangs since; the wall clock jumped forward meanwhile.
    hung = fresh.model_copy(update={"written_at": now - 1, "written_mono": mono - 300})
    assert "not responding" in status.liveness(hung, now)[0]
    # Another boot: the monotonic values mean nothing, wall time decides.
    other = hung.model_copy(update={"boot_id": "another-boot"})
    assert status.liveness(other, now) == ("running", True)


def test_agent_keeps_sampling_when_mqtt_publish_fails(model_repo: Callable[..., Path],
                                                      write_config: Callable[..., Path]) -> None:
    repo = model_repo("digits")
    mgr, svc = make_service(repo)
    cfg = load_config(write_config(repo))
    calls = threading.Event()

    def broken(topic: str, payload: bytes) -> None:
        calls.set()
        raise ConnectionError("broker away")

    metrics = MetricsRenderer(svc)
    agent = TelemetryAgent(cfg, svc, publish=broken, metrics=metrics)
    try:
        asyncio.run(agent.start())
        send(svc, 3)
        s1 = agent.sample_now()
        s2 = agent.sample_now()
        assert calls.is_set() and agent.publish_failures == 2 and agent.samples_total == 2
        assert sum(m.success for m in s1.models + s2.models) == 3
        text = families(metrics.render().decode())
        assert value(text, "edged_telemetry_publish_failures", "edged_telemetry_publish_failures_total") == 2
    finally:
        asyncio.run(agent.stop())
        mgr.shutdown()


def test_publish_returning_false_counts_as_a_failure(model_repo: Callable[..., Path],
                                                     write_config: Callable[..., Path]) -> None:
    # The daemon's publish wraps MqttTransport.publish, which returns False while the broker is away.
    repo = model_repo("digits")
    mgr, svc = make_service(repo)
    cfg = load_config(write_config(repo))
    results = [False, True, None]
    agent = TelemetryAgent(cfg, svc, publish=lambda topic, payload: results.pop(0))
    try:
        asyncio.run(agent.start())
        agent.sample_now()
        assert agent.publish_failures == 1
        assert any("not published on MQTT" in n for n in agent.status().notes)
        agent.sample_now()
        agent.sample_now()  # None (a publish that returns nothing) is taken as sent
        assert agent.publish_failures == 1 and agent.samples_total == 3
        assert not any("not published on MQTT" in n for n in agent.status().notes)
    finally:
        asyncio.run(agent.stop())
        mgr.shutdown()


def test_a_damaged_buffer_is_moved_aside_and_telemetry_goes_on(model_repo: Callable[..., Path],
                                                                write_config: Callable[..., Path]) -> None:
    repo = model_repo("digits")
    mgr, svc = make_service(repo)
    cfg = load_config(write_config(repo, '[registry]\nenabled = true\nurl = "ftp://not-http"\n'))
    agent = TelemetryAgent(cfg, svc)
    agent.buffer_path.parent.mkdir(parents=True)
    agent.buffer_path.write_bytes(b"this is not an SQLite database" * 200)
    try:
        asyncio.run(agent.start())  # neither the damaged file nor the bad registry URL stops the daemon
        assert agent.buffer is not None and agent.uploader is None
        assert [p.name.split(".corrupt-")[0] for p in agent.buffer_path.parent.glob("*.corrupt-*")] == ["buffer.db"]
        send(svc, 2)
        assert agent.sample_now().seq == 1
        assert sum(m.success for m in agent.sample_now().models) == 0
    finally:
        asyncio.run(agent.stop())
        mgr.shutdown()


def test_a_reactivated_version_starts_a_new_series_and_windows_add_up(
        model_repo: Callable[..., Path], write_config: Callable[..., Path]) -> None:
    """The over-count of issue 17: a version unloaded and loaded again (a rollback to it) carried every
    request since the daemon started into its first window. Now it is a new activation counted from zero,
    and /metrics, the status file and the windows all read the same series."""
    repo = model_repo("digits")
    mgr, svc = make_service(repo)
    cfg = load_config(write_config(repo, "[telemetry]\ninterval_s = 3600\n"))
    renderer = MetricsRenderer(svc)  # the daemon's: the agent reads the same series through it
    agent = TelemetryAgent(cfg, svc, status_interval_s=3600, metrics=renderer)

    def digits_windows(sample: TelemetrySample) -> list[Any]:
        return [m for m in sample.models if m.model == "digits"]

    def metric(name: str) -> float:
        fams = families(renderer.render().decode())  # the text format gives _created a family of its own
        return value(fams, name if name.endswith("_created") else name.removesuffix("_total"), name, **DIGITS)

    try:
        asyncio.run(agent.start())
        send(svc, 7)
        first = digits_windows(agent.sample_now())
        assert [w.success for w in first] == [7] and first[0].activation
        mgr.unload_model("digits")
        assert digits_windows(agent.sample_now()) == []
        mgr.load_model("digits", [1])  # the rollback's re-activation
        send(svc, 3)
        again = digits_windows(agent.sample_now())
        assert [w.success for w in again] == [3]  # was 10: everything since the daemon started
        assert again[0].activation != first[0].activation
        assert again[0].activated_at is not None and first[0].activated_at is not None
        assert again[0].activated_at >= first[0].activated_at
        assert metric("edged_inference_request_success_total") == 3
        assert metric("edged_inference_request_success_created") == pytest.approx(again[0].activated_at, abs=0.01)
        mgr.load_model("digits", [1])  # reloaded in place: the same activation goes on
        send(svc, 2)
        same = digits_windows(agent.sample_now())
        assert [(w.success, w.activation) for w in same] == [(2, again[0].activation)]
        status_digits = [m for m in agent.status().models if m.model == "digits"]
        assert [(m.success_total, m.activation) for m in status_digits] == [(5, again[0].activation)]
        assert metric("edged_inference_request_success_total") == 5
    finally:
        asyncio.run(agent.stop())
        mgr.shutdown()
