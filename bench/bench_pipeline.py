"""Pipelines: image libraries, the built-in steps against the same work by hand, and the daemon.

    .venv/bin/python bench/bench_pipeline.py [--seconds 4] [--no-daemon]

One run, on the same inputs and the same machine:
  1. JPEG 640x480 decode + resize to 224x224 per library that is installed (Pillow, Pillow with
     JPEG draft scaling, OpenCV, simplejpeg + OpenCV's resize, PyTurboJPEG + OpenCV's resize when
     libturbojpeg loads): the measurement behind the choice of OpenCV (docs/pipelines.md);
  2. the orientation_classify and layout_detect example pipelines (models/) run step by step in
     this process, against the same work written by hand (cv2 + numpy + an ONNX Runtime session):
     what the step abstraction costs;
  3. orientation_classify through the graph runtime in this process (no transport), c1 and c8;
  4. ``edged run`` (device profile ``generic``: ONNX Runtime on the CPU, as the hand chain) serving
     the pipeline, over HTTP (tritonclient, a BYTES input), shm (the native client, a BYTES tensor)
     and MQTT (the raw JPEG, a JSON answer; mosquitto started here): at concurrency 1 against hand
     chain + that transport's overhead for the plain model measured in the same run (the call of
     ``orientation`` with its tensor minus the in-process session; goal: ratio <= 1.1), and at
     concurrency 8 against the hand chain's batch-1 throughput (goal >= 1);
  5. the ``ocr`` example (built-in steps only) against RapidOCR's own call (rapidocr-onnxruntime 1.4.4
     from the test cache, its default configuration) on the ten documents of
     tests/device/pipeline/documents.py: lines equal ignoring spaces (goal >= 95%) and exactly (>= 85%),
     the boxes' IoU (>= 0.9), and the time per image over HTTP (the raw image body) and shm (the
     native client) against RapidOCR's in this process (goal <= 0.5 on the engine edged chooses,
     <= 0.9 on ONNX Runtime alone: ``edged run`` on its own profile, then on ``generic``), each
     document's cases timed in alternating rounds (``--ocr-rounds``); ``--ocr-only`` runs just this.
Needs the example models: it fetches them like tools/fetch_example_models.py (into a temporary
repository). Prints the load average before and after; ratios only compare figures of this run.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_http import start_daemon  # noqa: E402
from bench.common import Result, measure, ratio_line, stop_process  # noqa: E402
from tests.device.pipeline.examples import model_file, run_pipeline, session  # noqa: E402
from tests.netutil import free_port  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def photo_jpeg(width: int = 640, height: int = 480) -> bytes:
    """A photo-like 640x480 JPEG (smooth gradients and sensor-like noise, quality 90)."""
    import cv2

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([(x * 0.4 + y * 0.1) % 256, (y * 0.5) % 256, (x * 0.2 + y * 0.3) % 256], -1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return bytes(buf)


def libraries(data: bytes) -> dict[str, Callable[[], object]]:
    """decode + resize to 224x224 RGB, per installed library."""
    import cv2

    cv2.setNumThreads(1)
    cases: dict[str, Callable[[], object]] = {}

    def opencv() -> object:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        return cv2.cvtColor(cv2.resize(img, (224, 224), interpolation=cv2.INTER_LINEAR), cv2.COLOR_BGR2RGB)

    cases["opencv-python-headless " + cv2.__version__] = opencv
    try:
        import PIL
        from PIL import Image

        def pillow() -> object:
            im = Image.open(io.BytesIO(data)).convert("RGB")
            return np.asarray(im.resize((224, 224), Image.Resampling.BILINEAR))

        def pillow_draft() -> object:
            im = Image.open(io.BytesIO(data))
            im.draft("RGB", (224, 224))  # the JPEG decoder scales by 1/2, 1/4, 1/8 while decoding
            return np.asarray(im.convert("RGB").resize((224, 224), Image.Resampling.BILINEAR))

        cases[f"Pillow {PIL.__version__}"] = pillow
        cases[f"Pillow {PIL.__version__} + draft"] = pillow_draft
    except ImportError:
        print("Pillow: not installed")
    try:
        import simplejpeg

        def sj() -> object:
            return cv2.resize(simplejpeg.decode_jpeg(data, colorspace="RGB"), (224, 224),
                              interpolation=cv2.INTER_LINEAR)

        cases[f"simplejpeg {simplejpeg.__version__} + cv2.resize"] = sj
    except ImportError:
        print("simplejpeg: not installed")
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        tj = TurboJPEG()

        def turbo() -> object:
            return cv2.resize(tj.decode(data, pixel_format=TJPF_RGB), (224, 224), interpolation=cv2.INTER_LINEAR)

        cases["PyTurboJPEG + cv2.resize"] = turbo
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"PyTurboJPEG: unavailable ({str(exc).splitlines()[0][:100]})")
    return cases


def hand_orientation(data: bytes) -> np.ndarray:
    """orientation_classify written by hand: the same operations, no step objects."""
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = img.shape[:2]
    r = 256 / min(h, w)
    img = cv2.resize(img, (round(w * r), round(h * r)), interpolation=cv2.INTER_LANCZOS4)
    h, w = img.shape[:2]
    top, left = (h - 224) // 2, (w - 224) // 2
    x = ((img[top:top + 224, left:left + 224].astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)[None]
    probs = session("orientation").run(None, {"x": np.ascontiguousarray(x)})[0]
    return np.argsort(-probs, axis=1)[:, :4]


def hand_layout(data: bytes) -> np.ndarray:
    """layout_detect written by hand up to the raw model outputs, then the same decoding and NMS
    (numpy, as rapid-layout does it) without step objects: decode, resize, normalize, engine, NMS."""
    import cv2

    from edged.pipeline.steps.detect import DetectDecode

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    x = ((cv2.resize(img, (608, 800)).astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)[None]
    outs = session("layout").run(None, {"image": np.ascontiguousarray(x)})
    global _DECODER
    if _DECODER is None:
        _DECODER = DetectDecode({"layout": "picodet", "input_size": [800, 608], "score_threshold": 0.5,
                                 "iou_threshold": 0.5, "multi_label": True, "candidates_per_class": 200,
                                 "max_per_class": 100}, ROOT)
    h, w = img.shape[:2]
    feeds = {f"scores_{i}": outs[i] for i in range(4)} | {f"boxes_{i}": outs[4 + i] for i in range(4)}
    feeds["transform"] = np.array([[608 / w, 800 / h, 0, 0]], np.float32)
    return _DECODER.run(feeds)["boxes"]


_DECODER: Any = None


def interleaved(cases: dict[str, Callable[[], object]], seconds: float, block: float = 0.25) -> dict[str, Result]:
    """The cases timed in alternating short blocks, so that load from other processes falls on all
    of them alike; each one's median and throughput over all its blocks."""
    for fn in cases.values():
        for _ in range(3):
            fn()
    lat: dict[str, list[float]] = {k: [] for k in cases}
    spent: dict[str, float] = dict.fromkeys(cases, 0.0)
    stop = time.monotonic() + seconds * len(cases)
    while time.monotonic() < stop:
        for name, fn in cases.items():
            end = time.monotonic() + block
            t_block = time.perf_counter()
            while time.monotonic() < end:
                t0 = time.perf_counter()
                fn()
                lat[name].append(time.perf_counter() - t0)
            spent[name] += time.perf_counter() - t_block
    out = {}
    for name, xs in lat.items():
        xs.sort()
        p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        out[name] = Result(name, len(xs) / spent[name], xs[len(xs) // 2] * 1e3, p99 * 1e3)
    return out


def one(data: bytes) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = data
    return out


def show(r: Result) -> Result:
    print("  " + r.row())
    return r


def graph_part(tmp: Path, data: bytes, seconds: float) -> None:
    """orientation_classify through the daemon's graph runtime (edged.pipeline.graph, model steps
    through the InferenceService and the model's dynamic batcher), in this process, no transport."""
    import asyncio

    from edged.pipeline.definition import load_pipeline
    from edged.pipeline.graph import CallContext, compile_pipeline
    from tests.http_helpers import served

    repo = tmp / "graph-models"
    shutil.copytree(ROOT / "models" / "orientation", repo / "orientation", ignore=shutil.ignore_patterns("model.onnx"))
    shutil.copyfile(model_file("orientation"), repo / "orientation" / "1" / "model.onnx")
    folder = ROOT / "models" / "orientation_classify" / "1"
    with served(repo, tmp / "graph-state") as s:
        pipeline = compile_pipeline(load_pipeline(folder), folder, s.service.manager.gateway)
        request = {"image": one(data)}

        context = CallContext(models=s.service)

        def call() -> object:
            return asyncio.run_coroutine_threadsafe(pipeline.run(request, context), s.loop).result(60)

        res = interleaved({"graph runtime, c=1": call, "by hand, c=1": lambda: hand_orientation(data)}, seconds)
        c1, hand_now = show(res["graph runtime, c=1"]), show(res["by hand, c=1"])
        c8 = show(measure("graph runtime, c=8", call, seconds=seconds, concurrency=8))
        print("  " + ratio_line("graph c1 median / hand chain median", c1.median_ms, hand_now.median_ms, 1.1,
                                higher_is_better=False))
        print("  " + ratio_line("graph c8 throughput / hand chain batch-1 throughput", c8.throughput,
                                hand_now.throughput, 1.0))


def daemon_config(tmp: Path, repo: Path, port: int, broker_url: str) -> Path:
    """``edged run`` on the generic profile (ONNX Runtime on the CPU, as the hand chain) with HTTP, shm, MQTT."""
    cfg_path = tmp / "edged.toml"
    cfg_path.write_text(f"""
[device]
id = "bench"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{repo}"
profile = "generic"
[http]
listen = "127.0.0.1:{port}"
[mqtt]
url = "{broker_url}"
[telemetry]
enabled = false
[logging]
level = "warning"
""")
    return cfg_path


class PerThread:
    """One client per calling thread (tritonclient.http runs on gevent; a shm client serializes its calls)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.local, self.made = make, threading.local(), []  # type: ignore[var-annotated]

    def __call__(self) -> Any:
        if not hasattr(self.local, "c"):
            self.local.c = self.make()
            self.made.append(self.local.c)
        return self.local.c

    def close(self) -> None:
        for c in self.made:
            c.close()


def daemon_part(tmp: Path, data: bytes, seconds: float) -> None:
    """The pipeline through the running daemon on each transport, against hand chain + that transport's
    own overhead for the plain model (c=1), and against the hand chain's batch-1 throughput (c=8)."""
    import tritonclient.http as th

    from edged.client.mqtt import MqttClient
    from edged.client.shm import ShmClient
    from edged.config import load_config
    from tests.mqtt_helpers import Broker

    repo = tmp / "models"
    for name in ("orientation", "orientation_classify"):
        shutil.copytree(ROOT / "models" / name, repo / name, ignore=shutil.ignore_patterns("model.onnx"))
    shutil.copyfile(model_file("orientation"), repo / "orientation" / "1" / "model.onnx")
    broker = Broker(tmp / "broker").start()
    port = free_port()
    cfg_path = daemon_config(tmp, repo, port, broker.url)
    url = f"127.0.0.1:{port}"
    proc = start_daemon(cfg_path, url, False, model="orientation_classify")
    socket_path = str(load_config(cfg_path).shm_socket)
    http = PerThread(lambda: th.InferenceServerClient(url))
    shm = PerThread(lambda: ShmClient(socket_path))
    mqtt = MqttClient(broker.url, "bench")
    try:
        x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)

        def plain_http() -> object:
            inp = th.InferInput("x", [1, 3, 224, 224], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            return http().infer("orientation", [inp]).as_numpy("fetch_name_0")

        def pipeline_http() -> object:
            inp = th.InferInput("image", [1], "BYTES")
            inp.set_data_from_numpy(one(data), binary_data=True)
            return http().infer("orientation_classify", [inp]).as_numpy("labels")

        transports: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "HTTP (tritonclient, binary)": (plain_http, pipeline_http),
            "shm (native client)": (lambda: shm().infer("orientation", {"x": x}),
                                    lambda: shm().infer("orientation_classify", {"image": one(data)})),
            "MQTT (plain: v2 binary; pipeline: the raw JPEG)": (
                lambda: mqtt.infer("orientation", {"x": x}),
                lambda: mqtt.infer_media("orientation_classify", data)),
        }
        direct_plain = lambda: session("orientation").run(None, {"x": x})  # noqa: E731
        by_hand = lambda: hand_orientation(data)  # noqa: E731
        for t, (plain_fn, pipe_fn) in transports.items():
            short = t.split(" (")[0]
            print(f"{t}: the hand chain, the plain model in process and over {short}, and the pipeline over "
                  f"{short}, timed in alternating blocks:")
            res = interleaved({"hand chain, batch 1": by_hand, "plain model, in process": direct_plain,
                               f"plain model over {short}": plain_fn, f"pipeline over {short}, c=1": pipe_fn},
                              seconds)
            hand_now, direct, plain, c1 = (show(r) for r in res.values())
            overhead = plain.median_ms - direct.median_ms
            print(f"    {short} overhead for the plain model: {overhead:.3f} ms")
            print("  " + ratio_line(f"{short}: c1 median / (hand + overhead)", c1.median_ms,
                                    hand_now.median_ms + overhead, 1.1, higher_is_better=False))
            # c8 between two hand-chain runs: the reference is their mean, measured around it
            h1 = measure("hand chain, batch 1", by_hand, seconds=seconds / 2)
            c8 = show(measure(f"pipeline over {short}, c=8", pipe_fn, seconds=seconds, concurrency=8))
            h2 = measure("hand chain, batch 1", by_hand, seconds=seconds / 2)
            hand_tp = (h1.throughput + h2.throughput) / 2
            print(f"    hand chain around it: {h1.throughput:.1f}/s and {h2.throughput:.1f}/s")
            print("  " + ratio_line(f"{short}: c8 throughput / hand batch-1", c8.throughput, hand_tp, 1.0))
    finally:
        http.close()
        shm.close()
        mqtt.close()
        stop_process(proc)
        broker.stop()


def quad_iou(a: Any, b: Any) -> float:
    """Intersection over union of two convex quadrilaterals ([4, 2])."""
    import cv2
    pa, pb = np.asarray(a, np.float32), np.asarray(b, np.float32)
    inter, _ = cv2.intersectConvexConvex(pa, pb)
    union = abs(cv2.contourArea(pa)) + abs(cv2.contourArea(pb)) - inter
    return float(inter / union) if union > 0 else 1.0


def ocr_quality(got: list[dict[str, Any]], want: list[Any]) -> tuple[int, int, int, list[float]]:
    """(reference lines, equal ignoring spaces, equal exactly, IoU of each reference box with its line's)."""
    same_ns = same = 0
    ious = []
    for w in want:
        best = max(got, key=lambda g: quad_iou(g["box"], w[0]), default=None)
        if best is None:
            ious.append(0.0)
            continue
        ious.append(quad_iou(best["box"], w[0]))
        same += best["text"] == w[1]
        same_ns += best["text"].replace(" ", "") == w[1].replace(" ", "")
    return len(want), same_ns, same, ious


def ocr_daemon(tmp: Path, repo: Path, profile: str | None, pool: str = "per_model") -> tuple[Any, str, str]:
    """``edged run`` serving the ocr example (``profile`` None: the one it picks), once ocr is ready."""
    import subprocess

    from edged.client.http import HttpClient
    from edged.config import load_config
    port = free_port()
    state = tmp / f"state-{profile or 'auto'}"
    cfg = tmp / f"edged-{profile or 'auto'}.toml"
    cfg.write_text(f"""
[device]
id = "bench"
state_dir = "{state}"
runtime_dir = "{state / 'run'}"
model_repository = "{repo}"
{f'profile = "{profile}"' if profile else ''}
[http]
listen = "127.0.0.1:{port}"
[mqtt]
enabled = false
[telemetry]
enabled = false
[limits]
engine_pool = "{pool}"
[logging]
level = "warning"
""")
    proc = subprocess.Popen([sys.executable, "-m", "edged", "run", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    client = HttpClient(f"127.0.0.1:{port}", timeout=5)
    deadline = time.monotonic() + 900  # engine selection measures each model's candidates first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"edged run exited with {proc.returncode}:\n{err[-3000:]}")
        try:
            if client.ready("ocr"):
                break
        except Exception:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise SystemExit("edged run did not serve ocr within 900 s")
    engines = []
    for model in ("ocr_det", "ocr_cls", "ocr_rec"):
        params = client.metadata(model).get("parameters", {})
        engines.append(f"{model} {params.get('backend')}/{params.get('precision')}")
    client.close()
    return proc, f"127.0.0.1:{port}", str(load_config(cfg).shm_socket) + " | " + ", ".join(engines)


def ocr_part(tmp: Path, rounds: int, names: list[str], pool: str = "per_model") -> None:
    """The ocr example over HTTP and shm against RapidOCR's own call: the same lines, and time per image."""
    from edged.client.shm import ShmClient
    from tests.device.pipeline.documents import documents
    from tests.device.pipeline.rapidocr_ref import rapidocr

    repo = tmp / "ocr-models"
    for name in ("ocr_det", "ocr_cls", "ocr_rec", "ocr"):
        shutil.copytree(ROOT / "models" / name, repo / name, ignore=shutil.ignore_patterns("model.onnx"))
        if name != "ocr":
            shutil.copyfile(model_file(name), repo / name / "1" / "model.onnx")
    reference = rapidocr()
    docs = {k: v for k, v in documents().items() if not names or k in names}
    for profile, goal in ((None, 0.5), ("generic", 0.9)):
        proc, url, info = ocr_daemon(tmp, repo, profile, pool)
        socket_path, engines = info.split(" | ")
        shm = ShmClient(socket_path)
        label = "the engines edged chose" if profile is None else "ONNX Runtime alone (profile generic)"
        print(f"  {label}: {engines}")
        try:
            ocr_round(url, shm, reference, docs, rounds=rounds, goal=goal)
            if profile is None:
                ocr_shared_batches(url, documents()["receipt"])
        finally:
            shm.close()
            stop_process(proc)


def ocr_shared_batches(url: str, data: bytes, clients: int = 8) -> None:
    """``clients`` concurrent OCR requests of one receipt: the recognizer's batch sizes from its statistics."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from edged.client.http import HttpClient

    def batches() -> dict[int, int]:
        with HttpClient(url, timeout=30) as c:
            stats = c.statistics("ocr_rec")[0]
        return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}

    def post(_: int) -> None:
        req = urllib.request.Request(f"http://{url}/v2/models/ocr/infer", data=data, method="POST",
                                     headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    before = batches()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(post, range(clients)))
    took = time.perf_counter() - t0
    after = batches()
    runs = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) > before.get(k, 0)}
    rows = sum(k * v for k, v in runs.items())
    print(f"    {clients} concurrent requests of the receipt in {took * 1e3:.0f} ms: recognizer runs by batch "
          f"size {dict(sorted(runs.items()))}, {rows} rows in {sum(runs.values())} runs "
          f"({rows / max(sum(runs.values()), 1):.1f} rows per run)")


def ocr_round(url: str, shm: Any, reference: Any, docs: dict[str, bytes], *, rounds: int, goal: float) -> None:
    """Every document through RapidOCR, HTTP (the raw image body) and shm, in alternating rounds."""
    import json
    import urllib.request

    def over_http(data: bytes) -> list[dict[str, Any]]:
        kind = "image/png" if data[:4] == b"\x89PNG" else "image/jpeg"
        req = urllib.request.Request(f"http://{url}/v2/models/ocr/infer", data=data, method="POST",
                                     headers={"Content-Type": kind})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["outputs"]["lines"][0]  # type: ignore[no-any-return]

    def over_shm(data: bytes) -> list[dict[str, Any]]:
        return json.loads(shm.infer("ocr", {"image": one(data)})["lines"][0])  # type: ignore[no-any-return]

    totals = {"RapidOCR": 0.0, "HTTP": 0.0, "shm": 0.0}
    lines = same_ns = same = 0
    ious: list[float] = []
    for name, data in docs.items():
        times: dict[str, list[float]] = {k: [] for k in totals}
        fns: dict[str, Callable[[], Any]] = {"RapidOCR": lambda d=data: reference(d),  # type: ignore[misc]
                                             "HTTP": lambda d=data: over_http(d),  # type: ignore[misc]
                                             "shm": lambda d=data: over_shm(d)}  # type: ignore[misc]
        answers = {k: fn() for k, fn in fns.items()}  # warm-up, and the answers compared
        order = list(fns)
        for r in range(rounds):
            # Each case first, second and last in turn: the one timed just after RapidOCR ran while its
            # engine pools (this process's, the library's ~24 ms spin) still held the cores.
            for k in order[r % len(order):] + order[:r % len(order)]:
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        for k in totals:
            totals[k] += med[k]
        want = answers["RapidOCR"][0] or []
        n, ns, ex, iou = ocr_quality(answers["HTTP"], want)
        if answers["shm"] != answers["HTTP"]:
            print(f"    {name}: the shm and HTTP answers differ")
        lines, same_ns, same = lines + n, same_ns + ns, same + ex
        ious += iou
        print(f"    {name:<13} {n:3d} lines, {ns:3d} equal ignoring spaces, {ex:3d} exactly, min IoU "
              f"{min(iou, default=1.0):.3f}; median ms: RapidOCR {med['RapidOCR']:.0f}, "
              f"HTTP {med['HTTP']:.0f}, shm {med['shm']:.0f}")
    print(f"    lines: {same_ns}/{lines} equal ignoring spaces ({100 * same_ns / max(lines, 1):.1f}%, "
          f"goal >= 95%), {same}/{lines} exactly ({100 * same / max(lines, 1):.1f}%, goal >= 85%), "
          f"box IoU min {min(ious, default=1.0):.3f} mean {float(np.mean(ious)) if ious else 1.0:.3f} (goal >= 0.9)")
    for k in ("HTTP", "shm"):
        print("  " + ratio_line(f"{k}: time per image / RapidOCR's", totals[k], totals["RapidOCR"], goal,
                                higher_is_better=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring time per case")
    ap.add_argument("--no-daemon", action="store_true", help="skip the daemon parts")
    ap.add_argument("--ocr-only", action="store_true", help="only part 5 (the ocr example against RapidOCR)")
    ap.add_argument("--ocr-rounds", type=int, default=3, help="alternating rounds per document in part 5")
    ap.add_argument("--ocr-docs", default="", help="comma-separated documents for part 5 (default: all ten)")
    ap.add_argument("--engine-pool", choices=("per_model", "shared"), default="per_model",
                    help="the daemons' [limits] engine_pool in part 5")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}; {os.cpu_count()} CPUs")
    if args.ocr_only:
        tmp = Path(tempfile.mkdtemp(prefix="edged-bench-ocr-"))
        try:
            ocr_part(tmp, args.ocr_rounds, [d for d in args.ocr_docs.split(",") if d], args.engine_pool)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"load average after: {os.getloadavg()}")
        return 0
    data = photo_jpeg()
    print(f"1. JPEG 640x480 ({len(data)} bytes) decode + resize to 224x224 RGB, one thread:")
    for r in interleaved(libraries(data), args.seconds / 2).values():
        show(r)

    print("2. example pipelines in this process: built-in steps against the same work by hand")
    datas = {"orientation_classify": data}
    page = ROOT / "docs" / "img" / "page.jpg"
    datas["layout_detect"] = page.read_bytes() if page.is_file() else photo_jpeg(760, 1000)
    hand_fns: dict[str, Callable[[bytes], object]] = {"orientation_classify": hand_orientation,
                                                      "layout_detect": hand_layout}
    hands: dict[str, Result] = {}
    for name, d in datas.items():
        by_hand, by_steps = f"{name}: by hand", f"{name}: built-in steps"
        res = interleaved({by_hand: lambda d=d, name=name: hand_fns[name](d),  # type: ignore[misc]
                           by_steps: lambda d=d, name=name: run_pipeline(name, {"image": one(d)})},  # type: ignore[misc]
                          args.seconds)
        hands[name] = show(res[by_hand])
        show(res[by_steps])
        print("  " + ratio_line(f"{name} steps / by hand (median)", res[by_steps].median_ms, hands[name].median_ms,
                                1.1, higher_is_better=False))
    print("3. orientation_classify through the pipeline graph runtime, in this process (no transport)")
    tmp = Path(tempfile.mkdtemp(prefix="edged-bench-pipeline-"))
    try:
        graph_part(tmp, data, args.seconds)
        if not args.no_daemon:
            print("4. the daemon")
            daemon_part(tmp, data, args.seconds)
            print("5. the ocr example against RapidOCR")
            ocr_part(tmp, args.ocr_rounds, [d for d in args.ocr_docs.split(",") if d], args.engine_pool)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
