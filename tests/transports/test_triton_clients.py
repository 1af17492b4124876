"""Triton's and KServe's own clients, unchanged, against a real ``edged run``; a string model on every transport.

Triton's Python example clients (``src/python/examples`` of triton-inference-server/client) cannot be
fetched here (only package registries are reachable), so each test below does what one or more of
those examples does, with the real ``tritonclient`` package, on Triton's four example models rebuilt
as ONNX (tests/triton_models.py). The examples that need a GPU (cudashm), an image model, a sequence
model or a custom backend are left out; docs/triton.md lists every example and its result.

KServe's Python client is not installed (the ``kserve`` package pulls Kubernetes, pandas and
downgrades psutil), so the bodies it parses are checked as it reads them: ``response.json()["live"]``,
``["ready"]``, a JSON ``{"error": ...}`` with ``application/json``, and the binary response split at
``Inference-Header-Content-Length``. Its gRPC client uses the same ``inference.GRPCInferenceService``
protocol as tritonclient's.

The string model is a scikit-learn TF-IDF text classifier converted with skl2onnx: every transport
must answer exactly what ONNX Runtime itself answers when fed the same sentences as ``str``.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from tests.edged_process import edged_run
from tests.mqtt_helpers import Broker
from tests.netutil import free_port
from tests.triton_models import (
    EXAMPLE_MODELS,
    NAMES,
    QUERIES,
    build_examples,
    build_text_classifier,
    build_text_pipeline,
)

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] (the dev extra) is not installed")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the dev extra) is not installed")
from tritonclient import utils as tutils  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from tritonclient.utils import shared_memory as tshm  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TOKEN = "triton-migration-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}  # tritonclient headers=: lower case, as gRPC metadata must be
SHM_PREFIX = "tritonex_"


class Daemon:
    def __init__(self, tmp: Path, http: str, grpc: str, broker: Broker, text: bool) -> None:
        self.tmp, self.http, self.grpc, self.broker, self.text = tmp, http, grpc, broker, text
        self.sock = tmp / "run" / "edged.sock"
        self.sklearn: Any = None

    def log(self) -> str:
        return (self.tmp / "edged.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("triton")
    repo = build_examples(tmp / "models")
    broken = repo / "broken" / "1"  # a model file ONNX Runtime cannot load: kept unavailable, with its reason
    shutil.copytree(repo / "simple" / "1", broken)
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    text = (broken / "model.toml").read_text()
    digest = hashlib.sha256(b"not an onnx model").hexdigest()
    (broken / "model.toml").write_text(text.split("sha256 = ")[0] + f'sha256 = "{digest}"\n')
    try:
        sklearn_pipeline = build_text_classifier(repo)
        build_text_pipeline(repo)
    except ImportError:  # skl2onnx is in the dev extra; without it the text tests skip
        sklearn_pipeline = None
    text = sklearn_pipeline is not None
    broker = Broker(tmp / "broker").start()
    http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = tmp / "edged.toml"
    cfg.write_text(f"""
