"""The gRPC transport against real clients: tritonclient.grpc (typed and raw contents, system shared
memory, ModelStreamInfer), raw grpcio calls for malformed and oversized messages (perf_analyzer
``-i grpc`` runs in tests/device/test_perf_analyzer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from edged.client.http import HttpClient
from edged.config import parse_config
from edged.protocol.types import InferRequest
from edged.transports.v2_ops import LOOP_INLINE_MAX_NS
from tests.http_helpers import TOKEN, Segment, Served, copy_models, held_engine, in_process, served
from tests.mqtt_helpers import make_test_ca
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(180)
AUTH = {"authorization": f"Bearer {TOKEN}"}  # gRPC metadata keys are lower case
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """HTTP and gRPC on one service; a 1 MB gRPC message limit (mobilenet's 110 KB input fits) and a
    small stream window, so the 1,000-request stream runs into it."""
    tmp = tmp_path_factory.mktemp("grpc")
    with served(copy_models(tmp / "models", "digits", "mobilenet"), tmp,
                grpc="max_message_mb = 1\nmax_stream_inflight = 4\nmessage_timeout_s = 3\n",
                extra='[shm]\nsystem_shm_prefix = "grpctest_"\n') as s:
        yield s


@pytest.fixture
def triton(srv: Served) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


@pytest.fixture
def channel(srv: Served) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(srv.grpc_url)
    yield ch
    ch.close()


def mobilenet_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 3, 48, 192), dtype=np.float32)


def digits_request(x: np.ndarray, rid: str = "") -> tg.InferInput:
    inp = tg.InferInput("pixels", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


# ---- metadata and the Triton extensions --------------------------------------------------------
def test_health_metadata_config_statistics_index(triton: tg.InferenceServerClient,
                                                 digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "edged" and "system_shared_memory" in meta["extensions"]
    assert triton.is_model_ready("digits") and triton.is_model_ready("digits", "1")
    md = triton.get_model_metadata("digits", as_json=True)
    assert md["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": ["-1", "64"]}]
    cfg = triton.get_model_config("digits", as_json=True)["config"]
    assert cfg["name"] == "digits" and cfg["max_batch_size"] == 64
    assert cfg["input"][0]["data_type"] == "TYPE_FP32" and cfg["input"][0]["dims"] == ["64"]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [8, 16]
    x, _ = digits_holdout
    before = triton.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    triton.infer("digits", [digits_request(x[:2])])
    after = triton.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 2
    index = triton.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["state"]) for m in index} == {("digits", "READY"), ("mobilenet", "READY")}
    with pytest.raises(InferenceServerException) as e:
        triton.get_model_metadata("no-such-model")
    assert e.value.status() == "StatusCode.NOT_FOUND"


# ---- inference --------------------------------------------------------------------------------
def test_raw_contents_match_in_process(srv: Served, triton: tg.InferenceServerClient,
                                       digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    batch = x[:64]
    result = triton.infer("digits", [digits_request(batch)], request_id="r-1",
                          outputs=[tg.InferRequestedOutput("probabilities")])
    got = result.as_numpy("probabilities")
    assert result.get_response().id == "r-1" and got.shape == (64, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, in_process(srv, "digits", batch), rtol=1e-5, atol=1e-6)
    assert (got.argmax(1) == y[:64]).mean() > 0.9
    img = mobilenet_input()
    inp = tg.InferInput("image", list(img.shape), "FP32")
    inp.set_data_from_numpy(img)
    got = triton.infer("mobilenet", [inp], model_version="1").as_numpy("probabilities")
    np.testing.assert_allclose(got, in_process(srv, "mobilenet", img), rtol=1e-4, atol=1e-5)


def test_typed_contents_match_in_process(srv: Served, channel: grpc.Channel,
                                         digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    batch = x[:5]
    req = service_pb2.ModelInferRequest(model_name="digits", id="typed")
    t = req.inputs.add(name="pixels", datatype="FP32", shape=list(batch.shape))
    t.contents.fp32_contents.extend(batch.ravel().tolist())
    resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert resp.id == "typed" and resp.outputs[0].name == "probabilities" and list(resp.outputs[0].shape) == [5, 10]
    got = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(5, 10)
    np.testing.assert_allclose(got, in_process(srv, "digits", batch), rtol=1e-5, atol=1e-6)
    # A typed datatype whose values are in the wrong field is a count mismatch, not a crash.
    req.inputs[0].datatype = "INT32"
    with pytest.raises(grpc.RpcError) as e:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_system_shared_memory(srv: Served, triton: tg.InferenceServerClient,
                              digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    batch = np.ascontiguousarray(digits_holdout[0][:16])
    out_bytes = 16 * 10 * 4
    tag = uuid.uuid4().hex[:8]
    seg_in, seg_out = Segment(f"/grpctest_in_{tag}", batch.nbytes), Segment(f"/grpctest_out_{tag}", out_bytes)
    try:
        seg_in.write(batch.tobytes())
        with pytest.raises(InferenceServerException) as e:  # registering needs the management authority
            triton.register_system_shared_memory(f"in_{tag}", f"/grpctest_in_{tag}", batch.nbytes)
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        triton.register_system_shared_memory(f"in_{tag}", f"/grpctest_in_{tag}", batch.nbytes, headers=AUTH)
        triton.register_system_shared_memory(f"out_{tag}", f"/grpctest_out_{tag}", out_bytes, headers=AUTH)
        status = triton.get_system_shared_memory_status(headers=AUTH, as_json=True)["regions"]
        assert {f"in_{tag}", f"out_{tag}"} <= set(status)
        assert int(status[f"in_{tag}"]["byte_size"]) == batch.nbytes

        inp = tg.InferInput("pixels", [16, 64], "FP32")
        inp.set_shared_memory(f"in_{tag}", batch.nbytes)
        out = tg.InferRequestedOutput("probabilities")
        out.set_shared_memory(f"out_{tag}", out_bytes)
        result = triton.infer("digits", [inp], outputs=[out], headers=AUTH)
        assert list(result.get_output("probabilities").shape) == [16, 10]
        # One entry per output, empty for one written to shared memory (Triton's C++ client indexes it).
        assert list(result.get_response().raw_output_contents) == [b""]
        got = np.frombuffer(seg_out.read(out_bytes), np.float32).reshape(16, 10)
        np.testing.assert_allclose(got, in_process(srv, "digits", batch), rtol=1e-5, atol=1e-6)
        # Another caller (no credential) cannot use these regions.
        with pytest.raises(InferenceServerException) as e:
            triton.infer("digits", [inp])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "not registered" in e.value.message()
        # ... and is told why (regions are scoped to their registrant) and what to send.
        assert "scoped to whoever registered them" in e.value.message()
        assert "'authorization' metadata" in e.value.message()
        triton.unregister_system_shared_memory(f"in_{tag}", headers=AUTH)
        with pytest.raises(InferenceServerException) as e:
            triton.infer("digits", [inp], outputs=[out], headers=AUTH)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        triton.unregister_system_shared_memory(headers=AUTH)
        seg_in.close()
        seg_out.close()
    assert triton.get_system_shared_memory_status(headers=AUTH, as_json=True).get("regions", {}) == {}


def test_regions_registered_over_http_serve_grpc(srv: Served, triton: tg.InferenceServerClient,
                                                 digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    batch = np.ascontiguousarray(digits_holdout[0][:2])
    tag = uuid.uuid4().hex[:8]
    seg = Segment(f"/grpctest_x_{tag}", batch.nbytes)
    try:
        seg.write(batch.tobytes())
        with HttpClient(srv.url, token=TOKEN) as h:
            r = h.request("POST", f"/v2/systemsharedmemory/region/x_{tag}/register",
                          [json.dumps({"key": seg.key, "offset": 0, "byte_size": batch.nbytes}).encode()])
            assert r.status == 200, r.body
        inp = tg.InferInput("pixels", [2, 64], "FP32")
        inp.set_shared_memory(f"x_{tag}", batch.nbytes)
        got = triton.infer("digits", [inp], headers=AUTH).as_numpy("probabilities")
        np.testing.assert_allclose(got, in_process(srv, "digits", batch), rtol=1e-5, atol=1e-6)
        triton.unregister_system_shared_memory(f"x_{tag}", headers=AUTH)
        with HttpClient(srv.url, token=TOKEN) as h:
            assert json.loads(h.request("GET", "/v2/systemsharedmemory/status").body) == []
    finally:
        seg.close()


def test_stream_answers_each_request_once_in_order_with_errors_in_place(
        srv: Served, triton: tg.InferenceServerClient, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    n, bad = 1000, 437
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(n):
            row = x[i % len(x): i % len(x) + 1]
            inp = tg.InferInput("pixels", [1, 64] if i != bad else [2, 64], "FP32")  # a shape lie at `bad`
            if i == bad:
                inp._raw_content = row.tobytes()  # 1 row of bytes for a 2-row shape (the client would refuse it)
            else:
                inp.set_data_from_numpy(row)
            triton.async_stream_infer("digits", [inp], request_id=str(i))
        got = [answers.get(timeout=60) for _ in range(n)]
    finally:
        triton.stop_stream()
    assert answers.empty()
    for i, (result, error) in enumerate(got):
        if i == bad:
            assert result is None and error is not None and "bytes" in str(error), error
            continue
        assert error is None, (i, error)
        assert result.get_response().id == str(i)
    ids = [int(r.get_response().id) for r, _ in got if r is not None]
    assert ids == [i for i in range(n) if i != bad]
    row = x[5:6]
    np.testing.assert_allclose(got[5][0].as_numpy("probabilities"), in_process(srv, "digits", row), rtol=1e-5)


def _ping_pong_stream(triton: tg.InferenceServerClient, x: np.ndarray, ids: range,
                      before_each: Callable[[int], None] = lambda i: None) -> list[np.ndarray]:
    """Requests on one stream, each sent once the previous one is answered."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    got: list[np.ndarray] = []
    try:
        for i in ids:
            before_each(i)
            triton.async_stream_infer("digits", [digits_request(x[i:i + 1])], request_id=str(i))
            result, error = answers.get(timeout=60)
            assert error is None and result.get_response().id == str(i)
            got.append(result.as_numpy("probabilities")[0])
    finally:
        triton.stop_stream()
    return got


def _pipelined_stream(srv: Served, channel: grpc.Channel, x: np.ndarray) -> list[np.ndarray]:
    """Every row of ``x`` a digits request on one stream, all written while the engine holds the first."""
    from edged.client.grpc import infer_outputs, infer_request

    bodies = [bytes(infer_request("digits", {"pixels": x[i:i + 1]}, None).SerializeToString())
              for i in range(len(x))]
    sent = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from bodies
        sent.set()  # grpcio's client writes each message before it asks for the next

    with held_engine(srv.service, "digits") as entered:
        replies = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(requests(), timeout=60)
        assert entered.wait(30), "the first request never reached the engine"
        assert sent.wait(30), "the client did not write the stream"
    got = []
    for raw in replies:
        reply = service_pb2.ModelStreamInferResponse.FromString(raw)
        assert not reply.error_message, reply.error_message
        got.append(infer_outputs(reply.infer_response)["probabilities"][0])
    return got


def test_lone_requests_run_on_the_loop_and_concurrent_or_pipelined_ones_are_queued(
        srv: Served, triton: tg.InferenceServerClient, channel: grpc.Channel,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """A ModelInfer alone on the server skips the hand-off to a scheduler thread and back (the model is
    idle and quick), and so does a stream's request when its client waits for each answer; requests in
    flight together, and a stream's requests once its client pipelines them, go to the batcher, which
    batches them; every answer is the in-process one, counted once."""
    x, _ = digits_holdout
    want = in_process(srv, "digits", x[:40])
    sched = srv.service.ready_model("digits").scheduler
    assert sched is not None
    short_enough = [0]  # requests the loop may run: a host stall (a 30 us run once took 50 ms on a loaded

    def count(i: int) -> None:  # CI machine) lifts the run-time average over the loop's limit for ~8 runs
        short_enough[0] += sched.short_enough(x[i:i + 1].nbytes, LOOP_INLINE_MAX_NS)

    # The batcher remembers concurrent arrivals (the tests before) for a moment: serve until one runs inline.
    deadline = time.monotonic() + 30
    while sched.short_enough(x[:1].nbytes, LOOP_INLINE_MAX_NS):
        before = srv.service.statistics("digits")[0]
        triton.infer("digits", [digits_request(x[:1])])
        if srv.service.statistics("digits")[0]["inline_count"] > before["inline_count"]:
            break
        assert time.monotonic() < deadline, "no lone request ran inline in 30 s"
    before = srv.service.statistics("digits")[0]
    for i in range(20):
        count(i)
        got = triton.infer("digits", [digits_request(x[i:i + 1])]).as_numpy("probabilities")
        np.testing.assert_allclose(got[0], want[i], rtol=1e-5, atol=1e-6)
    serial = srv.service.statistics("digits")[0]
    assert short_enough[0] >= 5, "the host stalled the engine through most of the requests"
    assert serial["inline_count"] - before["inline_count"] == short_enough[0]

    short_enough[0] = 0
    np.testing.assert_allclose(_ping_pong_stream(triton, x, range(20, 40), count), want[20:40],
                               rtol=1e-5, atol=1e-6)
    streamed = srv.service.statistics("digits")[0]
    assert short_enough[0] >= 5, "the host stalled the engine through most of the requests"
    assert streamed["inline_count"] - serial["inline_count"] == short_enough[0], \
        "a ping-pong stream's requests were queued"

    # A stream written ahead of its answers (all of it arrives while the first request is in the engine):
    # the first may run on the loop, every later one is read before the answer to the one before it has
    # been written, and queued.
    want_more = in_process(srv, "digits", x[40:80])
    np.testing.assert_allclose(_pipelined_stream(srv, channel, x[40:80]), want_more,
                               rtol=1e-5, atol=1e-6)
    after = srv.service.statistics("digits")[0]
    inline = after["inline_count"] - streamed["inline_count"]
    runs = after["execution_count"] - streamed["execution_count"] - 1  # in_process's run
    assert inline <= 1, f"{inline} of a pipelining stream's 40 requests ran on the loop"
    assert runs < 40, f"40 pipelined requests took {runs} engine runs: none were batched"
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 81
    assert after["in_flight"] == 0


# ---- refusals: the right status, and the next request is served ----------------------------------
def _ok(triton: tg.InferenceServerClient, x: np.ndarray) -> None:
    assert triton.infer("digits", [digits_request(x[:1])]).as_numpy("probabilities").shape == (1, 10)


def test_malformed_protobuf_is_invalid_argument(triton: tg.InferenceServerClient, channel: grpc.Channel,
                                                digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    call = channel.unary_unary(INFER)
    for junk in (b"\xff\xff\xff\xff", b"\x0a\x80\x80\x80\x80\x10digits", b"\x3a\x05ab"):
        with pytest.raises(grpc.RpcError) as e:
            call(junk, timeout=10)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "not a valid ModelInferRequest" in (e.value.details() or "")
        _ok(triton, digits_holdout[0])


def test_a_message_that_never_arrives_is_deadline_exceeded_and_its_memory_released(
        srv: Served, triton: tg.InferenceServerClient, channel: grpc.Channel,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """A ModelInfer whose message never comes holds the largest message's memory only until
    [grpc] message_timeout_s (3 s here) has passed, then ends DEADLINE_EXCEEDED; others are served meanwhile."""
    budget = srv.service.budget
    used = budget.used
    gate = threading.Event()

    def never() -> Iterator[bytes]:  # the RPC starts, its message never comes
        gate.wait(60)
        yield from ()

    t0 = time.monotonic()
    call = channel.stream_unary(INFER).future(never(), timeout=60)
    try:
        wait_until(lambda: budget.used > used, 10, what="the waiting message's memory to be reserved")
        _ok(triton, digits_holdout[0])
        with pytest.raises(grpc.RpcError) as e:
            call.result()
        waited = time.monotonic() - t0
    finally:
        gate.set()
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, e.value
    assert "did not arrive within 3 s" in (e.value.details() or "")
    assert 2.9 <= waited < 15, waited
    assert budget.used == used
    _ok(triton, digits_holdout[0])


def test_read_deadlines_cancel_only_late_reads_and_stop_sweeping_when_none_is_left() -> None:
    """A read outstanding past its deadline is cancelled and said to be expired; one that ended in time
    is not; with no read outstanding the sweeps stop (an idle daemon has no timer firing every second)."""
    from edged.transports.grpc.app import READ_SWEEP_S, ReadDeadlines

    async def scenario() -> tuple[bool, bool, bool, float]:
        reads = ReadDeadlines(timeout_s=READ_SWEEP_S, take=lambda: None)
        never = asyncio.get_running_loop().create_future()

        async def stuck() -> None:
            await never

        async def prompt() -> None:
            return None

        late, quick = asyncio.create_task(stuck()), asyncio.create_task(prompt())
        t0 = time.monotonic()
        reads.start(late)
        reads.start(quick)
        await quick
        quick_expired = reads.end(quick)
        with contextlib.suppress(asyncio.CancelledError):
            await late
        waited = time.monotonic() - t0
        late_expired = reads.end(late)  # the sweep that cancelled it found nothing else outstanding
        return late_expired, quick_expired, reads._sweeper is None, waited

    late_expired, quick_expired, stopped, waited = asyncio.run(scenario())
    assert late_expired and not quick_expired
    assert READ_SWEEP_S <= waited < 4 * READ_SWEEP_S, waited
    assert stopped, "the sweeps went on with no read outstanding"


@pytest.mark.parametrize("timeout_s", [0.2, 1.5])
def test_a_read_expires_at_the_first_sweep_past_its_deadline(timeout_s: float) -> None:
    """A fractional message_timeout_s is not rounded up to whole sweeps: the sweep that cancels a late read
    is the first one at or past its deadline, so it expires between timeout_s and timeout_s + READ_SWEEP_S."""
    from edged.transports.grpc.app import ReadDeadlines

    async def scenario() -> tuple[list[tuple[float, bool]], bool]:
        reads = ReadDeadlines(timeout_s, take=lambda: None)
        never = asyncio.get_running_loop().create_future()

        async def stuck() -> None:
            await never

        task = asyncio.create_task(stuck())
        sweeps: list[tuple[float, bool]] = []  # each sweep: seconds since the read started, read cancelled
        sweep = reads._sweep

        def observed() -> None:
            at = time.monotonic() - started
            sweep()
            sweeps.append((at, task in reads._expired))

        reads._sweep = observed  # type: ignore[method-assign]
        reads.start(task)
        started = reads._reads[task]
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return sweeps, reads.end(task)

    sweeps, expired = asyncio.run(scenario())
    *before, (at, cancelled) = sweeps
    assert expired and cancelled and at >= timeout_s, sweeps
    assert all(t < timeout_s and not gone for t, gone in before), f"a sweep past the deadline missed it: {sweeps}"


@contextlib.contextmanager
def _budgeted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grpc_lines: str) -> Iterator[Served]:
    """gRPC on a service with a real 64 MiB request memory budget, as ``edged run`` with [limits] memory_mb =
    64 (the test service's is otherwise unlimited)."""
    from edged.membudget import MIB, MemoryBudget

    monkeypatch.setattr(MemoryBudget, "unlimited", classmethod(lambda cls: cls(64 * MIB)))
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, grpc=grpc_lines) as s:
        yield s


def _digits_body(x: np.ndarray) -> bytes:
    from edged.client.grpc import infer_request

    return bytes(infer_request("digits", {"pixels": x}, None).SerializeToString())


def _held_back(gate: threading.Event) -> Iterator[bytes]:
    """A ModelInfer's requests: the RPC starts, and ends without a message once ``gate`` is set."""
    gate.wait(60)
    yield from ()


def test_eight_of_the_largest_messages_are_read_at_once_and_further_calls_wait_their_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """Each ModelInfer reserves its largest possible message before reading it, and eight of those fit what
    large requests may fill of the budget. A call that finds no room waits for it (its message stays in the
    client's socket) instead of being refused; one whose client gives up leaves the queue, and room freed
    goes to the next in line."""
    from edged.client.grpc import infer_outputs

    x, _ = digits_holdout
    with _budgeted(tmp_path, monkeypatch, "") as s:
        app, budget = s.grpc.app, s.service.budget
        each = 4 * s.grpc.max_receive  # MESSAGE_COPIES x the largest message
        gates = [threading.Event() for _ in range(9)]
        try:
            with grpc.insecure_channel(s.grpc_url) as ch:
                stalled = [ch.stream_unary(INFER).future(_held_back(g), timeout=60) for g in gates[:8]]
                wait_until(lambda: budget.used == 8 * each, 10, what="eight largest messages reserved")
                quitter = ch.stream_unary(INFER).future(_held_back(gates[8]), timeout=60)
                wait_until(lambda: len(app.reads._waiting) == 1, 10, what="a ninth call waiting for room")
                waiter = ch.unary_unary(INFER).future(_digits_body(x[:1]), timeout=60)
                wait_until(lambda: len(app.reads._waiting) == 2, 10, what="a tenth call waiting for room")
                quitter.cancel()
                wait_until(lambda: app._active == 9, 10, what="the ninth call to end")
                assert not [c for c in stalled if c.done()] and not waiter.done()
                assert budget.used == 8 * each and budget.refused == 0

                gates[0].set()  # the first stalled call ends without a message: its room goes to the waiter
                with pytest.raises(grpc.RpcError) as e:
                    stalled[0].result(30)
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
                reply = service_pb2.ModelInferResponse.FromString(waiter.result(30))
                np.testing.assert_allclose(infer_outputs(reply)["probabilities"], in_process(s, "digits", x[:1]),
                                           rtol=1e-5, atol=1e-6)
                assert budget.used == 7 * each
        finally:
            for g in gates:
                g.set()
        wait_until(lambda: budget.used == 0 and app._active == 0, 10, what="every reservation released")
        assert budget.refused == 0 and not app.reads._waiting


def test_a_call_waits_for_room_up_to_message_timeout_then_is_overloaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """While other requests leave no room for the largest message, a ModelInfer waits until message_timeout_s
    has passed since it started and is then overloaded (UNAVAILABLE: retry later), counted as refused once;
    room another transport frees goes to a waiting call at the next sweep."""
    x, _ = digits_holdout
    with _budgeted(tmp_path, monkeypatch, "message_timeout_s = 1\n") as s:
        app, budget = s.grpc.app, s.service.budget
        each = 4 * s.grpc.max_receive
        others = budget.reserve(budget.large_limit - each + 1, "other transports' requests")
        body = _digits_body(x[:1])
        with grpc.insecure_channel(s.grpc_url) as ch:
            call = ch.unary_unary(INFER).future(body, timeout=60)
            wait_until(lambda: len(app.reads._waiting) == 1, 10, what="the call waiting for room")
            with pytest.raises(grpc.RpcError) as e:
                call.result(30)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE, e.value
            assert _edged_code(e.value) == "overloaded"
            assert "request memory budget is full" in (e.value.details() or ""), e.value.details()
            assert budget.refused == 1

            app.reads.timeout_s = 60  # now a wait that outlasts any test thread's delay
            call = ch.unary_unary(INFER).future(body, timeout=60)
            wait_until(lambda: len(app.reads._waiting) == 1, 10, what="the call waiting for room")
            others.release()
            assert service_pb2.ModelInferResponse.FromString(call.result(30)).outputs
        assert budget.used == 0 and budget.refused == 1


def test_a_stream_reads_no_request_while_its_window_is_full() -> None:
    """[grpc] max_stream_inflight requests of a stream are taken from grpcio at most: the next one stays
    there (outside the request memory budget, in the client's flow-control window) until a slot frees."""
    from types import SimpleNamespace

    from edged.transports.grpc.app import GrpcApp

    async def scenario() -> tuple[int, list[bytes]]:
        taken = 0
        computing = 0
        full, go = asyncio.Event(), asyncio.Event()

        async def requests() -> Any:
            nonlocal taken
            for i in range(6):
                taken += 1
                yield b"%d" % i

        async def stream_one(data: bytes, context: Any, lone: bool) -> bytes:
            nonlocal computing
            computing += 1
            if computing == 2:
                full.set()
            await go.wait()
            return data

        app = SimpleNamespace(stream_inflight=2, _stream_one=stream_one)
        answers = GrpcApp.model_stream_infer(app, requests(), None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(answers))
        await full.wait()  # both slots taken: the reader has gone as far as it may
        taken_while_full = taken
        go.set()
        return taken_while_full, [await first] + [a async for a in answers]

    taken, got = asyncio.run(scenario())
    assert taken == 2, f"{taken} requests taken with 2 slots, both busy"
    assert got == [b"%d" % i for i in range(6)]


def test_oversized_message_is_resource_exhausted(triton: tg.InferenceServerClient, channel: grpc.Channel,
                                                 digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    big = np.zeros((4096, 64), np.float32)  # 1 MiB of raw contents plus the header: over [grpc] max_message_mb
    with pytest.raises(InferenceServerException) as e:
        triton.infer("digits", [digits_request(big)])
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    _ok(triton, digits_holdout[0])


def test_shape_lies_and_bad_requests_are_invalid_argument(triton: tg.InferenceServerClient, channel: grpc.Channel,
                                                          digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def refused(req: Any) -> str:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=10)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
        _ok(triton, x)
        return str(e.value.details())

    req = service_pb2.ModelInferRequest(model_name="digits", raw_input_contents=[x[:3].tobytes()])
    req.inputs.add(name="pixels", datatype="FP32", shape=[4, 64])
    assert "needs 1024" in refused(req)
    req.inputs[0].shape[:] = [3, -64]
    assert "non-negative" in refused(req)
    req.inputs[0].shape[:] = [3, 64]
    req.raw_input_contents.append(b"extra")
    assert "raw_input_contents" in refused(req)
    req = service_pb2.ModelInferRequest(model_name="digits", model_version="v1")
    assert "version" in refused(req)
    with pytest.raises(grpc.RpcError) as e:
        req.model_name, req.model_version = "nope", ""
        req.inputs.add(name="pixels", datatype="FP32", shape=[0, 64])
        req.raw_input_contents.append(b"")
        stub.ModelInfer(req, timeout=10)
    assert e.value.code() is grpc.StatusCode.NOT_FOUND


def test_repository_load_unload_needs_the_authority(srv: Served, triton: tg.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as e:
        triton.unload_model("mobilenet")
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as e:
        triton.unload_model("mobilenet", headers={"authorization": "Bearer wrong-token-0123456789"})
    assert e.value.status() == "StatusCode.PERMISSION_DENIED"
    assert triton.is_model_ready("mobilenet")
    triton.unload_model("mobilenet", headers=AUTH)
    assert not srv.service.is_ready("mobilenet")
    triton.load_model("mobilenet", headers=AUTH)
    assert triton.is_model_ready("mobilenet")


# ---- listener and configuration -----------------------------------------------------------------
def test_grpc_is_off_unless_configured_and_refuses_unknown_keys() -> None:
    assert parse_config("").grpc is None
    cfg = parse_config("[grpc]\n")
    assert cfg.grpc is not None and cfg.grpc.listen == "127.0.0.1:8001" and cfg.grpc.enabled
    with pytest.raises(Exception, match="nope"):
        parse_config("[grpc]\nnope = 1\n")


def test_unix_socket_listener(tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    sock = tmp_path / "run" / "grpc.sock"
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, grpc=f'listen = "unix:{sock}"\n') as s:
        assert s.grpc_url == f"unix:{sock}" and (sock.stat().st_mode & 0o777) == 0o660
        c = tg.InferenceServerClient(s.grpc_url)
        try:
            _ok(c, digits_holdout[0])
        finally:
            c.close()
    assert not sock.exists()


def test_missing_extra_is_a_typed_error(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['grpc'] = None\n"
            "from edged.config import parse_config\n"
            "from edged.errors import MissingDependencyError\n"
            "from edged.transports.grpc.server import GrpcTransport\n"
            "try:\n    GrpcTransport(parse_config('[grpc]\\n'), None)\n"
            "except MissingDependencyError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "refused: [grpc] is configured" in r.stdout and "edged[grpc]" in r.stdout
    # edged config check says the same before the daemon is started.
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[device]\nmodel_repository = "{tmp_path}"\n[grpc]\n[mqtt]\nenabled = false\n')
    check = ("import sys; sys.modules['grpc'] = None\nfrom edged.cli import main\n"
             f"sys.exit(main(['config', 'check', {str(cfg)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "grpc: [grpc] is configured" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "edged", "config", "check", str(cfg)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


# perf_analyzer -i grpc (unary and streaming, with and without system shared memory) runs in
# tests/device/test_perf_analyzer.py, with every other mode, against one daemon.


def test_edged_infer_over_grpc(srv: Served, tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x = digits_holdout[0][:3]
    np.save(tmp_path / "x.npy", x)
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[grpc]\nlisten = "{srv.grpc_url}"\n')
    r = subprocess.run([sys.executable, "-m", "edged", "infer", "digits", "--input", str(tmp_path / "x.npy"),
                        "--transport", "grpc", "--json", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["outputs"][0]
    assert out["name"] == "probabilities" and out["shape"] == [3, 10]
    got = np.array(out["data"], np.float32).reshape(3, 10)
    np.testing.assert_allclose(got, in_process(srv, "digits", x), rtol=1e-5, atol=1e-6)


def test_mutual_tls(tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    ca = make_test_ca(tmp_path / "ca")
    tls = (f'[grpc.tls]\ncert_file = "{ca.server_cert}"\nkey_file = "{ca.server_key}"\n'
           f'client_ca_file = "{ca.ca}"\n')
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, grpc=tls) as s:
        url = str(s.grpc_url)
        good = tg.InferenceServerClient(url, ssl=True, root_certificates=str(ca.ca), private_key=str(ca.client_key),
                                        certificate_chain=str(ca.client_cert))
        try:
            _ok(good, digits_holdout[0])
        finally:
            good.close()
        no_cert = tg.InferenceServerClient(url, ssl=True, root_certificates=str(ca.ca))
        plain = tg.InferenceServerClient(url)
        try:
            for c in (no_cert, plain):
                with pytest.raises(InferenceServerException) as e:
                    c.is_server_live(client_timeout=10)
                assert e.value.status() == "StatusCode.UNAVAILABLE"
        finally:
            no_cert.close()
            plain.close()


def test_busy_port_is_a_typed_error_naming_it(srv: Served, tmp_path: Path) -> None:
    from edged.errors import EdgedError, ErrorCode
    from edged.transports.grpc.server import GrpcTransport

    taken = str(srv.grpc_url)
    cfg = parse_config(f'[grpc]\nlisten = "{taken}"\n[device]\nstate_dir = "{tmp_path}"\n')
    t = GrpcTransport(cfg, srv.service)
    with pytest.raises(EdgedError) as e:
        srv.run(t.start())
    assert e.value.code is ErrorCode.UNAVAILABLE and taken in str(e.value)


def _edged_code(e: grpc.RpcError) -> str | None:
    """The transport-neutral code the daemon sends in an error's trailing metadata."""
    return dict(e.trailing_metadata() or ()).get("edged-code")


def test_overloaded_is_unavailable_with_its_code_and_deadline_is_deadline_exceeded(tmp_path: Path) -> None:
    """A full queue is UNAVAILABLE (retry soon, as Triton answers "Exceeds maximum queue size"), not
    RESOURCE_EXHAUSTED (too big); the trailer says ``overloaded``, and edged's client, unary or streaming,
    raises that code."""
    from edged.client.grpc import GrpcClient
    from edged.errors import EdgedError, ErrorCode

    repo = copy_models(tmp_path / "models", "mobilenet")
    toml = repo / "mobilenet" / "1" / "model.toml"
    toml.write_text(toml.read_text().replace("[batching]\n", "[batching]\nmax_queue_size = 1\n"))
    img = np.zeros((1, 3, 48, 192), np.float32)
    one = tg.InferInput("image", [1, 3, 48, 192], "FP32")
    one.set_data_from_numpy(img)
    with served(repo, tmp_path, grpc="max_message_mb = 16\n") as s:
        c = tg.InferenceServerClient(s.grpc_url)
        edged = GrpcClient(s.grpc_url, timeout=30)
        stream = edged.stream()
        try:
            with held_engine(s.service, "mobilenet") as inside, grpc.insecure_channel(s.grpc_url) as ch:
                running = s.service.submit(InferRequest("mobilenet", {"image": img}))
                assert inside.wait(30), "the held engine never got the first request"
                # The one queue slot is free: this request waits there past its 0.3 s deadline.
                with pytest.raises(InferenceServerException) as late:
                    c.infer("mobilenet", [one], client_timeout=0.3)
                # The expired request still holds the slot until the worker drops it unrun.
                with pytest.raises(InferenceServerException) as full:
                    c.infer("mobilenet", [one])
                with pytest.raises(grpc.RpcError) as raw:
                    ch.unary_unary(INFER)(_mobilenet_body(img), timeout=30)
                with pytest.raises(EdgedError) as unary:
                    edged.infer("mobilenet", {"image": img})
                with pytest.raises(EdgedError) as streamed:
                    stream.infer("mobilenet", {"image": img})
            running.result(30)
            assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED", late.value
            assert full.value.status() == "StatusCode.UNAVAILABLE", full.value
            assert "queue full" in str(full.value.message())
            assert raw.value.code() is grpc.StatusCode.UNAVAILABLE and _edged_code(raw.value) == "overloaded"
            assert unary.value.code is ErrorCode.OVERLOADED and "queue full" in str(unary.value), unary.value
            assert streamed.value.code is ErrorCode.OVERLOADED and "queue full" in str(streamed.value)
            assert c.infer("mobilenet", [one]).as_numpy("probabilities").shape == (1, 37)
            assert stream.infer("mobilenet", {"image": img})["probabilities"].shape == (1, 37)
        finally:
            stream.close()
            edged.close()
            c.close()


def _mobilenet_body(x: np.ndarray) -> bytes:
    from edged.client.grpc import infer_request

    return bytes(infer_request("mobilenet", {"image": x}, None).SerializeToString())


def test_a_message_over_what_any_request_may_hold_is_resource_exhausted_with_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Typed contents that would need more than any request may hold (48 bytes an element, 1 on the wire
    for BOOL) are RESOURCE_EXHAUSTED with the trailer ``resource_exhausted``, unary and in a stream, and
    edged's client raises that code (not OVERLOADED: the request is too big, retrying it will not help)."""
    from edged.client.grpc import GrpcClient
    from edged.errors import EdgedError, ErrorCode
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb

    with _budgeted(tmp_path, monkeypatch, "") as s:
        n = s.grpc.max_receive - 1024  # within the largest message grpcio takes
        assert 48 * n > s.service.budget.large_limit
        req = pb.ModelInferRequest(model_name="digits")
        req.inputs.add(name="pixels", datatype="BOOL", shape=[1, n]).contents.bool_contents.extend([False] * n)
        with grpc.insecure_channel(s.grpc_url) as ch:
            with pytest.raises(grpc.RpcError) as raw:
                ch.unary_unary(INFER)(req.SerializeToString(), timeout=30)
            streamed = next(ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
                iter([req.SerializeToString()]), timeout=30))
        assert raw.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, raw.value
        assert _edged_code(raw.value) == "resource_exhausted"
        reply = service_pb2.ModelStreamInferResponse.FromString(streamed)
        assert "more than any request may hold" in reply.error_message, reply.error_message
        assert reply.infer_response.parameters["edged-code"].string_param == "resource_exhausted"
        with GrpcClient(s.grpc_url, timeout=30) as edged:
            with pytest.raises(EdgedError) as unary:
                edged.call("ModelInfer", req, pb.ModelInferResponse)
            assert unary.value.code is ErrorCode.RESOURCE_EXHAUSTED, unary.value
        assert s.service.budget.used == 0


def _announced_window(host: str, port: int) -> int:
    """The SETTINGS_INITIAL_WINDOW_SIZE the server announces to a new HTTP/2 connection (RFC 9113 6.5.2):
    how much of a stream's messages a client may send before the server has read any."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # preface, SETTINGS
        data = b""
        while True:
            while len(data) < 9:
                chunk = s.recv(4096)
                assert chunk, "the server closed the connection before its SETTINGS"
                data += chunk
            length, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
            while len(data) < 9 + length:
                data += s.recv(4096)
            payload, data = data[9:9 + length], data[9 + length:]
            if kind == 4 and not flags & 1:  # SETTINGS, not an ACK
                settings = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                            for i in range(0, len(payload), 6)}
                return settings.get(4, 65535)


def test_the_stream_window_takes_a_typical_tensor_in_one_go(srv: Served) -> None:
    """A message larger than the announced window waits for the daemon's window update, a round trip of
    wake-ups per request; the window is sized from the request memory budget, so that all RPCs at
    once buffer no more than the budget before their memory is reserved."""
    host, _, port = srv.grpc_url.rpartition(":")
    window = _announced_window(host, int(port))
    assert window == srv.grpc.stream_window
    budget = srv.service.budget.limit
    assert window == max(64 << 10, min(4 << 20, budget // srv.cfg.grpc.max_concurrent_rpcs))
    if budget >= 1000 * (256 << 10):
        assert window >= 256 << 10  # mobilenet's 110 KB input with room to spare


def test_stream_window_sizing() -> None:
    from edged.config import GrpcSection
    from edged.transports.grpc.server import stream_window

    assert stream_window(GrpcSection(), 32 << 20) == 64 << 10  # 32 MiB over 1,000 RPCs: grpcio's own, no less
    assert stream_window(GrpcSection(), 1 << 30) == (1 << 30) // 1000
    assert stream_window(GrpcSection(), 64 << 30) == 4 << 20
    assert stream_window(GrpcSection(max_concurrent_rpcs=64), 64 << 20) == 1 << 20
    assert stream_window(GrpcSection(stream_window_kb=512), 1 << 20) == 512 << 10
