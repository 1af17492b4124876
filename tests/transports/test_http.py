"""The HTTP transport against real clients: tritonclient.http (an independent implementation), edged's own
client, and raw sockets for what well-behaved clients never send."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.http as th
import tritonclient.utils.shared_memory as tshm
from tritonclient.utils import InferenceServerException

from edged.client.http import HttpClient, HttpStatusError
from edged.errors import EdgedError, ErrorCode
from edged.listen import parse_listen
from edged.protocol.types import InferRequest
from edged.transports.v2_ops import LOOP_INLINE_MAX_NS
from tests.http_helpers import AUTH, Served, copy_models, held_engine, in_process, served

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("http")
    with served(copy_models(tmp / "models", "digits", "mobilenet"), tmp,
                extra='[shm]\nsystem_shm_prefix = "httptest_"\n') as s:
        yield s


@pytest.fixture(scope="module")
def small_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A 1 MB request limit (for 413)."""
    tmp = tmp_path_factory.mktemp("http-small")
    with served(copy_models(tmp / "models", "digits"), tmp, extra="max_request_mb = 1\n") as s:
        assert s.cfg.http.max_request_mb == 1
        yield s


@pytest.fixture
def triton(srv: Served) -> Iterator[th.InferenceServerClient]:
    c = th.InferenceServerClient(srv.url)
    yield c
    c.close()