[device]
id = "triton-test"
profile = "generic"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{repo}"
[http]
listen = "{http}"
[grpc]
listen = "{grpc}"
[mqtt]
url = "{broker.url}"
[shm]
system_shm_prefix = "{SHM_PREFIX}"
[control]
token = "{TOKEN}"
[telemetry]
enabled = false
[logging]
level = "warning"
""")
    d = Daemon(tmp, http, grpc, broker, text)
    d.sklearn = sklearn_pipeline
    models = [*EXAMPLE_MODELS, *(["text_classifier", "text_pipeline"] if text else [])]

    def ready() -> bool:
        return all(client.is_model_ready(m) for m in models) and d.sock.exists()

    try:
        client = httpclient.InferenceServerClient(http)
        with edged_run(cfg, tmp / "edged.log", ready, timeout=120):
            client.close()
            yield d
    finally:
        broker.stop()


def _ints() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(16, dtype=np.int32)[None, :], np.full((1, 16), -1, dtype=np.int32)


def _check_add_sub(a: np.ndarray, b: np.ndarray, out0: np.ndarray, out1: np.ndarray) -> None:
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


def _strings(x: np.ndarray) -> np.ndarray:
    return np.array([str(v).encode() for v in x.ravel()], dtype=np.object_).reshape(x.shape)


# ---- health and metadata: simple_{http,grpc}_health_metadata.py, grpc_client.py, KServe's REST client ---------
def test_health_and_metadata_over_http_and_grpc(daemon: Daemon) -> None:
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        for c in (h, g):
            assert c.is_server_live(query_params={"test_1": 1, "test_2": 2}) if c is h else c.is_server_live()
            assert c.is_server_ready() and c.is_model_ready("simple")
            assert c.get_server_metadata(**({"as_json": True} if c is g else {}))["name"] == "edged"  # not "triton"
            meta = c.get_model_metadata("simple", **({"as_json": True} if c is g else {}))
            assert meta["name"] == "simple"
            assert [i["datatype"] for i in meta["inputs"]] == ["INT32", "INT32"]
            with pytest.raises(InferenceServerException) as exc:
                c.get_model_metadata("wrong_model_name")
            assert "Request for unknown model" in exc.value.message(), exc.value.message()
        assert h.get_model_config("simple")["max_batch_size"] == 8
        assert g.get_model_config("simple", as_json=True)["config"]["max_batch_size"] == 8
    finally:
        h.close()
        g.close()


def test_health_bodies_are_the_open_inference_protocol_ones(daemon: Daemon) -> None:
    """What KServe's InferenceRESTClient reads: is_server_live -> json()["live"], is_server_ready ->
    json()["ready"], is_model_ready -> the status; errors as {"error": ...} with application/json."""
    import httpx

    with httpx.Client(base_url=f"http://{daemon.http}") as c:
        for path, body in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                           ("/v2/models/simple/ready", {"name": "simple", "ready": True}),
                           ("/v2/models/simple/versions/1/ready", {"name": "simple", "ready": True})):
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"] == "application/json", path
            assert r.json() == body, path
        r = c.get("/v2/models/broken/ready")  # a model that failed to load: 503, and the body says so
        assert r.status_code == 503 and r.json() == {"name": "broken", "ready": False}
        r = c.get("/v2/models/wrong_model_name/ready")
        assert r.status_code == 404 and r.headers["content-type"] == "application/json"
        assert r.json()["error"].startswith("Request for unknown model: 'wrong_model_name' is not found")
        # infer as KServe's client sends it (JSON), and the binary answer it splits at the header length
        a, b = _ints()
        req = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": a.ravel().tolist()},
                          {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": b.ravel().tolist()}],
               "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]}
        r = c.post("/v2/models/simple/infer", content=orjson.dumps(req), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        hlen = int(r.headers["inference-header-content-length"])
        head = orjson.loads(r.content[:hlen])
        out0 = np.frombuffer(r.content[hlen:], np.int32).reshape(1, 16)
        by_name = {o["name"]: o for o in head["outputs"]}
        _check_add_sub(a, b, out0, np.array(by_name["OUTPUT1"]["data"], np.int32).reshape(1, 16))


# ---- INT32 / INT8: simple_{http,grpc}_infer_client.py, custom args, keep-alive, explicit int/int8 content --------
def test_int_and_int8_infer_with_triton_clients(daemon: Daemon) -> None:
    a, b = _ints()
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(
        daemon.grpc, channel_args=[("grpc.max_send_message_length", 1 << 20), ("grpc.keepalive_timeout_ms", 20000)],
        keepalive_options=grpcclient.KeepAliveOptions(keepalive_time_ms=2**31 - 1))
    try:
        for model, dtype, dt in (("simple", np.int32, "INT32"), ("simple_int8", np.int8, "INT8")):
            x, y = a.astype(dtype), b.astype(dtype)
            hin = [httpclient.InferInput("INPUT0", [1, 16], dt), httpclient.InferInput("INPUT1", [1, 16], dt)]
            hin[0].set_data_from_numpy(x, binary_data=False)
            hin[1].set_data_from_numpy(y, binary_data=True)
            houts = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                     httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
            for outs, comp in ((houts, None), (None, "gzip"), (houts, "deflate")):
                r = h.infer(model, hin, outputs=outs, query_params={"test_1": 1, "test_2": 2},
                            request_compression_algorithm=comp, response_compression_algorithm=comp)
                _check_add_sub(x, y, r.as_numpy("OUTPUT0"), r.as_numpy("OUTPUT1"))
            gin = [grpcclient.InferInput("INPUT0", [1, 16], dt), grpcclient.InferInput("INPUT1", [1, 16], dt)]
            gin[0].set_data_from_numpy(x)
            gin[1].set_data_from_numpy(y)
            r = g.infer(model, gin, outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                                             grpcclient.InferRequestedOutput("OUTPUT1")], headers={"test": "1"})
            _check_add_sub(x, y, r.as_numpy("OUTPUT0"), r.as_numpy("OUTPUT1"))
        assert len(h.get_inference_statistics(model_name="simple")["model_stats"]) == 1
        # grpc_explicit_int{,8}_content_client.py: typed contents instead of raw bytes
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        stub = service_pb2_grpc.GRPCInferenceServiceStub(g._channel)
        for model, field in (("simple", "int_contents"), ("simple_int8", "int_contents")):
            req = service_pb2.ModelInferRequest(model_name=model)
            for name, data in (("INPUT0", a), ("INPUT1", b)):
                t = req.inputs.add(name=name, datatype="INT32" if model == "simple" else "INT8", shape=[1, 16])
                getattr(t.contents, field).extend(int(v) for v in data.ravel())
            resp = stub.ModelInfer(req)
            got = [np.frombuffer(raw, np.int32 if model == "simple" else np.int8) for raw in resp.raw_output_contents]
            _check_add_sub(a.ravel(), b.ravel(), got[0], got[1])
        # the wrong model name, as the examples check it
        for c in (h, g):
            with pytest.raises(InferenceServerException) as exc:
                c.infer("wrong_model_name", hin if c is h else gin)
            assert exc.value.message().startswith("Request for unknown model"), exc.value.message()
    finally:
        h.close()
        g.close()


# ---- async: simple_{http,grpc}_async_infer_client.py, simple_{http,grpc}_aio_infer_client.py ---------------------
def test_async_and_aio_infer(daemon: Daemon) -> None:
    a, b = _ints()
    h = httpclient.InferenceServerClient(daemon.http, concurrency=4)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        hin = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        hin[0].set_data_from_numpy(a)
        hin[1].set_data_from_numpy(b)
        for r in [h.async_infer("simple", hin) for _ in range(4)]:
            res = r.get_result()
            _check_add_sub(a, b, res.as_numpy("OUTPUT0"), res.as_numpy("OUTPUT1"))
        gin = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        gin[0].set_data_from_numpy(a)
        gin[1].set_data_from_numpy(b)
        done: queue.Queue[Any] = queue.Queue()
        for _ in range(4):
            g.async_infer("simple", gin, lambda result, error: done.put((result, error)))
        for _ in range(4):
            result, error = done.get(timeout=30)
            assert error is None, error
            _check_add_sub(a, b, result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))
    finally:
        h.close()
        g.close()

    async def aio() -> None:
        import tritonclient.grpc.aio as agrpc
        import tritonclient.http.aio as ahttp

        ah, ag = ahttp.InferenceServerClient(daemon.http), agrpc.InferenceServerClient(daemon.grpc)
        try:
            assert await ah.is_server_live() and await ag.is_server_live()
            ahin = [ahttp.InferInput("INPUT0", [1, 16], "INT32"), ahttp.InferInput("INPUT1", [1, 16], "INT32")]
            agin = [agrpc.InferInput("INPUT0", [1, 16], "INT32"), agrpc.InferInput("INPUT1", [1, 16], "INT32")]
            for ins in (ahin, agin):
                ins[0].set_data_from_numpy(a)
                ins[1].set_data_from_numpy(b)
            rh, rg = await asyncio.gather(ah.infer("simple", ahin), ag.infer("simple", agin))
            for r in (rh, rg):
                _check_add_sub(a, b, r.as_numpy("OUTPUT0"), r.as_numpy("OUTPUT1"))
            with pytest.raises(InferenceServerException) as exc:
                await ah.infer("wrong_model_name", ahin)
            assert exc.value.message().startswith("Request for unknown model")
        finally:
            await ah.close()
            await ag.close()

    asyncio.run(aio())


# ---- BYTES: simple_{http,grpc}_string_infer_client.py, grpc_explicit_byte_content_client.py -----------------------
def test_string_models_with_triton_clients(daemon: Daemon) -> None:
    in0 = np.arange(16, dtype=np.int32)[None, :]
    in1 = np.ones((1, 16), dtype=np.int32)
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        for c, mod in ((h, httpclient), (g, grpcclient)):
            ins = [mod.InferInput("INPUT0", [1, 16], "BYTES"), mod.InferInput("INPUT1", [1, 16], "BYTES")]
            if c is h:
                ins[0].set_data_from_numpy(_strings(in0), binary_data=True)
                ins[1].set_data_from_numpy(_strings(in1), binary_data=False)
                outs = [mod.InferRequestedOutput("OUTPUT0", binary_data=True),
                        mod.InferRequestedOutput("OUTPUT1", binary_data=False)]
            else:
                ins[0].set_data_from_numpy(_strings(in0))
                ins[1].set_data_from_numpy(_strings(in1))
                outs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
            r = c.infer("simple_string", ins, outputs=outs)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0").astype(np.int32), in0 + in1)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT1").astype(np.int32), in0 - in1)
            assert r.as_numpy("OUTPUT0").ravel().tolist() == [str(v).encode() for v in (in0 + in1).ravel()]
            # simple_identity: NULs inside, control bytes, np.bytes_ ("S") arrays; binary and JSON
            for data in (np.array([b"he\x00llo"] * 16, dtype=np.object_).reshape(1, 16),
                         np.array([b"\x00\x01\x02\x03"] * 16, dtype=np.bytes_).reshape(1, 16),
                         np.array([f"é{i}☃\x00".encode() for i in range(16)], dtype=np.object_).reshape(1, 16)):
                for binary in ((True, False) if c is h else (True,)):
                    inp = mod.InferInput("INPUT0", list(data.shape), "BYTES")
                    if c is h:
                        inp.set_data_from_numpy(data, binary_data=binary)
                        out = [mod.InferRequestedOutput("OUTPUT0", binary_data=binary)]
                    else:
                        inp.set_data_from_numpy(data)
                        out = [mod.InferRequestedOutput("OUTPUT0")]
                    got = c.infer("simple_identity", [inp], outputs=out).as_numpy("OUTPUT0")
                    _identity_check(data, got, binary)
        # grpc_explicit_byte_content_client.py: typed bytes_contents in, raw BYTES out
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        req = service_pb2.ModelInferRequest(model_name="simple_string", model_version="")
        for name, vals in (("INPUT0", [str(i).encode() for i in range(16)]), ("INPUT1", [b"1"] * 16)):
            req.inputs.add(name=name, datatype="BYTES", shape=[1, 16]).contents.bytes_contents.extend(vals)
        req.outputs.add(name="OUTPUT0")
        req.outputs.add(name="OUTPUT1")
        resp = service_pb2_grpc.GRPCInferenceServiceStub(g._channel).ModelInfer(req)
        got = [tutils.deserialize_bytes_tensor(raw) for raw in resp.raw_output_contents]
        assert [int(v) for v in got[0]] == [i + 1 for i in range(16)]
        assert [int(v) for v in got[1]] == [i - 1 for i in range(16)]
    finally:
        h.close()
        g.close()


def _identity_check(sent: np.ndarray, got: np.ndarray, binary: bool) -> None:
    """The examples' own check of simple_identity's answer."""
    if sent.dtype == np.object_:
        if not binary:  # a JSON answer holds strings: the example encodes them back
            got = np.array([bytes(str(x), encoding="utf-8") for x in got.ravel()], dtype=np.object_).reshape(1, 16)
        assert np.array_equal(sent, got), got
    else:
        assert np.array_equal(sent, np.char.encode(got.astype(str))), got


def test_non_utf8_bytes_are_refused_naming_input_and_index(daemon: Daemon) -> None:
    """ONNX Runtime's string tensors hold text: a non-UTF-8 element is the client's error (400 /
    INVALID_ARGUMENT) that says which input and element, and the next request is served."""
    bad = np.array([b"ok"] * 5 + [b"\xff\xfe"] + [b"ok"] * 10, dtype=np.object_).reshape(1, 16)
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        for c, mod in ((h, httpclient), (g, grpcclient)):
            inp = mod.InferInput("INPUT0", [1, 16], "BYTES")
            inp.set_data_from_numpy(bad)
            with pytest.raises(InferenceServerException) as exc:
                c.infer("simple_identity", [inp])
            msg = exc.value.message()
            assert "input 'INPUT0' element 5 is not UTF-8" in msg, msg
            assert exc.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), exc.value.status()
            good = mod.InferInput("INPUT0", [1, 16], "BYTES")
            good.set_data_from_numpy(np.array([b"fine"] * 16, dtype=np.object_).reshape(1, 16))
            assert c.infer("simple_identity", [good]).as_numpy("OUTPUT0").ravel().tolist() == [b"fine"] * 16
    finally:
        h.close()
        g.close()
    from edged.client.mqtt import MqttClient
    from edged.client.shm import ShmClient
    from edged.errors import EdgedError, ErrorCode

    fine = np.array([b"fine"] * 16, dtype=np.object_).reshape(1, 16)
    with MqttClient(daemon.broker.url, "triton-test") as m, ShmClient(str(daemon.sock)) as s:
        for how, call in (("MQTT", lambda x: m.infer("simple_identity", {"INPUT0": x}, timeout=30)),
                          ("native shm", lambda x: s.infer("simple_identity", {"INPUT0": x}))):
            with pytest.raises(EdgedError) as err:
                call(bad)
            assert err.value.code is ErrorCode.INVALID_ARGUMENT, how
            assert "input 'INPUT0' element 5 is not UTF-8" in str(err.value), (how, str(err.value))
            assert call(fine)["OUTPUT0"].ravel().tolist() == [b"fine"] * 16, how


def test_errors_use_tritons_wording_and_keep_edgeds_codes(daemon: Daemon) -> None:
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        for c, mod in ((h, httpclient), (g, grpcclient)):
            def ins(n: int, mod: Any = mod) -> list[Any]:
                out = [mod.InferInput("INPUT0", [1, n], "INT32"), mod.InferInput("INPUT1", [1, n], "INT32")]
                for i in out:
                    i.set_data_from_numpy(np.zeros((1, n), np.int32))
                return out

            with pytest.raises(InferenceServerException) as exc:
                c.infer("simple", ins(16), model_version="3")
            assert exc.value.message().startswith("Request for unknown model: 'simple' version 3 is not found")
            assert exc.value.status() in ("404", "StatusCode.NOT_FOUND")
            with pytest.raises(InferenceServerException) as exc:
                c.infer("simple", ins(8))
            msg = exc.value.message()
            assert msg.startswith("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], "
                                  "got [1,8]"), msg
            assert "dimension 1 is 8, expected 16" in msg  # edged's detail after Triton's sentence
            assert exc.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            with pytest.raises(InferenceServerException) as exc:
                c.infer("broken", ins(16))
            msg = exc.value.message()
            assert msg.startswith("Request for unknown model: 'broken' version 1 is not at ready state ("), msg
            assert "ONNX Runtime could not load it" in msg  # why, after Triton's sentence
            assert exc.value.status() in ("503", "StatusCode.UNAVAILABLE")
            # model control (simple_*_model_control.py): the token in headers=, Triton's "failed to load"
            with pytest.raises(InferenceServerException) as exc:
                c.load_model("simple")
            assert exc.value.status() in ("401", "StatusCode.UNAUTHENTICATED")
            c.load_model("simple", headers=AUTH)
            assert c.is_model_ready("simple")
            with pytest.raises(InferenceServerException) as exc:
                c.load_model("wrong_model_name", headers=AUTH)
            assert "failed to load 'wrong_model_name'" in exc.value.message(), exc.value.message()
    finally:
        h.close()
        g.close()


# ---- system shared memory: simple_{http,grpc}_shm{,_string}_client.py, reuse_infer_objects_client.py -------------
def _region(name: str, size: int) -> tuple[str, Any]:
    key = f"/{SHM_PREFIX}{name}_{uuid.uuid4().hex[:8]}"
    return key, tshm.create_shared_memory_region(f"{name}_data", key, size)


def test_system_shared_memory_with_the_token_in_headers(daemon: Daemon) -> None:
    """The examples as they are, except that every shared-memory call passes ``headers=AUTH``."""
    in0 = np.arange(16, dtype=np.int32)
    in1 = np.ones(16, dtype=np.int32)
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    handles = []
    try:
        # without the token: refused, by design (docs/triton.md)
        with pytest.raises(InferenceServerException) as exc:
            h.register_system_shared_memory("nope", f"/{SHM_PREFIX}nope", 64)
        assert exc.value.status() == "401"
        with pytest.raises(InferenceServerException) as exc:
            g.get_system_shared_memory_status()
        assert exc.value.status() == "StatusCode.UNAUTHENTICATED"
        for c, mod in ((h, httpclient), (g, grpcclient)):
            c.unregister_system_shared_memory(headers=AUTH)
            for model, x0, x1, dt in (("simple", in0, in1, "INT32"),
                                      ("simple_string", _strings(in0), _strings(in1), "BYTES")):
                if dt == "BYTES":
                    s0, s1 = tutils.serialize_byte_tensor(x0), tutils.serialize_byte_tensor(x1)
                    blobs = [s0.item(), s1.item()]
                    want0 = tutils.serialize_byte_tensor(_strings(in0 + in1)).item()
                    want1 = tutils.serialize_byte_tensor(_strings(in0 - in1)).item()
                    osize = [len(want0), len(want1)]
                else:
                    blobs = [x0.tobytes(), x1.tobytes()]
                    osize = [64, 64]
                regions = []
                for i, (name, size) in enumerate((("input0", len(blobs[0])), ("input1", len(blobs[1])),
                                                  ("output0", osize[0]), ("output1", osize[1]))):
                    key, handle = _region(name, size)
                    handles.append(handle)
                    regions.append((f"{name}_{model}", key, handle, size))
                    if i < 2:
                        tshm.set_shared_memory_region(handle, [np.frombuffer(blobs[i], np.uint8)])
                    c.register_system_shared_memory(f"{name}_{model}", key, size, headers=AUTH)
                ins = [mod.InferInput("INPUT0", [1, 16], dt), mod.InferInput("INPUT1", [1, 16], dt)]
                ins[0].set_shared_memory(regions[0][0], regions[0][3])
                ins[1].set_shared_memory(regions[1][0], regions[1][3])
                outs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
                outs[0].set_shared_memory(regions[2][0], regions[2][3])
                outs[1].set_shared_memory(regions[3][0], regions[3][3])
                r = c.infer(model, ins, outputs=outs, headers=AUTH)
                o0, o1 = r.get_output("OUTPUT0"), r.get_output("OUTPUT1")
                got = []
                for o, reg in ((o0, regions[2]), (o1, regions[3])):
                    dtype = o["datatype"] if isinstance(o, dict) else o.datatype
                    shape = o["shape"] if isinstance(o, dict) else list(o.shape)
                    got.append(tshm.get_contents_as_numpy(reg[2], tutils.triton_to_np_dtype(dtype), shape))
                if dt == "BYTES":
                    assert got[0].ravel().tolist() == _strings(in0 + in1).ravel().tolist()
                    assert got[1].ravel().tolist() == _strings(in0 - in1).ravel().tolist()
                else:
                    _check_add_sub(in0, in1, got[0].ravel(), got[1].ravel())
            status = c.get_system_shared_memory_status(headers=AUTH, **({"as_json": True} if c is g else {}))
            assert len(status if c is h else status["regions"]) == 8
            c.unregister_system_shared_memory(headers=AUTH)
    finally:
        h.close()
        g.close()
        for handle in handles:
            tshm.destroy_shared_memory_region(handle)


# ---- a real string model on every transport -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_reference(daemon: Daemon) -> dict[str, np.ndarray]:
    """Raw ONNX Runtime fed the sentences as ``str`` (the form its string tensors take)."""
    if not daemon.text:
        pytest.skip("skl2onnx (the dev extra) is not installed")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(daemon.tmp / "models" / "text_classifier" / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    label, probs = sess.run(["label", "probabilities"], {"text": np.array(QUERIES, dtype=object).reshape(-1, 1)})
    assert set(label.tolist()) == {0, 1}  # both classes among the queries: the check can tell them apart
    # the model is what scikit-learn fitted: ONNX Runtime fed str answers as scikit-learn itself does
    np.testing.assert_allclose(probs, daemon.sklearn.predict_proba(QUERIES), atol=1e-6)
    np.testing.assert_array_equal(label, daemon.sklearn.predict(QUERIES))
    return {"label": label, "probabilities": probs}


def _sentences() -> np.ndarray:
    return np.array([q.encode() for q in QUERIES], dtype=np.object_).reshape(-1, 1)


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], how: str) -> None:
    np.testing.assert_array_equal(np.asarray(got["label"]).reshape(-1), want["label"], err_msg=how)
    np.testing.assert_array_equal(np.asarray(got["probabilities"], np.float32).reshape(want["probabilities"].shape),
                                  want["probabilities"], err_msg=how)


def test_text_classifier_answers_like_onnx_runtime_on_every_transport(
        daemon: Daemon, text_reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    from edged.client.grpc import GrpcClient
    from edged.client.http import HttpClient
    from edged.client.mqtt import MqttClient
    from edged.client.shm import ShmClient
    from edged.config import parse_config
    from edged.core.manager import ModelManager
    from edged.core.service import InferenceService
    from edged.protocol.types import InferRequest
    from tests.http_helpers import ORT

    x = _sentences()
    # in-process: the inference service itself, on a copy of the model
    shutil.copytree(daemon.tmp / "models" / "text_classifier", tmp_path / "models" / "text_classifier")
    manager = ModelManager(tmp_path / "models", parse_config('[device]\nid = "x"\n').models, ORT)
    manager.load_all()
    try:
        _same(InferenceService(manager).infer(InferRequest("text_classifier", {"text": x})).outputs,
              text_reference, "in-process")
    finally:
        manager.shutdown()
    with HttpClient(daemon.http) as c:
        _same(c.infer("text_classifier", {"text": x}, binary=False), text_reference, "HTTP JSON")
        _same(c.infer("text_classifier", {"text": x}, binary=True), text_reference, "HTTP binary")
    g = GrpcClient(daemon.grpc)
    try:
        _same(g.infer("text_classifier", {"text": x}), text_reference, "gRPC raw contents")
    finally:
        g.close()
    tg = grpcclient.InferenceServerClient(daemon.grpc)
    try:  # gRPC typed bytes_contents
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        req = service_pb2.ModelInferRequest(model_name="text_classifier")
        req.inputs.add(name="text", datatype="BYTES", shape=list(x.shape)).contents.bytes_contents.extend(x.ravel())
        resp = service_pb2_grpc.GRPCInferenceServiceStub(tg._channel).ModelInfer(req)
        outs = {o.name: (o, raw) for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
        _same({n: np.frombuffer(raw, tutils.triton_to_np_dtype(o.datatype)) for n, (o, raw) in outs.items()},
              text_reference, "gRPC bytes_contents")
    finally:
        tg.close()
    with MqttClient(daemon.broker.url, "triton-test") as m:
        _same(m.infer("text_classifier", {"text": x}, timeout=30), text_reference, "MQTT")
    with ShmClient(str(daemon.sock)) as s:
        _same(s.infer("text_classifier", {"text": x}), text_reference, "native shm")
    # system shared memory through tritonclient, the token in headers=
    h = httpclient.InferenceServerClient(daemon.http)
    blob = tutils.serialize_byte_tensor(x).item()
    key, handle = _region("text", len(blob))
    okey, ohandle = _region("probs", 4 * x.shape[0] * 2)
    try:
        tshm.set_shared_memory_region(handle, [np.frombuffer(blob, np.uint8)])
        h.register_system_shared_memory("text_in", key, len(blob), headers=AUTH)
        h.register_system_shared_memory("probs_out", okey, 4 * x.shape[0] * 2, headers=AUTH)
        inp = httpclient.InferInput("text", list(x.shape), "BYTES")
        inp.set_shared_memory("text_in", len(blob))
        outs = [httpclient.InferRequestedOutput("label"), httpclient.InferRequestedOutput("probabilities")]
        outs[1].set_shared_memory("probs_out", 4 * x.shape[0] * 2)
        r = h.infer("text_classifier", [inp], outputs=outs, headers=AUTH)
        probs = tshm.get_contents_as_numpy(ohandle, np.float32, [x.shape[0], 2])
        _same({"label": r.as_numpy("label"), "probabilities": probs}, text_reference, "system shm")
    finally:
        h.unregister_system_shared_memory(headers=AUTH)
        h.close()
        tshm.destroy_shared_memory_region(handle)
        tshm.destroy_shared_memory_region(ohandle)


def test_a_pipelines_bytes_reach_its_model_step_as_text_and_its_custom_step_as_bytes(
        daemon: Daemon, text_reference: dict[str, np.ndarray]) -> None:
    x = _sentences()
    want_tags = [q.encode() + b" -> " + NAMES[int(label)] for q, label in zip(QUERIES, text_reference["label"],
                                                                                 strict=True)]
    h = httpclient.InferenceServerClient(daemon.http)
    g = grpcclient.InferenceServerClient(daemon.grpc)
    try:
        for c, mod, binary in ((h, httpclient, True), (h, httpclient, False), (g, grpcclient, True)):
            inp = mod.InferInput("text", list(x.shape), "BYTES")
            if c is h:
                inp.set_data_from_numpy(x, binary_data=binary)
                outs = [mod.InferRequestedOutput(n, binary_data=binary) for n in ("probabilities", "tagged")]
            else:
                inp.set_data_from_numpy(x)
                outs = [mod.InferRequestedOutput(n) for n in ("probabilities", "tagged")]
            r = c.infer("text_pipeline", [inp], outputs=outs)
            np.testing.assert_array_equal(r.as_numpy("probabilities"), text_reference["probabilities"])
            tags = [t if isinstance(t, bytes) else str(t).encode() for t in r.as_numpy("tagged").ravel()]
            assert tags == want_tags, (binary, tags)
    finally:
        h.close()
        g.close()
