"""Images to the served example pipelines over MQTT (the raw JPEG via mosquitto_pub/mosquitto_sub, answered
as JSON) and the native shm client (a BYTES tensor in shared memory).

The detection answer must match rapid-layout's own API on the same JPEG (IoU >= 0.99, same labels);
a corrupt JPEG gets an error reply naming the input and the next request is served.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.config import parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode
from edged.protocol.media import CONTENT_TYPE_PROPERTY
from edged.transports.mqtt.transport import MqttTransport
from tests.conftest import EDGED
from tests.device.pipeline.examples import UnavailableError, run_pipeline, wheel
from tests.device.pipeline.test_serve import _jpeg, _page, example_repo
from tests.http_helpers import ORT
from tests.mqtt_helpers import Broker, TestClient, mosquitto_sub

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceService]:
    repo = example_repo(tmp_path_factory.mktemp("repo") / "models")
    cfg = parse_config("[device]\nid = \"dev\"\n")
    manager = ModelManager(repo, cfg.models, ORT)
    manager.load_all()
    yield InferenceService(manager)
    manager.shutdown()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture
def mqtt(broker: Broker, service: InferenceService) -> Iterator[MqttTransport]:
    cfg = parse_config(f'[device]\nid = "dev"\n[mqtt]\nurl = "{broker.url}"\n')
    t = MqttTransport(cfg, service, "test-profile")
    asyncio.run(t.start())
    assert t.wait_ready(10)
    yield t
    asyncio.run(t.stop())


@pytest.fixture(scope="module")
def rapid_layout() -> Any:
    mp = pytest.MonkeyPatch()
    try:
        mp.syspath_prepend(str(wheel("layout")))
    except UnavailableError as exc:
        pytest.skip(str(exc))
    from rapid_layout import RapidLayout
    yield RapidLayout()
    mp.undo()


def iou(a: np.ndarray, b: np.ndarray) -> float:
    lt, rb = np.maximum(a[:2], b[:2]), np.minimum(a[2:], b[2:])
    inter = float(np.clip(rb - lt, 0, None).prod())
    union = float((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod()) - inter
    return inter / union if union > 0 else 0.0


def assert_matches_reference(regions: list[dict[str, Any]], ref: Any) -> None:
    """Every region rapid-layout finds is in the answer with the same label and IoU >= 0.99."""
    assert len(regions) == len(ref.boxes)
    for label, box in zip(ref.class_names, np.asarray(ref.boxes, dtype=np.float64), strict=True):
        best = max(regions, key=lambda r: iou(np.asarray(r["box"], np.float64), box))
        assert iou(np.asarray(best["box"], np.float64), box) >= 0.99 and best["label"] == label, (label, box, best)


def _pub(port: int, topic: str, path: Path, corr: str, *extra: str) -> None:
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(port), "-t", topic,
                    "-D", "publish", "response-topic", "edged/dev/reply/raw", "-D", "publish", "correlation-data", corr,
                    *extra, "-f", str(path)], check=True)


def test_mosquitto_pub_raw_jpeg_detection_matches_rapid_layout(
        broker: Broker, mqtt: MqttTransport, rapid_layout: Any, tmp_path: Path) -> None:
    data = _jpeg(_page(0))
    (tmp_path / "page.jpg").write_bytes(data)
    with mosquitto_sub(broker.port, "edged/dev/reply/raw", 1) as sub:
        _pub(broker.port, "edged/dev/infer/layout_detect", tmp_path / "page.jpg", "jpeg-1")
        out, _ = sub.communicate(timeout=60)
    topic, corr, payload = out.strip().split("|", 2)
    assert (topic, corr) == ("edged/dev/reply/raw", "jpeg-1")
    answer = json.loads(payload)
    assert answer["model_name"] == "layout_detect" and answer["content_type"] == "image/jpeg"
    regions = answer["outputs"]["detections"][0]  # one JSON list per image, embedded as JSON
    assert answer["outputs"]["count"] == [len(regions)] and len(regions) >= 2
    assert_matches_reference(regions, rapid_layout(data))


def test_raw_png_by_content_type_and_a_corrupt_jpeg_is_an_error_naming_the_input(
        broker: Broker, mqtt: MqttTransport, tmp_path: Path) -> None:
    ok, png = cv2.imencode(".png", _page(1)[:600, :500])
    assert ok
    (tmp_path / "page.png").write_bytes(bytes(png))
    good = _jpeg(_page(2))
    (tmp_path / "bad.jpg").write_bytes(good[: len(good) // 4])
    (tmp_path / "good.jpg").write_bytes(good)
    client = TestClient(broker.port).wait_connected()
    client.subscribe("edged/dev/reply/raw")
    try:
        # the declared content type (a user property) decides, here for a PNG
        _pub(broker.port, "edged/dev/infer/orientation_classify", tmp_path / "page.png", "png-1",
             "-D", "publish", "user-property", CONTENT_TYPE_PROPERTY, "image/png")
        msg = client.get(timeout=60, where=lambda m: m.properties.CorrelationData == b"png-1")
        want = run_pipeline("orientation_classify", {"image": np.array([bytes(png)], dtype=object)})
        got = json.loads(msg.payload)["outputs"]
        assert got["labels"] == [[v.decode() for v in want["labels"][0]]]
        np.testing.assert_allclose(got["scores"], want["scores"], atol=1e-4)

        _pub(broker.port, "edged/dev/infer/orientation_classify", tmp_path / "bad.jpg", "bad-1")
        msg = client.get(timeout=60, where=lambda m: m.properties.CorrelationData == b"bad-1")
        err = json.loads(msg.payload)
        assert err["code"] == "invalid_argument" and "'image'" in err["error"], err

        _pub(broker.port, "edged/dev/infer/orientation_classify", tmp_path / "good.jpg", "good-1")
        msg = client.get(timeout=60, where=lambda m: m.properties.CorrelationData == b"good-1")
        assert len(json.loads(msg.payload)["outputs"]["labels"][0]) == 4

        # a model whose input is not one BYTES tensor says so instead of guessing
        _pub(broker.port, "edged/dev/infer/digits", tmp_path / "good.jpg", "digits-1")
        msg = client.get(timeout=60, where=lambda m: m.properties.CorrelationData == b"digits-1")
        assert "BYTES" in json.loads(msg.payload)["error"]
    finally:
        client.close()


@pytest.fixture
def shm_config(service: InferenceService) -> Iterator[Path]:
    """The shm transport on the example service; yields a config file that points the CLI at it."""
    from edged.transports.shm.transport import ShmTransport

    short = Path(tempfile.mkdtemp(prefix="edged-pipe-"))  # AF_UNIX paths are limited to 107 bytes
    text = (f'[device]\nstate_dir = "{short}/state"\nruntime_dir = "{short}/run"\n'
            f'model_repository = "{service.manager.repository}"\n')
    (short / "edged.toml").write_text(text)
    transport = ShmTransport(parse_config(text), service)
    transport.start_blocking()
    try:
        yield short / "edged.toml"
    finally:
        transport.stop_blocking()
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def shm(shm_config: Path) -> str:
    return str(parse_config(shm_config.read_text()).shm_socket)


def test_shm_client_sends_the_jpeg_bytes_and_gets_rapid_layouts_regions(shm: str, rapid_layout: Any) -> None:
    from edged.client.shm import ShmClient

    data = _jpeg(_page(1))
    with ShmClient(shm) as client:
        out = client.infer("layout_detect", {"image": np.array([data], dtype=object)})
        regions = json.loads(out["detections"][0])
        assert int(out["count"][0]) == len(regions) >= 2
        assert out["labels"].dtype == object and out["boxes"].shape == (1, len(regions), 4)
        assert_matches_reference(regions, rapid_layout(data))
        with pytest.raises(EdgedError) as err:
            client.infer("layout_detect", {"image": np.array([data[:500]], dtype=object)})
        assert err.value.code is ErrorCode.INVALID_ARGUMENT and "'image'" in err.value.message
        again = client.infer("orientation_classify", {"image": np.array([data], dtype=object)})
        assert again["labels"].shape == (1, 4)


def test_shm_bytes_descriptor_claiming_more_elements_than_its_range_holds_is_refused(shm: str) -> None:
    from edged.client.shm import ShmClient
    from edged.protocol import shm as p

    with ShmClient(shm) as client:
        seg = client._run(client._core.register(4096))
        seg.view(np.dtype(np.uint8), (8,), 0)[:] = np.frombuffer(b"\x04\0\0\0abcd", np.uint8)
        # 2^31 elements claimed in 8 bytes: refused before any allocation, the connection serves on
        tensor = p.encode_tensor("image", p.BYTES, (1 << 31,), segment=seg.id, offset=0, nbytes=8)
        msg = p.encode_infer(client._core.next_id(), "orientation_classify", 0, [tensor], out_segment=seg.id,
                             out_offset=1024, out_capacity=3072)
        status, _, body = client._call(msg)
        assert status == 1 and "2147483648 BYTES elements" in p.decode_error(body)[1]
        tensor = p.encode_tensor("image", p.BYTES, (1,), segment=seg.id, offset=4090, nbytes=8)
        msg = p.encode_infer(client._core.next_id(), "orientation_classify", 0, [tensor], out_segment=seg.id,
                             out_offset=1024, out_capacity=3072)
        status, _, body = client._call(msg)
        assert status == 1 and "input 'image'" in p.decode_error(body)[1]
        out = client.infer("orientation_classify", {"image": np.array([_jpeg(_page(0))], dtype=object)})
        assert out["labels"].shape == (1, 4)


@pytest.mark.parametrize("transport", ["local", "shm", "mqtt"])
def test_edged_infer_with_a_jpeg_prints_rapid_layouts_regions(
        shm_config: Path, rapid_layout: Any, tmp_path: Path, transport: str, request: pytest.FixtureRequest) -> None:
    """`edged infer layout_detect --input page.jpg`: in the process (the pipeline's model loaded with it),
    through the running daemon's shm socket and over MQTT; the JSON printed holds the reference's regions."""
    if transport == "mqtt":
        broker = request.getfixturevalue("broker")
        request.getfixturevalue("mqtt")  # the MQTT transport on the same service, device id "dev"
        text = shm_config.read_text().replace("[device]\n", '[device]\nid = "dev"\n', 1)
        shm_config = tmp_path / "mqtt.toml"
        shm_config.write_text(text + f'[mqtt]\nurl = "{broker.url}"\n')
    data = _jpeg(_page(0))
    (tmp_path / "page.jpg").write_bytes(data)
    run = subprocess.run([*EDGED, "infer", "layout_detect", "--input", str(tmp_path / "page.jpg"),
                          "--config", str(shm_config), "--transport", transport],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["model_name"] == "layout_detect" and answer["content_type"] == "image/jpeg"
    assert_matches_reference(answer["outputs"]["detections"][0], rapid_layout(data))
    (tmp_path / "bad.jpg").write_bytes(data[:300])
    run = subprocess.run([*EDGED, "infer", "layout_detect", "--input", str(tmp_path / "bad.jpg"),
                          "--config", str(shm_config), "--transport", transport],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "'image'" in run.stderr


def test_camera_stream_binding_to_a_pipeline_drops_by_policy_and_reports_its_real_rate(
        broker: Broker, service: InferenceService) -> None:
    """A camera publishing JPEG frames at 30/s into layout_detect, which cannot keep up here: frames are
    dropped by the binding's policy (the buffer never holds more than queue_size), every answer carries
    its frame's timestamp, and the stream's real fps and latency are in the transport's telemetry."""
    import os

    import psutil

    cfg = parse_config(f'[device]\nid = "dev"\n[mqtt]\nurl = "{broker.url}"\n'
                       '[[mqtt.bindings]]\ntopic = "cameras/+/jpeg"\nmodel = "layout_detect"\n'
                       'output_topic = "results/{topic}"\ninput_format = "media"\n'
                       'policy = "latest_per_topic"\nqueue_size = 1\n')
    t = MqttTransport(cfg, service, "test-profile")
    asyncio.run(t.start())
    sub = TestClient(broker.port).wait_connected()
    sub.subscribe("results/#")
    cam = TestClient(broker.port).wait_connected()
    frames = [_jpeg(_page(i % 3)) for i in range(3)]
    try:
        assert t.wait_ready(10)
        cam.publish("cameras/warmup/jpeg", frames[0], qos=0)  # first use of the engines is not the stream's
        assert "outputs" in json.loads(sub.get(timeout=60).payload)
        rss0 = psutil.Process(os.getpid()).memory_info().rss
        sent = 0
        start = time.monotonic()
        while time.monotonic() - start < 4.0:  # 30 frames per second for 4 s
            cam.publish("cameras/door/jpeg", frames[sent % 3], qos=0,
                        UserProperty=[("Frame-Timestamp", f"frame-{sent}")])
            sent += 1
            time.sleep(max(0.0, start + sent / 30 - time.monotonic()))
        answers = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = t.binding_stats()[0]
            if st.received > sent and st.processed + st.dropped + st.errors >= st.received:
                break
            time.sleep(0.2)
        answers = [json.loads(m.payload) for m in sub.drain(1.0)]
        grown_mb = (psutil.Process(os.getpid()).memory_info().rss - rss0) / 1e6
        stream = t.stats().streams[0]
    finally:
        cam.close()
        sub.close()
        asyncio.run(t.stop())
    assert stream.received == sent + 1 and sent >= 100
    assert stream.dropped > 0 and stream.processed + stream.dropped + stream.errors == sent + 1, stream
    assert t.binding_stats()[0].high_water <= 1
    assert len(answers) == stream.processed - 1 and stream.errors == 0
    for a in answers:
        assert a["input_topic"] == "cameras/door/jpeg" and a["frame_timestamp"].startswith("frame-")
        assert a["model_name"] == "layout_detect" and len(a["outputs"]["detections"][0]) >= 1
    # the real rate: what was answered, far below the 30 frames/s offered
    assert 0 < stream.fps < 30 and stream.latency_ms_p50 > 0
    print(f"camera stream: {sent} frames offered at 30/s, {stream.processed} answered ({stream.fps:.2f}/s, "
          f"latency p50 {stream.latency_ms_p50:.0f} ms), {stream.dropped} dropped; RSS grew {grown_mb:.1f} MB")
    assert grown_mb < 50


def test_edged_perf_loads_a_pipeline_with_an_image_file(shm_config: Path, tmp_path: Path) -> None:
    """`edged perf -m orientation_classify --input-data page.jpg` over shm: every request is the image."""
    (tmp_path / "page.jpg").write_bytes(_jpeg(_page(0)))
    out = tmp_path / "perf.json"
    run = subprocess.run([*EDGED, "--config", str(shm_config), "perf", "-m", "orientation_classify",
                          "--transport", "shm", "--http-url", "none", "--input-data", str(tmp_path / "page.jpg"),
                          "--concurrency-range", "1,2", "-p", "500", "-r", "3", "-s", "100", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())
    rows = rows["results"] if isinstance(rows, dict) else rows
    assert [str(r["concurrency"]) for r in rows] == ["1", "2"]
    assert all(float(r["requests_per_s"]) > 0 and int(r["errors"]) == 0 for r in rows), rows