def raw_http(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are and read one response (for malformed or unusual requests)."""
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        need = int(headers.get("content-length", "0"))
        while len(body) < need:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, headers, body


# ---- tritonclient interoperability ------------------------------------------------------------
def test_health_and_server_metadata(triton: th.InferenceServerClient) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    meta = triton.get_server_metadata()
    assert meta["name"] == "edged"
    assert "system_shared_memory" in meta["extensions"] and "binary_tensor_data" in meta["extensions"]
    assert triton.is_model_ready("digits")
    assert triton.is_model_ready("digits", "1")
    assert not triton.is_model_ready("no-such-model")


def test_model_metadata_and_config(triton: th.InferenceServerClient) -> None:
    meta = triton.get_model_metadata("digits")
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    cfg = triton.get_model_config("digits")
    assert cfg["name"] == "digits"
    assert cfg["max_batch_size"] == 64
    assert cfg["platform"] == "onnxruntime_onnx" and cfg["backend"] == "onnxruntime"
    assert cfg["input"][0] == {"name": "pixels", "data_type": "TYPE_FP32", "dims": [64], "format": "FORMAT_NONE",
                               "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False}
    assert cfg["output"][0]["data_type"] == "TYPE_FP32" and cfg["output"][0]["dims"] == [10]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [8, 16]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU" and cfg["instance_group"][0]["count"] == 1
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert triton.get_model_config("mobilenet", "1")["input"][0]["dims"] == [3, 48, 192]
    threads = {k: v["string_value"] for k, v in cfg["parameters"].items() if k.startswith("edged_engine_")}
    assert threads["edged_engine_pool"] == "per session" and threads["edged_engine_spin_us"] == "2000", threads
    assert int(threads["edged_engine_intra_op_threads"]) >= 0, threads


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_infers_digits_like_in_process(srv: Served, triton: th.InferenceServerClient,
                                                    digits_holdout: tuple[np.ndarray, np.ndarray],
                                                    binary: bool) -> None:
    x, y = digits_holdout
    batch = x[:64]
    inp = th.InferInput("pixels", list(batch.shape), "FP32")
    inp.set_data_from_numpy(batch, binary_data=binary)
    out = th.InferRequestedOutput("probabilities", binary_data=binary)
    result = triton.infer("digits", [inp], outputs=[out], request_id="r-1")
    got = result.as_numpy("probabilities")
    assert result.get_response()["id"] == "r-1"
    assert got.shape == (64, 10) and got.dtype == np.float32
    want = in_process(srv, "digits", batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (got.argmax(1) == y[:64]).mean() > 0.9


def test_tritonclient_default_outputs_are_binary(srv: Served, triton: th.InferenceServerClient,
                                                 digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    inp = th.InferInput("pixels", [3, 64], "FP32")
    inp.set_data_from_numpy(x[:3])
    result = triton.infer("digits", [inp], model_version="1")
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 3 * 10 * 4
    np.testing.assert_allclose(result.as_numpy("probabilities"), in_process(srv, "digits", x[:3]), rtol=1e-5)


def test_repeated_binary_headers_are_decoded_by_plan(srv: Served, triton: th.InferenceServerClient,
                                                     digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """A client streaming frames repeats its header: after the first, requests skip parsing it (v2_plans)
    and get the same answers; a body that does not fit the remembered header is judged afresh."""
    x, _ = digits_holdout
    plans = srv.transport.app.plans
    hits = plans.hits
    for k in range(4):
        batch = x[2 * k:2 * k + 2]
        inp = th.InferInput("pixels", [2, 64], "FP32")
        inp.set_data_from_numpy(batch, binary_data=True)
        result = triton.infer("digits", [inp], outputs=[th.InferRequestedOutput("probabilities", binary_data=True)])
        np.testing.assert_allclose(result.as_numpy("probabilities"), in_process(srv, "digits", batch),
                                   rtol=1e-5, atol=1e-6)
    assert plans.hits - hits >= 3
    header = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 64],
                                       "parameters": {"binary_data_size": 2 * 64 * 4}}],
                           "parameters": {"binary_data_output": True}})
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    with HttpClient(srv.url) as http:
        for k in range(3):
            reply = http.request("POST", "/v2/models/digits/infer", [header, x[k:k + 2].tobytes()], headers)
            assert reply.status == 200
            hlen = int(reply.header("Inference-Header-Content-Length") or 0)
            got = np.frombuffer(reply.body[hlen:], dtype=np.float32).reshape(2, 10)
            np.testing.assert_allclose(got, in_process(srv, "digits", x[k:k + 2]), rtol=1e-5, atol=1e-6)
        short = http.request("POST", "/v2/models/digits/infer", [header, x[:1].tobytes()], headers)
        assert short.status == 400 and b"binary_data_size 512 goes past the end of the body" in short.body
        long = http.request("POST", "/v2/models/digits/infer", [header, x[:3].tobytes()], headers)
        assert long.status == 400 and b"256 bytes of binary data are not claimed by any input" in long.body
        lie = header.replace(b"[2,64]", b"[3,64]")
        for _ in range(2):
            refused = http.request("POST", "/v2/models/digits/infer", [lie, x[:2].tobytes()],
                                   {**headers, "Inference-Header-Content-Length": str(len(lie))})
            assert refused.status == 400 and b"shape [3, 64] of FP32 needs 768" in refused.body


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests(srv: Served, triton: th.InferenceServerClient,
                                          digits_holdout: tuple[np.ndarray, np.ndarray], algorithm: str) -> None:
    x, _ = digits_holdout
    inp = th.InferInput("pixels", [4, 64], "FP32")
    inp.set_data_from_numpy(x[:4])
    result = triton.infer("digits", [inp], request_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("probabilities"), in_process(srv, "digits", x[:4]), rtol=1e-5)


def test_tritonclient_system_shared_memory(srv: Served, triton: th.InferenceServerClient,
                                           digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    batch = np.ascontiguousarray(x[:16])
    out_bytes = 16 * 10 * 4
    tag = uuid.uuid4().hex[:8]
    in_h = tshm.create_shared_memory_region(f"in_{tag}", f"/httptest_in_{tag}", batch.nbytes)
    out_h = tshm.create_shared_memory_region(f"out_{tag}", f"/httptest_out_{tag}", out_bytes)
    try:
        tshm.set_shared_memory_region(in_h, [batch])
        triton.register_system_shared_memory(f"in_{tag}", f"/httptest_in_{tag}", batch.nbytes, headers=AUTH)
        triton.register_system_shared_memory(f"out_{tag}", f"/httptest_out_{tag}", out_bytes, headers=AUTH)
        status = triton.get_system_shared_memory_status(headers=AUTH)
        names = {r["name"] for r in status}
        assert {f"in_{tag}", f"out_{tag}"} <= names
        one = triton.get_system_shared_memory_status(f"in_{tag}", headers=AUTH)
        assert one[0]["byte_size"] == batch.nbytes

        inp = th.InferInput("pixels", [16, 64], "FP32")
        inp.set_shared_memory(f"in_{tag}", batch.nbytes)
        out = th.InferRequestedOutput("probabilities", binary_data=True)
        out.set_shared_memory(f"out_{tag}", out_bytes)
        result = triton.infer("digits", [inp], outputs=[out], headers=AUTH)
        # Described as Triton does: name, datatype and shape, no parameters, no data.
        assert result.get_output("probabilities") == {"name": "probabilities", "datatype": "FP32", "shape": [16, 10]}
        got = tshm.get_contents_as_numpy(out_h, np.float32, [16, 10])
        np.testing.assert_allclose(got, in_process(srv, "digits", batch), rtol=1e-5, atol=1e-6)
        # Registered with the token, used without it: unknown to that request, which is told why and what to send.
        with pytest.raises(InferenceServerException) as e:
            triton.infer("digits", [inp], outputs=[out])
        assert e.value.status() == "400" and "scoped to whoever registered them" in e.value.message()
        assert "send 'Authorization: Bearer <[control] token>'" in e.value.message()

        # An input at an offset inside a larger region, JSON output.
        triton.unregister_system_shared_memory(f"in_{tag}", headers=AUTH)
        with pytest.raises(InferenceServerException) as e:
            triton.infer("digits", [inp], outputs=[out], headers=AUTH)
        assert e.value.status() == "400" and "not registered" in e.value.message()
        triton.register_system_shared_memory(f"in_{tag}", f"/httptest_in_{tag}", batch.nbytes, headers=AUTH)
        inp2 = th.InferInput("pixels", [1, 64], "FP32")
        inp2.set_shared_memory(f"in_{tag}", 64 * 4, offset=5 * 64 * 4)
        single = triton.infer("digits", [inp2], headers=AUTH).as_numpy("probabilities")
        np.testing.assert_allclose(single, in_process(srv, "digits", batch[5:6]), rtol=1e-5, atol=1e-6)
    finally:
        triton.unregister_system_shared_memory(headers=AUTH)
        tshm.destroy_shared_memory_region(in_h)
        tshm.destroy_shared_memory_region(out_h)
    assert triton.get_system_shared_memory_status(headers=AUTH) == []


def test_statistics_and_metrics(srv: Served, triton: th.InferenceServerClient,
                                digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    with HttpClient(srv.url) as c:
        c.infer("digits", {"pixels": x[:2]})
    stats = triton.get_inference_statistics("digits")["model_stats"]
    assert stats[0]["name"] == "digits" and stats[0]["inference_stats"]["success"]["count"] >= 1
    all_stats = triton.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in all_stats} == {"digits", "mobilenet"}
    assert triton.get_inference_statistics("digits", "1")["model_stats"][0]["version"] == "1"
    status, headers, body = raw_http(srv.url, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert 'edged_inference_request_success_total{backend="onnxruntime",model="digits",version="1"}' in text
    assert 'edged_model_ready{model="mobilenet",version="1"} 1.0' in text
    assert "process_resident_memory_bytes" in text


# ---- edged's own client -----------------------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_edged_client_mobilenet(srv: Served, binary: bool) -> None:
    x = np.random.default_rng(1).random((2, 3, 48, 192), dtype=np.float32)
    with HttpClient(srv.url) as c:
        assert c.live() and c.ready() and c.ready("mobilenet")
        assert c.metadata("mobilenet")["outputs"][0]["shape"] == [-1, 37]
        got = c.infer("mobilenet", {"image": x}, binary=binary)["probabilities"]
    np.testing.assert_allclose(got, in_process(srv, "mobilenet", x), rtol=1e-5, atol=1e-6)


def test_concurrent_clients(srv: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    want = in_process(srv, "digits", x[:48])
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with HttpClient(srv.url) as c:
                for i in range(25):
                    j = (k * 7 + i) % 48
                    got = c.infer("digits", {"pixels": x[j:j + 1]}, binary=bool(i % 2))["probabilities"]
                    np.testing.assert_allclose(got[0], want[j], rtol=1e-4, atol=1e-6)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish"
    assert not errors, errors[0]


# ---- errors -----------------------------------------------------------------------------------
def test_unknown_model_is_404(srv: Served, triton: th.InferenceServerClient) -> None:
    inp = th.InferInput("pixels", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), np.float32))
    with pytest.raises(InferenceServerException) as e:
        triton.infer("no-such-model", [inp])
    assert e.value.status() == "404"
    assert "no-such-model" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        triton.get_model_metadata("no-such-model")
    assert e.value.status() == "404"
    with HttpClient(srv.url) as c, pytest.raises(HttpStatusError) as ce:
        c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)}, version=7)
    assert ce.value.status == 404 and ce.value.code is ErrorCode.NOT_FOUND


def test_bad_requests_are_400_and_name_the_problem(srv: Served) -> None:
    with HttpClient(srv.url) as c:
        with pytest.raises(HttpStatusError) as e:
            c.infer("digits", {"pixels": np.zeros((1, 63), np.float32)})
        assert e.value.status == 400 and "'pixels'" in e.value.message
        with pytest.raises(HttpStatusError) as e:
            c.infer("digits", {"pixels": np.zeros((1, 64), np.float64)})
        assert e.value.status == 400 and "FP64" in e.value.message
        with pytest.raises(HttpStatusError) as e:
            c.infer("digits", {"wrong": np.zeros((1, 64), np.float32)})
        assert e.value.status == 400 and "wrong" in e.value.message
        # still serving
        assert c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})["probabilities"].shape == (1, 10)
        for body, needle in [(b"{bad", "not valid JSON"), (b"[1,2]", "JSON object"), (b"{}", "inputs"),
                             (b'{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"data":"x"}]}',
                              "pixels")]:
            r = c.request("POST", "/v2/models/digits/infer", [body])
            assert r.status == 400, body
            assert needle in orjson.loads(r.body)["error"]
        # binary framing that does not add up
        r = c.request("POST", "/v2/models/digits/infer", [b'{"inputs":[]}'],
                      {"Inference-Header-Content-Length": "500"})
        assert r.status == 400 and "outside the body" in orjson.loads(r.body)["error"]
        r = c.request("POST", "/v2/models/digits/versions/abc/infer", [b"{}"])
        assert r.status == 400
        r = c.request("POST", "/v2/models/digits/infer", [b"{}"], {"Content-Encoding": "br"})
        assert r.status == 415


def test_routes_methods_and_statuses(srv: Served) -> None:
    with HttpClient(srv.url) as c:
        r = c.request("GET", "/v2/models/digits/infer")
        assert r.status == 405 and r.header("Allow") == "POST"
        assert orjson.loads(r.body) == {"error": "method GET is not allowed here"}
        assert c.request("GET", "/v3/anything").status == 404
        assert c.request("GET", "/v2/models/digits/nonsense").status == 404
        assert c.request("DELETE", "/v2/health/live").status == 405
        r = c.request("GET", "/v2/models/%2E%2E%2Fetc/config")
        assert r.status == 404 and orjson.loads(r.body)["error"]
        assert c.request("POST", "/v2/repository/models/..%2F..%2Fetc/load", [b"{}"], AUTH).status == 404


def test_deadline_from_timeout_parameter_is_504(srv: Served) -> None:
    header = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}],
              "parameters": {"timeout": 1}}
    with HttpClient(srv.url) as c:
        r = c.request("POST", "/v2/models/digits/infer", [orjson.dumps(header)])
        assert r.status == 504
        assert "deadline" in orjson.loads(r.body)["error"]


def test_oversize_body_is_413(small_srv: Served) -> None:
    big = b"x" * (1024 * 1024 + 10)
    with HttpClient(small_srv.url) as c:
        r = c.request("POST", "/v2/models/digits/infer", [big])
        assert r.status == 413 and "max_request_mb" in orjson.loads(r.body)["error"]
    # chunked, no Content-Length: counted while it arrives
    chunk = b"x" * 65536
    req = b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    req += b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20)) + b"0\r\n\r\n"
    try:
        status, _, _ = raw_http(small_srv.url, req)
        assert status == 413
    except ConnectionResetError:
        pass  # the server may close before the client finished sending: also a refusal
    # and a gzip bomb is cut off at the limit too
    bomb = gzip.compress(b"\0" * (4 * 1024 * 1024))
    with HttpClient(small_srv.url) as c:
        r = c.request("POST", "/v2/models/digits/infer", [bomb], {"Content-Encoding": "gzip"})
        assert r.status == 413
        assert c.ready()


def test_an_inflated_body_over_the_limit_is_413_and_the_connection_serves_on(small_srv: Served) -> None:
    """The body was read whole before it inflated past the limit: 413 without 'connection: close' (the
    server keeps the connection, and the answer must not say otherwise), and the next request is served."""
    bomb = gzip.compress(b"0" * (2 << 20))
    with connect(small_srv.url) as s:
        s.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(bomb), bomb)
                  + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        (status, headers, _), (live, _, _) = read_responses(s, 2)
    assert (status, live) == (413, 200)
    assert b"connection" not in headers


def test_binary_requests_reserve_what_their_json_header_decodes_to(srv: Served) -> None:
    """Tensor data written as JSON in a binary request's header becomes new arrays, reserved in the memory
    budget as for a JSON body (it was left out: only views of the body were assumed)."""
    n = 64 * 64
    payload = (b'{"inputs":[{"name":"pixels","datatype":"FP32","shape":[64,64],"data":['
               + b",".join([b"1"] * n) + b"]}]}")
    budget = srv.service.budget
    held: dict[str, int] = {}
    for form, extra in (("json", b""), ("binary", b"Inference-Header-Content-Length: %d\r\n" % len(payload))):
        with connect(srv.url) as s:
            with held_engine(srv.service, "digits") as entered:
                s.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                          % len(payload) + extra + b"\r\n" + payload)
                assert entered.wait(30), "the request never reached the model"
                held[form] = budget.used  # the request's hold, while its model runs
            (status, _, _), = read_responses(s, 1)
            assert status == 200
    assert held["binary"] == held["json"] >= 2 * len(payload) + 4 * n, held


def test_a_body_of_many_bytes_elements_is_decoded_off_the_loop(srv: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """BYTES elements are slow to decode (tens of ms for a body well under the 1 MiB thread threshold): a
    body naming BYTES past a few KiB is decoded in a worker thread, even for a model that does not exist;
    a small one stays on the loop (the lone-request path)."""
    app = srv.transport.app
    where: list[threading.Thread] = []
    decode = app._decode

    def spy(*args: object) -> object:
        where.append(threading.current_thread())
        return decode(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(app, "_decode", spy)
    for count in (16, 16384):  # 4-byte elements: 64 B, then 64 KiB of them
        header = orjson.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [count],
                                           "parameters": {"binary_data_size": 4 * count}}]})
        body = header + b"\0\0\0\0" * count
        with connect(srv.url) as s:
            s.sendall(b"POST /v2/models/no-such-model/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(header), len(body), body))
            (status, _, _), = read_responses(s, 1)
        assert status == 404
    assert [t is srv.thread for t in where] == [True, False]


def test_overloaded_is_503_with_retry_after(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "mobilenet")
    toml = repo / "mobilenet" / "1" / "model.toml"
    toml.write_text(toml.read_text().replace("[batching]\n", "[batching]\nmax_queue_size = 1\n"))
    img = np.zeros((1, 3, 48, 192), np.float32)
    with served(repo, tmp_path) as s, HttpClient(s.url) as c:
        with held_engine(s.service, "mobilenet") as inside:
            running = s.service.submit(InferRequest("mobilenet", {"image": img}))
            assert inside.wait(30), "the held engine never got the first request"
            queued = s.service.submit(InferRequest("mobilenet", {"image": img}))  # takes the one slot
            with pytest.raises(HttpStatusError) as full:
                c.infer("mobilenet", {"image": img})
            r = c.request("POST", "/v2/models/mobilenet/infer",
                          [b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,3,48,192],"data":[' +
                           b",".join([b"0"] * (3 * 48 * 192)) + b"]}]}"])
        running.result(30)
        queued.result(30)
        assert full.value.status == 503 and full.value.code is ErrorCode.OVERLOADED
        assert "queue full" in full.value.message
        assert r.status == 503 and r.header("retry-after") == "1", (r.status, r.headers)
        assert c.infer("mobilenet", {"image": img})["probabilities"].shape == (1, 37)


def test_errors_never_show_internal_paths(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.toml").write_text(
        'max_batch_size = 0\n[[variants]]\nfile = "model.onnx"\nformat = "onnx"\nsha256 = "' + "0" * 64 + '"\n')
    with served(repo, tmp_path) as s, HttpClient(s.url) as c:
        bodies = [
            c.request("POST", "/v2/repository/index", [b"{}"]).body,
            c.request("GET", "/v2/models/broken").body,
            c.request("GET", "/v2/models/broken/config").body,
            c.request("POST", "/v2/repository/models/broken/load", [b"{}"], AUTH).body,
            c.request("POST", "/v2/models/broken/infer",
                      [b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}']).body,
        ]
        for b in bodies:
            assert str(tmp_path).encode() not in b, b
        index = orjson.loads(bodies[0])
        assert {"name": "digits", "version": "1", "state": "READY", "reason": ""} in index
        assert any(e["name"] == "broken" and e["state"] == "UNAVAILABLE" for e in index)
        assert not s.service.is_ready("broken")
        assert c.request("GET", "/v2/models/broken/ready").status == 503


def test_repository_load_unload(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits", "mobilenet")
    with served(repo, tmp_path) as s:
        t = th.InferenceServerClient(s.url)
        try:
            # without the management credential: refused, and nothing changes
            for kw, status in (({}, "401"), ({"headers": {"Authorization": "Bearer wrong-token-0123456789"}}, "403")):
                with pytest.raises(InferenceServerException) as e:
                    t.unload_model("mobilenet", **kw)
                assert e.value.status() == status and "management" in e.value.message()
                with pytest.raises(InferenceServerException) as e:
                    t.load_model("mobilenet", **kw)
                assert e.value.status() == status
            assert t.is_model_ready("mobilenet")
            t.unload_model("mobilenet", headers=AUTH)
            assert not t.is_model_ready("mobilenet")
            index = {e["name"]: e for e in t.get_model_repository_index()}
            assert index["mobilenet"]["state"] == "UNAVAILABLE" and index["digits"]["state"] == "READY"
            with pytest.raises(InferenceServerException) as e:
                t.unload_model("mobilenet", headers=AUTH)
            assert e.value.status() == "404"
            t.load_model("mobilenet", headers=AUTH)
            assert t.is_model_ready("mobilenet")
            with pytest.raises(InferenceServerException) as e:
                t.load_model("digits", config='{"max_batch_size": 2}', headers=AUTH)
            assert e.value.status() == "400" and "not supported" in e.value.message()
            with pytest.raises(InferenceServerException) as e:
                t.load_model("absent", headers=AUTH)
            assert e.value.status() == "404"
        finally:
            t.close()


def test_unix_socket(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    sock = tmp_path / "run" / "http.sock"
    with served(repo, tmp_path, listen=f"unix:{sock}") as s:
        assert s.url == f"unix:{sock}" and sock.exists() and s.transport.port is None
        with HttpClient(str(sock)) as c:
            assert c.ready()
            out = c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})
            assert out["probabilities"].shape == (1, 10)
        with pytest.raises(EdgedError, match="another server"), served(repo, tmp_path / "b", listen=str(sock)):
            pass
    assert not sock.exists()


def test_bind_errors_name_the_address(srv: Served, tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    with pytest.raises(EdgedError) as e:
        Served(repo, tmp_path, listen=srv.url, load=False)
    assert srv.url in str(e.value)
    with pytest.raises(EdgedError, match="host:port"):
        parse_listen("nonsense")
    assert parse_listen("[::1]:8000") == ("::1", 8000)
    assert parse_listen(":9000") == ("0.0.0.0", 9000)
    assert parse_listen("unix:/run/x.sock") == Path("/run/x.sock")


def test_stop_closes_the_listener(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    s = Served(repo, tmp_path)
    url = s.url
    with HttpClient(url) as c:
        assert c.ready()
    s.close()
    with HttpClient(url, timeout=2) as c, pytest.raises(EdgedError) as e:
        c.live()
    assert e.value.code is ErrorCode.UNAVAILABLE


def test_unexpected_exception_is_500_and_server_goes_on(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    with served(repo, tmp_path) as s, HttpClient(s.url) as c:
        def broken_metrics() -> tuple[bytes, str]:
            raise RuntimeError(f"secret detail {tmp_path}")

        s.transport.app.metrics = broken_metrics  # fault injection into a collaborator, not the app
        r = c.request("GET", "/metrics")
        assert r.status == 500
        assert orjson.loads(r.body) == {"error": "internal error"}
        assert "secret detail" in caplog.text  # logged with its traceback for the operator
        assert c.live()
        assert c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})["probabilities"].shape == (1, 10)


# ---- the HTTP/1.1 server itself ---------------------------------------------------------------
def read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Parse ``count`` responses off a socket (pipelined answers arrive back to back)."""
    import httptools

    out: list[tuple[int, dict[bytes, bytes], bytes]] = []

    class Collect:
        def __init__(self) -> None:
            self.headers: dict[bytes, bytes] = {}
            self.body = b""

        def on_header(self, k: bytes, v: bytes) -> None:
            self.headers[k.lower()] = v

        def on_body(self, b: bytes) -> None:
            self.body += b

        def on_message_complete(self) -> None:
            out.append((parser.get_status_code(), self.headers, self.body))
            self.headers, self.body = {}, b""

    parser = httptools.HttpResponseParser(Collect())
    while len(out) < count:
        data = sock.recv(65536)
        if not data:
            break
        parser.feed_data(data)
    return out


def connect(url: str) -> socket.socket:
    host, port = url.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_pipelined_requests_are_answered_in_order(srv: Served) -> None:
    infer = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [1.0] * 64}]})
    reqs = (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
                len(infer), infer)
            + b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
    with connect(srv.url) as s:
        s.sendall(reqs)
        got = read_responses(s, 4)
    assert [g[0] for g in got] == [200, 200, 404, 200]
    assert orjson.loads(got[1][2])["outputs"][0]["shape"] == [1, 10]
    assert all(b"date" in g[1] for g in got)
    with connect(srv.url) as s:  # HEAD: the GET's headers, no body
        s.sendall(b"HEAD /v2 HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 200 OK") < 2:
            data += s.recv(65536)
        head = data.split(b"\r\n\r\n")[0].lower()
        assert f"content-length: {len(got[3][2])}".encode() in head
        assert data.split(b"\r\n\r\n")[1].startswith(b"HTTP/1.1 200 OK")


