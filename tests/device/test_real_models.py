"""Models shaped like the ones users bring: dynamic dimensions, scalars, recurrent state, INT64 inputs.

The models are built at test time (tests/made_models.py) and served with variant-only
manifests on real engines; answers are compared with an engine-independent numpy reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client.http import HttpClient, HttpStatusError
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState
from edged.core.service import InferenceService
from edged.errors import ErrorCode, InternalError, InvalidInputError
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import metadata_response
from tests import made_models
from tests.conftest import EDGED
from tests.http_helpers import Served, served
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(240)

ENGINES = {
    "onnxruntime": [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])],
    "openvino": [BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])],
}


def make_repo(root: Path, name: str, extra: str = "", *, top: str = "") -> Path:
    """A repository with one variant-only manifest (``top`` keys first, ``extra`` TOML after) for a made model."""
    vdir = root / name / "1"
    onnx = getattr(made_models, name)(vdir / "model.onnx")
    digest = hashlib.sha256(onnx.read_bytes()).hexdigest()
    (vdir / "model.toml").write_text(top + textwrap.dedent(f"""
        [[variants]]
        file = "model.onnx"
        format = "onnx"
        sha256 = "{digest}"
        """) + textwrap.dedent(extra))
    return root


VAD_USUAL = """
    [warmup.shapes.input]
    shape = [1, 512]
    [warmup.shapes.sr]
    shape = []
    value = 16000
    [warmup.shapes.state]
    shape = [2, 1, 16]
    """
VAD_SHAPES = VAD_USUAL.replace("shape = [1, 512]\n", "shape = [1, 512]\n    min = [1, 65]\n    max = [1, 4096]\n", 1)


def vad_inputs(samples: int = 512, sr: int = 16000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(samples)
    return {"input": rng.random((1, samples), dtype=np.float32), "sr": np.array(sr, np.int64),
            "state": rng.random((2, 1, 16), dtype=np.float32)}


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    if name == "openvino":
        pytest.importorskip("openvino")
    return name


def manager(repo: Path, engine: str) -> Iterator[tuple[ModelManager, InferenceService]]:
    m = ModelManager(repo, ModelsSection(), ENGINES[engine])
    m.load_all()
    try:
        yield m, InferenceService(m)
    finally:
        m.shutdown()


def test_made_up_warmup_refused_still_serves_and_says_why(tmp_path: Path, engine: str) -> None:
    for m, svc in manager(make_repo(tmp_path, "vad"), engine):
        mv = m.table.find("vad")
        assert mv is not None and mv.state is ModelState.READY, mv and mv.reason
        assert mv.candidate is not None and mv.candidate.backend == engine
        note = mv.status()["warmup"]
        assert note.startswith("warm-up skipped") and "input [1, 64]" in note and "[warmup.shapes." in note
        assert metadata_response(svc.describe("vad"))["parameters"]["warmup"] == note
        x = vad_inputs()
        got = svc.infer(InferRequest(model="vad", inputs=x), 30).outputs
        want = made_models.vad_reference(x["input"], 16000, x["state"])
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_max_batch_size_is_auto_completed_as_triton_does(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "auto", "multidyn")
    make_repo(tmp_path / "off", "multidyn", top="max_batch_size = 0\n")
    for m, svc in manager(repo, "onnxruntime"):
        mv = m.table.find("multidyn")
        assert mv is not None and mv.max_batch_size == 4 and mv.scheduler is not None
        assert mv.scheduler.batching is not None  # dynamic batching on
        assert [(t.name, t.shape) for t in mv.inputs] == [("image", [3, -1, -1]), ("ids", [-1])]
        cfg = metadata_response(svc.describe("multidyn"))
        assert cfg["inputs"][0]["shape"] == [-1, 3, -1, -1]
        with pytest.raises(InvalidInputError, match=r"batch size 5 is outside 1\.\.4"):
            svc.infer(InferRequest(model="multidyn", inputs={
                "image": np.zeros((5, 3, 8, 8), np.float32), "ids": np.zeros((5, 2), np.int64)}), 30)
    for m, _ in manager(tmp_path / "off", "onnxruntime"):  # an explicit max_batch_size = 0 wins
        mv = m.table.find("multidyn")
        assert mv is not None and mv.max_batch_size == 0 and mv.inputs[0].shape == [-1, 3, -1, -1]


def test_declared_shapes_drive_warmup(tmp_path: Path, engine: str) -> None:
    for m, _ in manager(make_repo(tmp_path, "vad", VAD_SHAPES), engine):
        mv = m.table.find("vad")
        assert mv is not None and mv.state is ModelState.READY and mv.warmup_note is None
        assert "warmup" not in mv.status()


def test_impossible_shape_is_a_400_naming_the_input_and_the_next_request_succeeds(tmp_path: Path,
                                                                                   engine: str) -> None:
    for _, svc in manager(make_repo(tmp_path, "vad", VAD_USUAL), engine):
        good = vad_inputs()
        want = svc.infer(InferRequest(model="vad", inputs=good), 30).outputs
        for _ in range(3):
            with pytest.raises(InvalidInputError) as e:
                svc.infer(InferRequest(model="vad", inputs=vad_inputs(samples=8)), 30)
            assert e.value.code is ErrorCode.INVALID_ARGUMENT
            assert "input 'input' dimension 1 is 8 (it last ran with 512)" in str(e.value), e.value
            got = svc.infer(InferRequest(model="vad", inputs=good), 30).outputs
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])


def test_declared_min_and_max_hold_on_every_engine(tmp_path: Path, engine: str) -> None:
    for _, svc in manager(make_repo(tmp_path, "vad", VAD_SHAPES), engine):
        for samples, what in ((64, "below the declared minimum 65"), (5000, "above the declared maximum 4096")):
            with pytest.raises(InvalidInputError) as e:
                svc.infer(InferRequest(model="vad", inputs=vad_inputs(samples=samples)), 30)
            assert f"input 'input' dimension 1 is {samples}, {what}" in str(e.value)
        for samples in (65, 4096):  # the bounds themselves are served, on OpenVINO's bounded shapes too
            x = vad_inputs(samples=samples)
            got = svc.infer(InferRequest(model="vad", inputs=x), 30).outputs
            np.testing.assert_allclose(got["output"], made_models.vad_reference(x["input"], 16000, x["state"])[
                "output"], rtol=1e-5)


def test_values_out_of_range_and_several_dynamic_dims(tmp_path: Path, engine: str) -> None:
    for m, svc in manager(make_repo(tmp_path, "multidyn"), engine):
        mv = m.table.find("multidyn")
        assert mv is not None and mv.state is ModelState.READY, mv and mv.reason
        assert "made-up data" in (mv.warmup_note or "")
        image = np.random.default_rng(1).random((2, 3, 48, 320), dtype=np.float32)
        ids = np.array([[1, 5, 99], [0, 0, 7]], np.int64)
        out = svc.infer(InferRequest(model="multidyn", inputs={"image": image, "ids": ids}), 30).outputs
        np.testing.assert_allclose(out["pooled"], image.mean(axis=(2, 3)), rtol=1e-5)
        table = (np.arange(made_models.VOCAB * 8, dtype=np.float32).reshape(made_models.VOCAB, 8) % 13) / 13
        np.testing.assert_allclose(out["embedding"], table[ids].sum(axis=1), rtol=1e-5)
        bad = np.array([[1, 500, 2], [0, 0, 7]], np.int64)
        if engine == "onnxruntime":  # ORT reports the bad index as invalid argument: a 400
            with pytest.raises(InvalidInputError) as e:
                svc.infer(InferRequest(model="multidyn", inputs={"image": image, "ids": bad}), 30)
            assert "out of data bounds" in str(e.value)
        else:  # OpenVINO clamps or zero-fills; either way it must not break the next request
            try:
                svc.infer(InferRequest(model="multidyn", inputs={"image": image, "ids": bad}), 30)
            except (InvalidInputError, InternalError):
                pass
        again = svc.infer(InferRequest(model="multidyn", inputs={"image": image, "ids": ids}), 30).outputs
        np.testing.assert_array_equal(again["embedding"], out["embedding"])


@pytest.fixture(scope="module")
def vad_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("vad_http")
    with served(make_repo(tmp / "models", "vad", VAD_SHAPES), tmp, extra="[shm]\nsystem_shm_prefix = \"rm_\"\n") as s:
        yield s


def test_true_scalar_over_http_json_and_binary(vad_http: Served) -> None:
    x = vad_inputs(300)
    want = made_models.vad_reference(x["input"], 16000, x["state"])
    with HttpClient(vad_http.url) as c:
        for binary in (True, False):
            got = c.infer("vad", x, binary=binary)
            np.testing.assert_allclose(got["output"], want["output"], rtol=1e-5)
        # A scalar in JSON: shape [] and one value.
        body = {"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 300], "data": x["input"].ravel().tolist()},
            {"name": "sr", "datatype": "INT64", "shape": [], "data": [16000]},
            {"name": "state", "datatype": "FP32", "shape": [2, 1, 16], "data": x["state"].ravel().tolist()}]}
        r = c.request("POST", "/v2/models/vad/infer", [orjson.dumps(body)])
        assert r.status == 200, r.body
        out = {o["name"]: o for o in orjson.loads(r.body)["outputs"]}
        np.testing.assert_allclose(np.array(out["output"]["data"], np.float32).reshape(1, 1), want["output"],
                                   rtol=1e-5)
        # [1] where the model takes a true scalar is refused, naming the input.
        with pytest.raises(HttpStatusError) as e:
            c.infer("vad", {**x, "sr": np.array([16000], np.int64)})
        assert e.value.status == 400 and "'sr'" in str(e.value)
        # An impossible shape is a 400 naming the input and dimension; the next good request works.
        with pytest.raises(HttpStatusError) as e:
            c.infer("vad", vad_inputs(10))
        assert e.value.status == 400 and "input 'input' dimension 1 is 10" in str(e.value)
        np.testing.assert_allclose(c.infer("vad", x)["output"], want["output"], rtol=1e-5)


def test_an_output_shape_the_answers_contradict_is_logged_once_and_noted(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    for m, svc in manager(make_repo(tmp_path, "misdeclared"), "onnxruntime"):
        mv = m.table.find("misdeclared")
        assert mv is not None and mv.output_note is None
        with caplog.at_level("WARNING", logger="edged.core.output_shapes"):
            for width in (8, 8, 12):
                out = svc.infer(InferRequest(model="misdeclared", inputs={"x": np.ones((1, width), np.float32)}),
                                30).outputs
                assert out["y"].shape == (width // 2, 2)  # served as the engine answers
        noted = [r for r in caplog.records if "is declared with shape" in r.getMessage()]
        assert len(noted) == 1, noted
        note = mv.output_note
        assert note is not None and "output 'y' is declared with shape [1, 2] but the engine answers [4, 2]" \
            in note
        assert metadata_response(svc.describe("misdeclared"))["parameters"]["note"] == note
        assert mv.status()["note"] == note


def test_unavailable_model_says_why(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "models", "vad")
    (repo / "vad" / "1" / "model.onnx").write_bytes(b"not a model")
    with served(repo, tmp_path) as s, HttpClient(s.url) as c:
        r = c.request("GET", "/v2/models/vad")
        assert r.status == 200
        params = orjson.loads(r.body)["parameters"]
        assert params["state"] == "unavailable" and params["reason"]
        with pytest.raises(HttpStatusError) as e:
            c.infer("vad", vad_inputs())
        assert e.value.status == 503 and params["reason"][:40] in str(e.value)


def test_edged_infer_over_http_keeps_an_unbatched_models_scalar(vad_http: Served, tmp_path: Path) -> None:
    # The first input starts with a dynamic dimension but max_batch_size is 0: nothing gets a batch
    # dimension added (the scalar sample rate used to become [1]).
    x = vad_inputs(256)
    np.savez(tmp_path / "x.npz", **x)
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[device]\nstate_dir = "{tmp_path}/state"\n[http]\nlisten = "{vad_http.url.removeprefix("http://")}"\n')
    r = subprocess.run([*EDGED, "infer", "vad", "--input", str(tmp_path / "x.npz"), "--transport", "http",
                        "--config", str(cfg), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}
    want = made_models.vad_reference(x["input"], 16000, x["state"])
    for k, w in want.items():
        assert out[k]["shape"] == list(w.shape)
        np.testing.assert_allclose(np.array(out[k]["data"], np.float32).reshape(w.shape), w, rtol=1e-5, atol=1e-6)


def _models_list(cfg: Path, *extra: str) -> dict[str, object]:
    """``edged models list --json``; if it hangs, every thread's stack is in the failure (faulthandler on SIGABRT)."""
    proc = subprocess.Popen([*EDGED, "models", "list", "--json", "--config", str(cfg), *extra], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"edged models list hung for 120 s; its threads:\n{stderr[-12000:]}")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_models_list_tells_the_same_truth_as_the_daemon(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "models", "vad")
    make_repo(repo, "nan")
    make_repo(repo, "misdeclared")
    cfg = tmp_path / "edged.toml"
    cfg.write_text(textwrap.dedent(f"""
        [device]
        state_dir = "{tmp_path / 'state'}"
        runtime_dir = "{tmp_path / 'run'}"
        model_repository = "{repo}"
        [http]
        enabled = false
        [mqtt]
        enabled = false
        [shm]
        enabled = false
        [telemetry]
        interval_s = 1
        """))

    def check(doc: dict[str, object], source: str) -> None:
        assert source in str(doc["source"])
        models = {m["name"]: m for m in doc["models"]}  # type: ignore[attr-defined]
        # Loads, but fails the self-test: not ready, with the reason, in both views.
        assert models["nan"]["state"] == "unavailable" and "self-test failed" in models["nan"]["reason"]
        assert models["vad"]["state"] == "ready"
        assert "skipped: the model refused made-up input" in models["vad"]["warmup"]
        # The self-test's answer contradicts the declared output shape: said in both views.
        assert models["misdeclared"]["state"] == "ready"
        assert "output 'y' is declared with shape [1, 2] but the engine answers [32, 2]" in \
            models["misdeclared"]["note"]

    check(_models_list(cfg), "no daemon is running")
    proc = subprocess.Popen([*EDGED, "run", "--config", str(cfg)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while time.monotonic() < deadline and "edged ready" not in (line := proc.stderr.readline()):
            assert line, "the daemon stopped"
        # Keep reading its log: a full pipe would block the daemon's next log line (its engine choice in the
        # background logs after READY), and with it the status file this test reads.
        threading.Thread(target=proc.stderr.read, name="drain-edged-log", daemon=True).start()
        status = tmp_path / "run" / "status.json"
        while time.monotonic() < deadline and not status.exists():
            time.sleep(0.1)

        def rewritten() -> bool:  # the status file is rewritten after the self-test took nan out of service
            try:
                check(_models_list(cfg), "the running daemon")
            except AssertionError:
                return False
            return True

        wait_until(rewritten, 60, 0.5, "the status file to show every model's self-test")
        st = subprocess.run([*EDGED, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert "note: vad v1: warm-up" in st.stdout and "[warmup.shapes." in st.stdout, st.stdout + st.stderr
        assert "note: misdeclared v1: output 'y' is declared with shape [1, 2]" in st.stdout, st.stdout
    finally:
        proc.terminate()
        proc.wait(30)


def test_true_scalar_over_the_native_shm_client_and_system_shm(vad_http: Served, tmp_path: Path) -> None:
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as tshm

    from edged.client.shm import ShmClient
    from edged.config import parse_config
    from edged.transports.shm.transport import ShmTransport
    from tests.http_helpers import AUTH  # passed as copies: tritonclient adds its headers to the dict it gets

    x = vad_inputs(200)
    want = made_models.vad_reference(x["input"], 16000, x["state"])
    cfg = parse_config(f'[device]\nstate_dir = "{tmp_path}/state"\nruntime_dir = "{tmp_path}/run"\n')
    shm = ShmTransport(cfg, vad_http.service)
    shm.start_blocking()
    try:
        with ShmClient(shm.path) as c:
            got = c.infer("vad", x)
        np.testing.assert_allclose(got["output"], want["output"], rtol=1e-5)
    finally:
        shm.stop_blocking()
    # Triton's system shared memory: the scalar is 8 bytes of a region, declared with shape [].
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    h = tshm.create_shared_memory_region(f"sr_{tag}", f"/rm_sr_{tag}", 8)
    triton = th.InferenceServerClient(vad_http.url.removeprefix("http://"))
    try:
        tshm.set_shared_memory_region(h, [x["sr"].reshape(1)])  # its helper cannot write a 0-d array
        triton.register_system_shared_memory(f"sr_{tag}", f"/rm_sr_{tag}", 8, headers=dict(AUTH))
        inputs = []
        for name in ("input", "state"):
            i = th.InferInput(name, list(x[name].shape), "FP32")
            i.set_data_from_numpy(x[name])
            inputs.append(i)
        sr = th.InferInput("sr", [], "INT64")
        sr.set_shared_memory(f"sr_{tag}", 8)
        r = triton.infer("vad", [*inputs, sr], headers=dict(AUTH))
        np.testing.assert_allclose(r.as_numpy("output"), want["output"], rtol=1e-5)
    finally:
        triton.unregister_system_shared_memory(headers=dict(AUTH))
        tshm.destroy_shared_memory_region(h)
        triton.close()


def test_true_scalar_over_mqtt_and_grpc(tmp_path: Path) -> None:
    """The transports not covered above: MQTT (binary and JSON payloads, MQTT 5 and 3.1.1) and gRPC
    (tritonclient.grpc, raw and typed contents), each with the sample rate as a 0-d INT64."""
    import asyncio

    import tritonclient.grpc as tg

    from edged.client.mqtt import MqttClient
    from edged.config import parse_config
    from edged.transports.mqtt.transport import MqttTransport
    from tests.mqtt_helpers import Broker

    x = vad_inputs(320)
    want = made_models.vad_reference(x["input"], 16000, x["state"])["output"]
    with served(make_repo(tmp_path / "models", "vad", VAD_SHAPES), tmp_path, grpc="") as s:
        broker = Broker(tmp_path / "broker").start()
        mqtt = MqttTransport(parse_config(f'[device]\nid = "scalar"\n[mqtt]\nurl = "{broker.url}"\n'), s.service,
                             "test-profile")
        try:
            asyncio.run(mqtt.start())
            assert mqtt.wait_ready(10), "the MQTT transport did not connect and subscribe"
            for protocol in ("5", "3.1.1"):
                for binary in (True, False):
                    with MqttClient(broker.url, "scalar", protocol=protocol, binary=binary) as c:
                        np.testing.assert_allclose(c.infer("vad", x)["output"], want, rtol=1e-5)
        finally:
            asyncio.run(mqtt.stop())
            broker.stop()
        triton = tg.InferenceServerClient(s.grpc_url)
        try:
            for typed in (False, True):
                inputs = []
                for name, dt in (("input", "FP32"), ("sr", "INT64"), ("state", "FP32")):
                    i = tg.InferInput(name, list(x[name].shape), dt)
                    if typed:  # the values in the typed contents field instead of raw bytes
                        getattr(i._get_tensor().contents, "fp32_contents" if dt == "FP32" else "int64_contents") \
                            .extend(x[name].ravel().tolist())
                    else:
                        i.set_data_from_numpy(x[name])
                    inputs.append(i)
                assert inputs[1]._get_tensor().shape == []
                got = triton.infer("vad", inputs).as_numpy("output")
                np.testing.assert_allclose(got, want, rtol=1e-5)
        finally:
            triton.close()
