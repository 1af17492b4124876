"""Issue #36 attacks 3-5 against a real ``edged run``: requests that cost memory, and what they cost.

Shared by tests/transports/test_memory_budget.py (small budget, bounded) and bench/attack_memory.py
(full size, with the victim's rate and the health probe's p99 as figures). The daemon serves the
``digits`` model and two model-less pipelines (an audio decoder, an image decoder) over HTTP and
gRPC; a monitor samples its RSS all the while; a victim keeps inferring and a probe keeps asking
``/v2/health/live``, each on its own connection.
"""

from __future__ import annotations

import http.client
import io
import shutil
import struct
import subprocess
import textwrap
import threading
import time
import wave
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import psutil

from tests.conftest import EDGED, MODELS, device_config
from tests.edged_process import DaemonExitedError, engines_settled, http_ok, start_edged, wait_ready
from tests.mqtt_helpers import terminate
from tests.netutil import free_port

MIB = 1 << 20

AUDIO_PIPELINE = """
[[inputs]]
name = "audio"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "lengths"
datatype = "INT32"
shape = [-1]

[[steps]]
name = "decode"
kind = "decode_audio"
inputs = { audio = "audio" }
outputs = { samples = "samples", lengths = "lengths" }
params = { rate = 16000, max_seconds = 30 }
"""

IMAGE_PIPELINE = """
[[inputs]]
name = "image"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "sizes"
datatype = "INT32"
shape = [-1, 2]

[[steps]]
name = "decode"
kind = "decode_image"
inputs = { image = "image" }
outputs = { pixels = "pixels", sizes = "sizes", transform = "transform" }
params = { color = "RGB" }
"""