def test_expect_continue_http10_and_malformed(srv: Served) -> None:
    body = b'{"ready": true}'
    with connect(srv.url) as s:
        s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(body)
        (status, _, data), = read_responses(s, 1)
        assert status == 200 and {e["name"] for e in orjson.loads(data)} == {"digits", "mobilenet"}
    with connect(srv.url) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
        (status, headers, _), = read_responses(s, 1)
        assert status == 200 and headers[b"connection"] == b"close"
        assert s.recv(10) == b""  # closed after the answer
    with connect(srv.url) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        (status, _, data), = read_responses(s, 1)
        assert status == 400 and "malformed" in orjson.loads(data)["error"]
    with connect(srv.url) as s:
        s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
        (status, _, _), = read_responses(s, 1)
        assert status == 431
    with HttpClient(srv.url) as c:
        assert c.live()


def _wait_no_connections(s: Served, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while s.transport.open_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.transport.open_connections == 0


def test_slow_and_idle_connections_are_closed(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    with served(repo, tmp_path) as s:
        limits = s.transport.limits
        # The short keep-alive is set only once a request was answered: a connection that is slow to
        # send its first request (a loaded machine) must not be closed before the test gets to it.
        with connect(s.url) as sock:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_responses(sock, 1)[0][0] == 200
            limits.keep_alive_s = 0.2
            sock.settimeout(10)
            assert sock.recv(10) == b""  # idle past keep-alive: closed by the server
        limits.keep_alive_s = 60
        limits.request_timeout_s = 0.3
        with connect(s.url) as sock:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # headers never finish
            sock.settimeout(10)
            (status, _, _), = read_responses(sock, 1)
            assert status == 408
        _wait_no_connections(s)  # the two connections above are gone
        with HttpClient(s.url) as c:
            assert c.live()
            assert s.transport.open_connections == 1  # kept open for the next request
            limits.keep_alive_s = 0.2
            _wait_no_connections(s)  # dropped by the server while idle
            assert c.live()  # the client reconnects by itself


def _receiving_a_request(s: Served) -> bool:
    """Whether some connection is in the middle of receiving a request (the server's own state)."""
    server = s.transport._server
    return server is not None and any(c._in_message for c in list(server._state.connections))


def test_graceful_stop_answers_the_request_in_progress(tmp_path: Path) -> None:
    import asyncio

    repo = copy_models(tmp_path / "models", "digits")
    with served(repo, tmp_path) as s:
        body = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                         "data": [2.0] * 64}]})
        with connect(s.url) as sock:
            sock.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body[:50])
            deadline = time.monotonic() + 10
            while not _receiving_a_request(s):  # the partial request reached the server
                assert time.monotonic() < deadline, "the server never saw the request begin"
                time.sleep(0.01)
            stopping = asyncio.run_coroutine_threadsafe(s.transport.stop(), s.loop)
            deadline = time.monotonic() + 10
            while True:  # the listener closes soon after the stop begins: poll, do not guess how soon
                try:
                    connect(s.url).close()
                except OSError:
                    break  # no longer accepting
                assert time.monotonic() < deadline, "still accepting connections 10 s after the stop began"
                time.sleep(0.01)
            assert not stopping.done()
            sock.sendall(body[50:])
            (status, headers, data), = read_responses(sock, 1)
            assert status == 200 and headers[b"connection"] == b"close"
            assert orjson.loads(data)["outputs"][0]["shape"] == [1, 10]
            stopping.result(10)


def test_a_lone_request_runs_on_the_loop_and_pipelined_ones_are_queued(
        tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """Serial requests skip the worker hand-off (the model is idle, its runs short); requests that
    arrive together are queued for the batcher; every answer is the in-process one, counted once."""
    x, _ = digits_holdout
    with served(copy_models(tmp_path / "models", "digits"), tmp_path) as s:
        want = in_process(s, "digits", x[:40])
        before = s.service.statistics("digits")[0]
        sched = s.service.ready_model("digits").scheduler
        assert sched is not None
        short_enough = 0  # requests the loop may run: a host stall (a 30 us run once took 50 ms on a
        with HttpClient(s.url) as c:  # loaded CI machine) lifts the average over the limit for ~8 runs
            for i in range(20):
                short_enough += sched.short_enough(x[i:i + 1].nbytes, LOOP_INLINE_MAX_NS)
                got = c.infer("digits", {"pixels": x[i:i + 1]}, binary=bool(i % 2))["probabilities"]
                np.testing.assert_allclose(got[0], want[i], rtol=1e-5, atol=1e-6)
        serial = s.service.statistics("digits")[0]
        assert short_enough >= 5, "the host stalled the engine through most of the requests"
        assert serial["inline_count"] - before["inline_count"] == short_enough

        reqs = b""
        for i in range(20, 40):  # written at once: parsed together, so none of them is alone
            body = orjson.dumps({"id": str(i), "inputs": [
                {"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": x[i].tolist()}]})
            reqs += b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body), body)
        with connect(s.url) as sock:
            sock.sendall(reqs)
            got_all = read_responses(sock, 20)
        assert [g[0] for g in got_all] == [200] * 20
        for i, (_, _, body_out) in zip(range(20, 40), got_all, strict=True):
            out = orjson.loads(body_out)
            assert out["id"] == str(i)
            np.testing.assert_allclose(out["outputs"][0]["data"], want[i], rtol=1e-5, atol=1e-6)
        after = s.service.statistics("digits")[0]
        assert after["inline_count"] - serial["inline_count"] < 20, "pipelined requests all ran on the loop"
        assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 40
        assert after["inference_stats"]["fail"]["count"] == 0 and after["in_flight"] == 0