def repository(root: Path) -> Path:
    """digits and the two decoder pipelines."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(MODELS / "digits", root / "digits")
    for name, text in (("audio_len", AUDIO_PIPELINE), ("image_size", IMAGE_PIPELINE)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "pipeline.toml").write_text(text)
    return root


@dataclass
class MemDaemon:
    proc: subprocess.Popen[bytes]
    port: int
    grpc_port: int
    log: Path
    memory_mb: float

    @property
    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)


@contextmanager
def daemon(tmp: Path, memory_mb: float | None, *, grpc_max_mb: float = 64, mqtt_url: str | None = None,
           extra: str = "", settled: bool = True, edged: Sequence[str] = EDGED) -> Iterator[MemDaemon]:
    """``edged run`` on loopback; ``memory_mb`` None leaves [limits] out (the profile's share).

    ``settled`` False: serving is enough, the background engine choice may still be measuring (for a
    test that reads no RSS figure: waiting for it is most of a start); ``edged``: the command that is edged
    (tests.edged_process.QUICK_CHOICE_EDGED: that choice measures briefly).
    """
    repo = repository(tmp / "models")
    mqtt = f'url = "{mqtt_url}"' if mqtt_url else "enabled = false"
    for attempt in range(3):  # a port found free may be taken by another process before the daemon binds it
        d = _start(tmp, repo, memory_mb, grpc_max_mb, f"[mqtt]\n{mqtt}\n{extra}", settled, edged)
        if d is not None:
            break
        assert attempt < 2, "no free ports for edged run"
    try:
        yield d
    finally:
        terminate(d.proc, 30)


def _start(tmp: Path, repo: Path, memory_mb: float | None, grpc_max_mb: float, extra: str,
           settled: bool = True, edged: Sequence[str] = EDGED) -> MemDaemon | None:
    port, gport = free_port(), free_port()
    limits = f"[limits]\nmemory_mb = {memory_mb}\n" if memory_mb is not None else ""
    cfg = device_config(tmp, repo, textwrap.dedent(f"""
        [http]
        listen = "127.0.0.1:{port}"
        max_request_mb = 256
        [grpc]
        listen = "127.0.0.1:{gport}"
        max_message_mb = {grpc_max_mb}
        [shm]
        enabled = false
        [telemetry]
        enabled = false
        [logging]
        level = "warning"
        """) + limits + textwrap.dedent(extra), device_id="mem-attack")
    log = tmp / "edged.log"
    proc = start_edged(cfg, log, edged=edged)
    try:
        # Done choosing digits' engine too: candidates loaded to be measured would count in the RSS figures.
        wait_ready(proc, log, lambda: http_ok(port, "/v2/models/image_size/ready")
                   and (engines_settled(port, "digits") if settled else http_ok(port, "/v2/models/digits/ready")),
                   timeout=120, transient=(OSError,))
    except DaemonExitedError as e:
        if "cannot listen" in e.log:
            return None
        raise
    except BaseException:
        terminate(proc, 30)
        raise
    return MemDaemon(proc, port, gport, log, memory_mb or 0)


# ---- measuring --------------------------------------------------------------------------------
def peak_rss(pid: int) -> int:
    """The kernel's high-water mark of the process's RSS (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def reset_peak_rss(pid: int) -> bool:
    """Reset that mark to the RSS now (``clear_refs`` 5), so that a peak is what follows; False where the
    kernel refuses (the mark then keeps whatever came before)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class RssMonitor:
    """The daemon's RSS sampled every few milliseconds, and its kernel high-water mark (VmHWM)
    reset at the start where the kernel lets us (``clear_refs`` 5), which counts even a transient peak."""

    def __init__(self, pid: int, interval: float = 0.003) -> None:
        self.proc = psutil.Process(pid)
        self.pid = pid
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self.hwm_reset = False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(int(self.proc.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssMonitor:
        self.hwm_reset = reset_peak_rss(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def peak(self) -> int:
        sampled = max(self.samples, default=0)
        return max(sampled, peak_rss(self.pid)) if self.hwm_reset else sampled


@dataclass
class Victim:
    """A well-behaved client: digits inferences on one keep-alive connection, and a health probe on another."""

    port: int
    answered: int = 0
    failed: list[str] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._infer, daemon=True),
                         threading.Thread(target=self._probe, daemon=True)]
        x = np.zeros((1, 64), np.float32)
        self._body = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                               "data": x.ravel().tolist()}]})

    def _infer(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            try:
                c.request("POST", "/v2/models/digits/infer", self._body, {"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                if r.status == 200:
                    self.answered += 1
                else:
                    self.failed.append(f"status {r.status}")
            except OSError as e:
                self.failed.append(repr(e))
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def _probe(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                c.request("GET", "/v2/health/live")
                r = c.getresponse()
                r.read()
            except OSError as e:
                self.failed.append(f"health: {e!r}")
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                continue
            self.health.append(time.monotonic() - t0)
            self._stop.wait(0.005)

    def __enter__(self) -> Victim:
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.seconds = time.monotonic() - self._t0

    @property
    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    @property
    def health_p99_ms(self) -> float:
        return float(np.percentile(self.health, 99) * 1000) if self.health else float("nan")


def settle(d: MemDaemon, target: int, within: float = 10.0) -> int:
    """RSS once it is back under ``target`` (or the last reading after ``within`` seconds)."""
    end = time.monotonic() + within
    while True:
        rss = d.rss
        if rss <= target or time.monotonic() > end:
            return rss
        time.sleep(0.1)


def idle_rss(d: MemDaemon) -> int:
    """RSS after a warm-up request on each path (first requests load code and grow pools once)."""
    post_v2(d.port, "audio_len", [wav(100)])
    post_v2(d.port, "image_size", [flat_png(64, 64)])
    grpc_infer(d.grpc_port, 1024)
    time.sleep(0.5)  # sleep-ok: the warm-up's passing allocations are handed back; RSS shows no end
    return d.rss


# ---- the attacks -------------------------------------------------------------------------------
def wav(samples: int, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * samples)
    return buf.getvalue()


def flat_png(width: int, height: int) -> bytes:
    """A valid all-black RGB PNG: a few KB of zlib for width x height pixels."""
    row = b"\0" + b"\0" * (3 * width)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def v2_bytes_body(input_name: str, items: list[bytes]) -> tuple[bytes, int]:
    """A binary-extension v2 body with one BYTES input of ``items``."""
    data = b"".join(struct.pack("<I", len(x)) + x for x in items)
    header = orjson.dumps({"inputs": [{"name": input_name, "datatype": "BYTES", "shape": [len(items)],
                                       "parameters": {"binary_data_size": len(data)}}]})
    return header + data, len(header)


def post(port: int, path: str, body: bytes | Iterable[bytes], headers: dict[str, str], timeout: float = 120, *,
         chunked: bool = False) -> int:
    """The response's status, -1 when the connection failed; ``chunked``: send ``body`` chunk-encoded."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body, headers, encode_chunked=chunked)
        r = c.getresponse()
        r.read()
        return r.status
    except OSError:
        return -1
    finally:
        c.close()


def post_v2(port: int, model: str, items: list[bytes]) -> int:
    name = "audio" if model == "audio_len" else "image"
    body, hlen = v2_bytes_body(name, items)
    return post(port, f"/v2/models/{model}/infer", body,
                {"Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"})


def concurrently(n: int, fn: Callable[[], int]) -> list[int]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def audio_bomb(d: MemDaemon, short_clips: int, concurrency: int = 1) -> list[int]:
    """Attack 3: one 30 s clip and ``short_clips`` one-sample clips, padded to the longest."""
    items = [wav(30 * 16000)] + [wav(1)] * short_clips
    return concurrently(concurrency, lambda: post_v2(d.port, "audio_len", items))


def image_flood(d: MemDaemon, side: int, per_request: int = 2, concurrency: int = 12) -> list[int]:
    """Attack 4: flat PNGs within the per-request pixel budget, many requests at once."""
    items = [flat_png(side, side)] * per_request
    return concurrently(concurrency, lambda: post_v2(d.port, "image_size", items))


def http_flood(d: MemDaemon, mib: float, concurrency: int = 16) -> list[int]:
    """Attack 5 over HTTP: large binary bodies at once (the tensor's shape is wrong: refused after decoding)."""
    body, hlen = _big_binary(mib)
    return concurrently(concurrency, lambda: post(
        d.port, "/v2/models/digits/infer", body,
        {"Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"}))


def _big_binary(mib: float) -> tuple[bytes, int]:
    n = int(mib * MIB) // 4
    header = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [n // 64, 64],
                                       "parameters": {"binary_data_size": (n // 64) * 64 * 4}}]})
    return header + bytes((n // 64) * 64 * 4), len(header)


def grpc_infer(port: int, nbytes: int, timeout: float = 120) -> str:
    """One ModelInfer of ``nbytes`` of raw FP32 data for digits; the status code's name."""
    import grpc

    from edged.protocol.grpc.gen import grpc_service_pb2 as pb
    rows = max(1, nbytes // 256)
    req = pb.ModelInferRequest(model_name="digits", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="pixels", datatype="FP32", shape=[rows, 64])], raw_input_contents=[bytes(rows * 256)])
    limit = 2047 * MIB
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", limit),
                                                             ("grpc.max_receive_message_length", limit)]) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=lambda b: b)
        try:
            call(req, timeout=timeout)
            return "OK"
        except grpc.RpcError as e:
            return str(e.code().name)


def grpc_flood(d: MemDaemon, mib: float, concurrency: int = 16) -> list[str]:
    """Attack 5: concurrent large gRPC messages (digits with a wrong batch: refused once decoded)."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: grpc_infer(d.grpc_port, int(mib * MIB)), range(concurrency)))
