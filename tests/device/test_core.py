"""The inference core: validation, dynamic batching, backpressure, deadlines, zero-downtime swaps."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backends.base import Engine, EngineTensor
from edged.config import ModelsSection
from edged.core.batch_policy import PROBE_EVERY, BatchPolicy
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState
from edged.core.scheduler import Scheduler
from edged.core.service import InferenceService
from edged.core.stats import ModelStats
from edged.errors import (
    DeadlineExceededError,
    EdgedError,
    ErrorCode,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
)
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2_models import statistics_entry
from edged.repository.manifest import Batching
from tests.conftest import MODELS
from tests.polling import wait_until

MakeRepo = Callable[..., Path]
ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


def _service(repo: Path, prefs: list[BackendPreference] | None = None, **kw: object) -> InferenceService:
    manager = ModelManager(repo, ModelsSection(), prefs or ORT_CPU, **kw)  # type: ignore[arg-type]
    manager.load_all()
    return InferenceService(manager)


def _set_manifest(repo: Path, model: str, version: int, old: str, new: str) -> None:
    m = repo / model / str(version) / "model.toml"
    text = m.read_text()
    assert old in text
    m.write_text(text.replace(old, new))


@pytest.fixture
def digits_service(model_repo: MakeRepo) -> InferenceService:
    svc = _service(model_repo("digits"))
    yield svc
    svc.manager.shutdown()


def test_validation_names_the_problem(digits_service: InferenceService) -> None:
    svc = digits_service
    ok = np.zeros((2, 64), np.float32)
    cases = [
        ({"pixel": ok}, "unknown input(s) ['pixel']"),
        ({"pixels": ok.astype(np.float64)}, "datatype FP64, expected FP32"),
        ({"pixels": np.zeros((2, 63), np.float32)}, "dimension 1 is 63, expected 64"),
        ({"pixels": np.zeros((65, 64), np.float32)}, "batch size 65 is outside 1..64"),
        ({"pixels": np.zeros((64,), np.float32)}, "expected [batch, 64]"),
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidInputError) as ei:
            svc.submit(InferRequest("digits", inputs))
        assert message in str(ei.value)
        assert ei.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(InvalidInputError, match="unknown output"):
        svc.submit(InferRequest("digits", {"pixels": ok}, outputs=["logits"]))
    with pytest.raises(InvalidInputError, match=r"unknown output\(s\) \['logits'\]"):
        svc.submit(InferRequest("digits", {"pixels": ok}, outputs=["probabilities", "logits"]))
    with pytest.raises(ModelNotFoundError):
        svc.submit(InferRequest("nope", {"pixels": ok}))


def test_the_quick_check_takes_requests_that_name_known_outputs(digits_service: InferenceService,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """tritonclient names the outputs it wants: such a request must not fall back to the full check."""
    from edged.core import validation

    mv = digits_service.ready_model("digits")
    full: list[InferRequest] = []
    real = validation._validate_fully

    def counted(mv_: object, req: InferRequest) -> int:
        full.append(req)
        return real(mv_, req)  # type: ignore[arg-type]
    monkeypatch.setattr(validation, "_validate_fully", counted)
    ok = np.zeros((3, 64), np.float32)
    assert validation.validate(mv, InferRequest("digits", {"pixels": ok}, outputs=["probabilities"])) == 3
    assert validation.validate(mv, InferRequest("digits", {"pixels": ok})) == 3
    assert full == []
    with pytest.raises(InvalidInputError, match="unknown output"):
        validation.validate(mv, InferRequest("digits", {"pixels": ok}, outputs=["logits"]))
    assert len(full) == 1


def test_batched_results_equal_unbatched(digits_service: InferenceService,
                                         digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    svc = digits_service
    mv = svc.ready_model("digits")
    assert mv.engine is not None
    reference = [mv.engine.infer({"pixels": x[i:i + 1]})["probabilities"] for i in range(64)]
    # Many concurrent single-sample requests, so the batcher forms real batches.
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(svc.infer, InferRequest("digits", {"pixels": x[i:i + 1]}, id=str(i)))
                   for i in range(64)]
        results = [f.result() for f in futures]
    for i, r in enumerate(results):
        assert r.id == str(i)
        np.testing.assert_allclose(r.outputs["probabilities"], reference[i], rtol=1e-5, atol=1e-6)
    stats = svc.statistics("digits")[0]
    assert stats["inference_stats"]["success"]["count"] >= 64
    assert stats["inference_count"] >= 64


def test_requests_queued_together_are_batched(model_repo: MakeRepo,
                                              digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    repo = model_repo("digits")
    _set_manifest(repo, "digits", 1, "max_queue_delay_us = 500", "max_queue_delay_us = 200000")
    svc = _service(repo)
    try:
        futures = [svc.submit(InferRequest("digits", {"pixels": x[i:i + 2]})) for i in range(0, 32, 2)]
        outs = np.concatenate([f.result(10).outputs["probabilities"] for f in futures])
        np.testing.assert_allclose(outs, svc.ready_model("digits").engine.infer({"pixels": x[:32]})["probabilities"],
                                   rtol=1e-5, atol=1e-6)
        sizes = [b["batch_size"] for b in svc.statistics("digits")[0]["batch_stats"]]
        assert max(sizes) > 2, f"expected requests to be combined, saw batch sizes {sizes}"
    finally:
        svc.manager.shutdown()


def test_full_queue_refuses_at_once(model_repo: MakeRepo) -> None:
    repo = model_repo("mobilenet")
    _set_manifest(repo, "mobilenet", 1, "[batching]", "[batching]\nmax_queue_size = 4")
    svc = _service(repo)
    try:
        img = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
        accepted, refused = [], 0
        for _ in range(200):
            try:
                accepted.append(svc.submit(InferRequest("mobilenet", {"image": img})))
            except OverloadedError as e:
                assert e.code is ErrorCode.OVERLOADED
                refused += 1
        assert refused > 0
        assert len(accepted) < 200
        for f in accepted:
            f.result(30)
        assert svc.statistics("mobilenet")[0]["failures_by_code"]["overloaded"] == refused
    finally:
        svc.manager.shutdown()


def test_expired_deadline_is_dropped_unrun(digits_service: InferenceService) -> None:
    req = InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}, deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceededError):
        digits_service.infer(req, timeout=10)


def test_failed_batch_fails_every_request_with_the_same_error(digits_service: InferenceService) -> None:
    mv = digits_service.ready_model("digits")
    engine = mv.engine
    assert engine is not None

    class Broken(type(engine)):  # type: ignore[misc]
        def infer(self, inputs, outputs=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

    engine.__class__ = Broken
    futures = [digits_service.submit(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}))
               for _ in range(8)]
    errors = []
    for f in futures:
        with pytest.raises(EdgedError) as ei:
            f.result(10)
        errors.append(str(ei.value))
    assert len(set(errors)) == 1 and "device lost" in errors[0]


def _add_version(repo: Path, version: int) -> None:
    shutil.copytree(MODELS / "digits" / "1", repo / "digits" / str(version))


def test_swap_under_load_fails_nothing(model_repo: MakeRepo, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    repo = model_repo("digits")
    # Both versions are the same file: every answer must be the model's own, whichever version gave it
    # (held-out accuracy, about 0.95-0.97 over whichever samples the clients happen to send, is not exact).
    import onnxruntime as ort

    sess = ort.InferenceSession(str(repo / "digits" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = np.asarray(sess.run(None, {"pixels": x})[0]).argmax(axis=1)
    assert np.mean(expected == y) > 0.9  # and the model reads digits
    svc = _service(repo)
    stop = threading.Event()
    seen: list[int] = []
    asked: list[tuple[float, int, float]] = []  # (sent, version that answered, answered), monotonic
    failures: list[str] = []
    correct: list[bool] = []

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            i = (i + 7) % len(x)
            try:
                sent = time.monotonic()
                r = svc.infer(InferRequest("digits", {"pixels": x[i:i + 1]}), timeout=10)
                asked.append((sent, r.version, time.monotonic()))
                seen.append(r.version)
                correct.append(int(r.outputs["probabilities"].argmax()) == int(expected[i]))
            except Exception as e:  # any failure is a test failure
                failures.append(repr(e))

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: seen.count(1) >= 30, 60, what="version 1 answering the clients")
        _add_version(repo, 2)
        results = svc.manager.load_model("digits")
        assert [m.version for m in results] == [2] and results[0].state is ModelState.READY
        wait_until(lambda: seen.count(2) >= 30, 60, what="version 2 answering the clients")
        stop.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
        svc.manager.shutdown()
    assert failures == []
    assert correct and all(correct)
    assert 1 in seen and 2 in seen
    # once version 2 has answered, no request sent after that is answered by version 1 (judged by the
    # clock, not by the order threads appended in: on a loaded machine a thread can sit on a version-1
    # answer it received before the swap while others append many version-2 answers)
    first_two = min(done for _, v, done in asked if v == 2)
    late = [(sent - first_two, v) for sent, v, _ in asked if sent > first_two and v != 2]
    assert late == [], f"version 1 answered requests sent after version 2 had answered: {late[:5]}"
    assert [mv.version for mv in svc.manager.table.versions("digits")] == [2]


def test_corrupt_new_version_is_refused_and_old_keeps_serving(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    svc = _service(repo)
    try:
        _add_version(repo, 2)
        for f in ("model.onnx", "model.int8.onnx", "openvino/model.bin"):
            (repo / "digits" / "2" / f).write_bytes(b"corrupt")
        results = svc.manager.load_model("digits")
        assert results[0].state is ModelState.UNAVAILABLE
        r = svc.infer(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}), timeout=10)
        assert r.version == 1
    finally:
        svc.manager.shutdown()


def test_failed_warm_up_is_refused(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    svc = _service(repo)
    try:
        _add_version(repo, 2)
        # A golden check that cannot pass: the expected outputs are wrong.
        bad = repo / "digits" / "2" / "expected.npz"
        with np.load(bad) as d:
            np.savez(bad, probabilities=np.zeros_like(d["probabilities"]))
        mv = svc.manager.load_model("digits")[0]
        assert mv.state is ModelState.UNAVAILABLE
        assert "golden check failed" in (mv.reason or "")
        assert svc.infer(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}), timeout=10).version == 1
        statuses = {(s["name"], s["version"], s["state"]) for s in svc.manager.statuses()}
        assert ("digits", 2, "reload_failed") in statuses or ("digits", 2, "unavailable") in statuses
    finally:
        svc.manager.shutdown()


def test_an_operators_reload_stays_an_operators_unload_until_it_serves(model_repo: MakeRepo) -> None:
    """A trial watching the model must never see it gone and not unloaded by the operator: it would roll back."""
    svc = _service(model_repo("digits"))
    manager = svc.manager
    real_load = manager.loader.load

    def slow_load(entry: object) -> object:
        time.sleep(0.4)  # sleep-ok: a big model takes a while to build its engine
        return real_load(entry)  # type: ignore[arg-type]

    try:
        manager.unload_model("digits", by_operator=True)
        manager.loader.load = slow_load  # type: ignore[method-assign,assignment]
        loading = threading.Thread(target=manager.load_model, args=("digits",))
        loading.start()
        seen_gone = 0
        while loading.is_alive():
            marked = "digits" in manager.operator_unloaded  # the mark first: a reload clears it after publishing
            ready = [mv for mv in manager.table.versions("digits") if mv.state is ModelState.READY]
            if not ready and not marked:
                seen_gone += 1
            time.sleep(0.001)  # sleep-ok: samples the table for as long as the load runs
        loading.join()
        assert seen_gone == 0
        assert "digits" not in manager.operator_unloaded
        assert svc.infer(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}), timeout=10).version == 1
    finally:
        manager.shutdown()


def test_memory_budget_refuses_with_a_clear_error(model_repo: MakeRepo) -> None:
    repo = model_repo("digits", "mobilenet")
    svc = _service(repo, memory_budget_mb=1.0)
    try:
        states = {mv.name: mv for mv in svc.manager.table.all()}
        assert all(mv.state is ModelState.UNAVAILABLE for mv in states.values())
        assert "model budget" in (states["mobilenet"].reason or "")
    finally:
        svc.manager.shutdown()


def test_inline_path_matches_the_queued_path(digits_service: InferenceService,
                                             digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    svc = digits_service
    for i in range(8):
        req = InferRequest("digits", {"pixels": x[i:i + 2]}, id=f"r{i}")
        a, b = svc.infer_blocking(req), svc.infer(req, timeout=10)
        assert a.id == b.id == f"r{i}" and a.version == b.version == 1
        np.testing.assert_allclose(a.outputs["probabilities"], b.outputs["probabilities"], rtol=1e-6)
    only = svc.infer_blocking(InferRequest("digits", {"pixels": x[:1]}, outputs=["probabilities"]))
    assert list(only.outputs) == ["probabilities"]
    with pytest.raises(DeadlineExceededError):
        svc.infer_blocking(InferRequest("digits", {"pixels": x[:1]}, deadline=time.monotonic() - 1))
    stats = svc.statistics("digits")[0]
    assert stats["failures_by_code"]["deadline_exceeded"] == 1
    assert stats["in_flight"] == 0


def test_try_inline_runs_only_short_runs_of_an_idle_model(digits_service: InferenceService,
                                                          digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """What an event loop may run itself: the model idle and its typical run within the caller's limit."""
    x, _ = digits_holdout
    svc = digits_service
    mv = svc.ready_model("digits")
    sched = mv.scheduler
    assert sched is not None
    svc.infer(InferRequest("digits", {"pixels": x[:1]}), timeout=10)  # a run seen: the typical time is known
    typical = sched.typical_run_ns
    assert 0 < typical < 10**9
    before = svc.statistics("digits")[0]["inline_count"]
    done = svc.infer_or_submit(InferRequest("digits", {"pixels": x[:1]}), max_run_ns=10**9)
    assert isinstance(done, InferResponse)  # idle and short: answered on this thread
    queued = svc.infer_or_submit(InferRequest("digits", {"pixels": x[:1]}), max_run_ns=0)
    assert isinstance(queued, Future)  # its runs are longer than the caller can block for
    np.testing.assert_allclose(queued.result(10).outputs["probabilities"], done.outputs["probabilities"], rtol=1e-6)
    # Inputs far larger than the usual ones are expected to run longer in proportion (dynamic shapes):
    # within a limit of twice the typical run, one row runs inline and 64 rows are queued.
    limit = 2 * sched.typical_run_ns
    assert isinstance(svc.infer_or_submit(InferRequest("digits", {"pixels": x[:1]}), max_run_ns=limit),
                      InferResponse)
    big = svc.infer_or_submit(InferRequest("digits", {"pixels": x[:64]}), max_run_ns=limit)
    assert isinstance(big, Future)
    assert big.result(10).outputs["probabilities"].shape == (64, 10)
    with sched._cv:  # a request waiting in the queue: the model is not idle
        waiting = svc.submit(InferRequest("digits", {"pixels": x[:1]}))
        assert isinstance(svc.infer_or_submit(InferRequest("digits", {"pixels": x[:1]}), max_run_ns=10**9), Future)
    waiting.result(10)
    assert svc.statistics("digits")[0]["inline_count"] == before + 2


def test_traffic_moving_between_inline_and_queued_paths_counts_every_request_once(
        model_repo: MakeRepo, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    repo = model_repo("digits")
    _set_manifest(repo, "digits", 1, "max_queue_delay_us = 500", "max_queue_delay_us = 20000")
    svc = _service(repo)
    try:
        mv = svc.ready_model("digits")
        assert mv.engine is not None and mv.scheduler is not None
        before = svc.statistics("digits")[0]
        reference = mv.engine.infer({"pixels": x[:112]})["probabilities"]

        def ask(i: int, blocking: bool) -> InferResponse:
            req = InferRequest("digits", {"pixels": x[i:i + 1]}, id=str(i))
            return svc.infer_blocking(req) if blocking else svc.infer(req, timeout=10)

        answers = {i: ask(i, True) for i in range(16)}  # serial: each finds the model idle, runs inline
        # Queued while the scheduler is held: released together, the worker combines them into batches.
        with mv.scheduler._cv:
            held = {i: svc.submit(InferRequest("digits", {"pixels": x[i:i + 1]}, id=str(i))) for i in range(16, 32)}
        answers.update({i: f.result(10) for i, f in held.items()})
        with ThreadPoolExecutor(8) as pool:  # overlapping blocking and queued callers
            futs = {i: pool.submit(ask, i, i % 2 == 0) for i in range(32, 96)}
            answers.update({i: f.result() for i, f in futs.items()})
        sched = mv.scheduler
        wait_until(lambda: time.monotonic() >= sched._concurrent_until, 10, 0.01, "the overlap to be forgotten")
        answers.update({i: ask(i, True) for i in range(96, 112)})

        for i, r in answers.items():
            assert r.id == str(i) and r.version == 1
            np.testing.assert_allclose(r.outputs["probabilities"][0], reference[i], rtol=1e-5, atol=1e-6)
        st = svc.statistics("digits")[0]
        n = 112 + before["inference_stats"]["success"]["count"]
        assert st["inference_stats"]["success"]["count"] == n
        assert st["inference_stats"]["queue"]["count"] == n
        assert st["inference_stats"]["fail"]["count"] == 0 and st["in_flight"] == 0
        assert st["inference_count"] == 112 + before["inference_count"]
        runs = {b["batch_size"]: b["compute_infer"]["count"] for b in st["batch_stats"]}
        assert sum(runs.values()) == st["execution_count"]
        assert sum(size * count for size, count in runs.items()) == st["inference_count"]
        assert max(runs) > 1, f"the held requests were not combined: {runs}"
        assert st["inline_count"] - before["inline_count"] >= 32
        decision = st["batching"]
        assert decision["mode"] in ("on", "single")
        # the policy learns only from runs made while requests overlapped (never from inline ones)
        queued_runs = st["execution_count"] - before["execution_count"] - (st["inline_count"] - before["inline_count"])
        assert 0 < decision["single_runs"] + decision["batched_runs"] <= queued_runs
        assert decision["batched_runs"] >= 1
    finally:
        svc.manager.shutdown()


def test_batch_policy_stops_batching_that_does_not_pay_and_probes_back() -> None:
    policy = BatchPolicy(enabled=True)
    assert policy.batch_now() and policy.to_json()["mode"] == "on"
    # A batched sample costs as much as a single one (a small CPU): batching is switched off.
    for _ in range(10):
        policy.record(1, 1, 1_000_000)
        policy.record(8, 8, 8_000_000)
    assert not policy.pays
    state = policy.to_json()
    assert state["mode"] == "single" and "1.00x" in state["reason"] and state["switches"] == 1
    decisions = [policy.batch_now() for _ in range(3)]
    assert decisions == [False, False, False]
    # Runs keep being recorded; after PROBE_EVERY of them one run is allowed to combine again.
    for _ in range(PROBE_EVERY):
        policy.record(1, 1, 1_000_000)
    assert policy.batch_now() and not policy.batch_now()
    # Batched samples become much cheaper (another load, another engine): batching comes back on.
    for _ in range(40):
        policy.record(8, 8, 2_000_000)
    assert policy.pays and policy.to_json()["mode"] == "on" and policy.to_json()["switches"] == 2
    off = BatchPolicy(enabled=False)
    off.record(8, 8, 1)
    assert not off.batch_now() and off.to_json()["mode"] == "off"


def test_batch_policy_keeps_batching_through_a_stall_and_split_batches() -> None:
    """Runs that switched batching off in a c8 load on a 2-core VM (issue 41, recorded there): eight
    callers formed partial batches of 3 to 5 (each sample still a fifth cheaper than a single run), then
    one batch of 4 stalled to 3x its time; later the batches split into pairs of 6 and 2."""
    policy = BatchPolicy(enabled=True)
    for _ in range(16):
        policy.record(1, 1, 460_000)
        policy.record(8, 8, 8 * 290_000)
    for size, us in [(5, 334), (3, 395), (5, 303), (3, 413), (5, 347), (3, 437), (5, 329), (3, 440),
                     (4, 374), (4, 370), (4, 347), (4, 1286)]:
        policy.record(size, size, size * us * 1000)
    assert policy.pays, policy.to_json()
    # Then the callers split into batches of 6 and 2: the pairs cost nearly what single runs do, but most
    # samples ride in the sixes, and per sample the whole costs 0.8x single runs. Batching stays on.
    for _ in range(8):
        policy.record(6, 6, 6 * 340_000)
        policy.record(2, 2, 2 * 475_000)
    assert policy.pays, policy.to_json()
    # A stalled single run does not make batching look cheaper either: the decision rests on many runs.
    off = BatchPolicy(enabled=True)
    for _ in range(16):
        off.record(1, 1, 400_000)
        off.record(8, 8, 8 * 400_000)
    assert not off.pays
    off.record(1, 1, 5_000_000)
    for _ in range(3):
        off.record(8, 8, 8 * 400_000)
    assert not off.pays, off.to_json()


class _Gated(Engine):
    """Doubles its input; a run waits while the gate is closed, so a test can hold the worker."""

    backend, device, precision = "gated", "CPU", "fp32"
    inputs = [EngineTensor("x", "FP32", (-1, 4))]
    outputs = [EngineTensor("y", "FP32", (-1, 4))]

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.runs: list[int] = []

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self.entered.set()
        assert self.gate.wait(10)
        self.runs.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


class _Paced(Engine):
    """Doubles its input after ``delay_s`` (a run's length, set by the test between runs)."""

    backend, device, precision = "paced", "CPU", "fp32"
    inputs = [EngineTensor("x", "FP32", (-1, 4))]
    outputs = [EngineTensor("y", "FP32", (-1, 4))]
    delay_s = 0.001

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        time.sleep(self.delay_s)  # sleep-ok: the run's length is what the scheduler's estimate is tested on
        return {"y": inputs["x"] * 2}


def test_one_long_run_keeps_the_next_requests_off_the_loop() -> None:
    """A model whose runs depend on the values sent, not their size (a loop count, a detector's boxes):
    after one long run an event loop must not run the next request itself, though the bytes are the
    same and the runs before were short. Wall time cannot tell a long run from a preempted short one,
    and blocking the loop for the long one is the worse mistake: every run counts in full."""
    engine = _Paced()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=100))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    try:
        for _ in range(12):
            sched.run_inline(InferRequest("m", {"x": x}), 1)
        limit = 3 * sched.typical_run_ns  # an event loop that may block for three typical runs
        assert isinstance(sched.try_inline(InferRequest("m", {"x": x}), 1, limit), InferResponse)
        engine.delay_s = 0.2
        sched.run_inline(InferRequest("m", {"x": x}), 1)
        engine.delay_s = 0.001
        assert sched.try_inline(InferRequest("m", {"x": x}), 1, limit) is None
    finally:
        assert sched.drain(10)


def test_a_second_long_run_keeps_event_loops_off_the_model_after_its_average_recovers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The moving average forgets a long run after ~40 short ones, and a model whose runs depend on the
    values sent would then block the loop at its next long one. One long run is forgiven (a process
    stalled by its host looks the same); a second within the memory keeps event loops off the model
    for the memory's length, while a thread of its own may still run it."""
    import edged.core.scheduler as scheduler_module

    # Long runs of 0.4 s against a 0.3 s bar: a stall of a loaded CI host does not reach it by chance.
    monkeypatch.setattr(scheduler_module, "_LONG_RUN_NS", 300_000_000)
    monkeypatch.setattr(scheduler_module, "_STRIKE_MEMORY_S", 3.0)
    engine = _Paced()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=100))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)

    def request() -> InferRequest:
        return InferRequest("m", {"x": x})

    def long_run_then_recover(limit: int) -> None:
        engine.delay_s = 0.4
        sched.run_inline(request(), 1)
        engine.delay_s = 0.001
        for _ in range(200):  # short runs until the average is back under the loop's limit
            if sched.typical_run_ns <= limit // 2:
                return
            sched.run_inline(request(), 1)
        raise AssertionError(f"the average did not recover: {sched.typical_run_ns} ns")

    try:
        for _ in range(12):
            sched.run_inline(request(), 1)
        limit = 3 * sched.typical_run_ns  # an event loop that may block for three typical runs
        long_run_then_recover(limit)
        assert isinstance(sched.try_inline(request(), 1, limit), InferResponse), "one long run is forgiven"
        long_run_then_recover(limit)
        assert sched.try_inline(request(), 1, limit) is None, "a second long run keeps the loop off"
        assert isinstance(sched.try_inline(request(), 1, None), InferResponse), "a thread may still run it"
        back = wait_until(lambda: sched.try_inline(request(), 1, limit), 10, what="the memory to expire")
        assert isinstance(back, InferResponse)
    finally:
        assert sched.drain(10)


def test_a_worker_waiting_for_work_holds_no_input_of_the_batch_it_ran() -> None:
    """A request's inputs can be views on a client's shared memory: once the batch is answered the
    worker must not keep them while it waits for the next one, or the gone client's memory stays
    mapped (found by review: a 64 MiB memfd mapped until that model's next queued batch)."""
    import gc
    import weakref

    engine = _Gated()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=100))
    try:
        inputs = [np.full((1, 4), i, dtype=np.float32) for i in range(4)]
        refs = [weakref.ref(x) for x in inputs]
        futures = [sched.submit(InferRequest("m", {"x": x}), 1) for x in inputs]
        engine.gate.set()
        for f in futures:
            f.result(10)
        del inputs, futures, f
        wait_until(lambda: (gc.collect(), all(r() is None for r in refs))[1], 10,
                   what="the batch's inputs to be let go")
    finally:
        assert sched.drain(10)


def test_drain_waits_for_a_run_on_a_callers_thread() -> None:
    """An inline run holds an instance as a worker's does: drain is not done, and the engine may not be
    freed, until it ends (found by review: a reload unloaded the engine under a claimed inline run)."""
    engine = _Gated()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=100))
    x = np.ones((1, 4), np.float32)
    answers: list[InferResponse] = []
    caller = threading.Thread(target=lambda: answers.append(sched.run_inline(InferRequest("m", {"x": x}), 1)))
    caller.start()
    try:
        assert engine.entered.wait(10)
        assert not sched.drain(0.2), "drained while a run was inside the engine"
    finally:
        engine.gate.set()
        caller.join(10)
    assert sched.drain(10)
    np.testing.assert_array_equal(answers[0].outputs["y"], x * 2)


def test_a_reload_in_place_lets_a_run_that_claimed_the_old_copy_finish(model_repo: MakeRepo) -> None:
    """A caller's thread (a shm connection) has claimed the old copy's instance when the version is
    reloaded in place: the old copy is freed only after that run, which is answered."""
    svc = _service(model_repo("digits"))
    manager = svc.manager
    try:
        old = manager.table.find("digits")
        assert old is not None
        claimed, go = threading.Event(), threading.Event()
        enter = old.stats.enter

        def enter_and_wait() -> None:  # the first step of the run after its claim: the caller is preempted
            enter()
            claimed.set()
            assert go.wait(10)
        old.stats.enter = enter_and_wait  # type: ignore[method-assign]
        got: list[object] = []

        def call() -> None:
            try:
                got.append(svc.infer_blocking(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)})))
            except EdgedError as e:
                got.append(e)
        caller = threading.Thread(target=call)
        caller.start()
        assert claimed.wait(10)
        reload = threading.Thread(target=manager.load_model, args=("digits",))
        reload.start()
        wait_until(lambda: old.state is not ModelState.READY, 10, what="the old copy to be retired")
        go.set()
        reload.join(30)
        caller.join(10)
        assert isinstance(got[0], InferResponse), f"the claimed run failed during the reload: {got[0]!r}"
        assert old.engine is None and old.state is ModelState.UNLOADED
    finally:
        manager.shutdown()


def test_a_batch_filling_on_the_only_instance_keeps_it_from_an_inline_caller() -> None:
    """instances.count = 1: while a worker holds a batch waiting for it to fill, the queue is empty, and a
    caller's thread must not take the instance and run beside it (found by review: two runs at once)."""

    class Overlap(_Paced):
        """Runs x[0, 0] seconds; notes the most runs at once."""

        def __init__(self) -> None:
            self.running = self.most = 0
            self.lock = threading.Lock()

        def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
                  ) -> dict[str, np.ndarray]:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                time.sleep(float(inputs["x"][0, 0]))  # sleep-ok: a run's length, set by the value sent
                return {"y": inputs["x"] * 2}
            finally:
                with self.lock:
                    self.running -= 1

    engine = Overlap()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=500_000))
    short, long = np.full((1, 4), 0.01, np.float32), np.full((1, 4), 1.0, np.float32)
    try:
        with sched._cv:  # four requests that overlap: one batch of four, so batches of four are waited for
            first = [sched.submit(InferRequest("m", {"x": short}), 1) for _ in range(4)]
        for f in first:
            f.result(10)
        wait_until(lambda: time.monotonic() >= sched._concurrent_until, 5, what="the overlap to be forgotten")
        queued = sched.submit(InferRequest("m", {"x": short}), 1)  # taken, and held up to 0.5 s for more
        wait_until(lambda: sched.queued == 0, 5, what="the worker to take the request")
        sched.run_inline(InferRequest("m", {"x": long}), 1)  # a 1 s run, longer than the batch's wait
        queued.result(10)
        assert engine.most == 1, f"{engine.most} runs at once on a model with one instance"
    finally:
        assert sched.drain(10)


def test_a_pinned_request_goes_to_its_version_reloaded_in_place(model_repo: MakeRepo,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 1 is served throughout a reload in place: a request pinned to it that found the old copy
    just before the swap is answered by the new copy, as an unpinned one is."""
    import edged.core.service as service_module

    svc = _service(model_repo("digits"))
    manager = svc.manager
    validate = service_module.validate
    swapped = threading.Event()

    def swap_then_validate(mv: Any, req: InferRequest) -> int:  # between the lookup and the queue
        if not swapped.is_set():
            swapped.set()
            threading.Thread(target=manager.load_model, args=("digits",)).start()
            wait_until(lambda: mv.scheduler is None or not mv.scheduler._running, 10, what="the old copy to drain")
        return validate(mv, req)
    monkeypatch.setattr(service_module, "validate", swap_then_validate)
    try:
        for pinned in (None, 1):
            swapped.clear()
            r = svc.infer(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}, version=pinned), 10)
            assert r.version == 1
            wait_until(lambda: svc.is_ready("digits", 1) and len(manager.table.versions("digits")) == 1, 10,
                       what="the reload to finish")
    finally:
        manager.shutdown()


def test_a_filling_batch_leaves_when_full_not_at_the_delay() -> None:
    """A partial batch waits for the size recent traffic reached and leaves the moment it gets
    there: with a 30 s queue delay, paced requests are combined and none waits for the delay."""
    engine = _Gated()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=30_000_000, preferred_batch_sizes=[4]))
    try:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        # Traffic that overlaps: one run held at the gate while seven queue behind it.
        first = [sched.submit(InferRequest("m", {"x": x}), 1)]
        assert engine.entered.wait(10)
        first += [sched.submit(InferRequest("m", {"x": x + i}), 1) for i in range(7)]
        engine.gate.set()
        for f in first:
            f.result(10)
        before = len(engine.runs)
        # Now arrivals paced far apart: each batch waits for its fourth request, then leaves.
        t0 = time.monotonic()
        paced = []
        for i in range(8):
            paced.append(sched.submit(InferRequest("m", {"x": x + i}), 1))
            time.sleep(0.03)  # sleep-ok: arrivals paced far apart
        answers = [f.result(10).outputs["y"] for f in paced]
        took = time.monotonic() - t0
        for i, y in enumerate(answers):
            np.testing.assert_array_equal(y, (x + i) * 2)
        assert took < 10, f"paced requests waited for the 30 s delay ({took:.1f} s): a wake-up was lost"
        assert sum(engine.runs[before:]) == 8 and max(engine.runs[before:]) >= 4, engine.runs
    finally:
        assert sched.drain(10)


def test_a_queued_answer_leaves_after_its_instance_is_free() -> None:
    """A serial caller sends its next request the moment it has an answer. If the instance were still
    marked busy then, that request would queue, mark the traffic as overlapping, and keep every later
    request of the same serial caller off the inline path. The worker frees the instance first."""
    engine = _Gated()
    sched = Scheduler("m", 1, engine, max_batch_size=8, instances=1, stats=ModelStats("m", 1),
                      batching=Batching(max_queue_delay_us=100, preferred_batch_sizes=[4]))
    try:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        busy_at_answer: list[int] = []
        fut = sched.submit(InferRequest("m", {"x": x}), 1)
        assert engine.entered.wait(10)  # the worker holds the run: the callback is added before the answer
        fut.add_done_callback(lambda f: busy_at_answer.append(sched._busy))
        engine.gate.set()
        np.testing.assert_array_equal(fut.result(10).outputs["y"], x * 2)
        assert busy_at_answer == [0]
        # A failure is answered the same way: a request that waited past its deadline behind a held run.
        engine.gate.clear()
        engine.entered.clear()
        held = sched.submit(InferRequest("m", {"x": x}), 1)
        assert engine.entered.wait(10)
        late = sched.submit(InferRequest("m", {"x": x}, deadline=time.monotonic() + 0.01), 1)
        late.add_done_callback(lambda f: busy_at_answer.append(sched._busy))
        time.sleep(0.05)  # sleep-ok: the late request's 10 ms deadline passes while the run is held
        engine.gate.set()
        held.result(10)
        with pytest.raises(DeadlineExceededError):
            late.result(10)
        assert busy_at_answer == [0, 0]
        assert sched.stats.in_flight == 0
        # After the overlap is forgotten, a serial caller runs inline every time.
        wait_until(lambda: time.monotonic() >= sched._concurrent_until, 10, 0.01, "the overlap to be forgotten")
        inline_before = statistics_entry(sched.stats.snapshot())["inline_count"]
        for i in range(20):
            np.testing.assert_array_equal(sched.run_inline(InferRequest("m", {"x": x + i}), 1).outputs["y"],
                                          (x + i) * 2)
        assert statistics_entry(sched.stats.snapshot())["inline_count"] - inline_before == 20
    finally:
        assert sched.drain(10)


def test_two_cpu_instances_run_side_by_side_on_their_share_of_the_cores(model_repo: MakeRepo) -> None:
    """``[instances] count = 2``: two runs at once, each on half the cores (no pool spanning all of them)."""
    repo = model_repo("mobilenet")
    manifest = repo / "mobilenet" / "1" / "model.toml"
    text = manifest.read_text()
    # No dynamic batching, so concurrent requests stay separate runs for the two instances to share.
    text = text[:text.index("[batching]")] + "[batching]\ndynamic = false\n\n" + text[text.index("[instances]"):]
    assert "[instances]\ncount = 1" in text
    manifest.write_text(text.replace("[instances]\ncount = 1", "[instances]\ncount = 2"))
    svc = _service(repo, threads=2)
    try:
        mv = svc.ready_model("mobilenet")
        engine = mv.engine
        assert engine is not None
        assert engine.describe()["intra_op_threads"] == 1
        running, most, lock = [0], [0], threading.Lock()
        real = engine.infer

        def counted(inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                return real(inputs, outputs)
            finally:
                with lock:
                    running[0] -= 1

        engine.infer = counted  # type: ignore[method-assign]
        x = np.random.default_rng(3).random((4, 3, 48, 192), dtype=np.float32)
        want = real({"image": x})["probabilities"]
        for _ in range(5):
            futures = [svc.submit(InferRequest("mobilenet", {"image": x})) for _ in range(8)]
            for f in futures:
                np.testing.assert_allclose(f.result(30).outputs["probabilities"], want, rtol=1e-5, atol=1e-6)
            if most[0] == 2:
                break
        assert most[0] == 2, "two instances never ran at the same time"
        assert svc.statistics("mobilenet")[0]["inference_stats"]["success"]["count"] >= 8
    finally:
        svc.manager.shutdown()


def test_inline_runs_are_in_every_readers_figures() -> None:
    """An inline run only notes itself; whoever reads the statistics folds the notes in first."""
    from edged.telemetry.model_metrics import ModelCounters

    st = ModelStats("m", 1)
    for _ in range(300):  # past the point where the recording thread folds by itself
        st.enter()
        assert st.in_flight == 1
        st.record_inline(2, 10, 100, 5, 130, end_ns=time.monotonic_ns())
        assert st.in_flight == 0
    st.record_batch(4, 2, 20, 200, 10)  # a queued run after the inline ones
    t = statistics_entry(st.snapshot())
    assert t["inference_stats"]["success"] == {"count": 300, "ns": 300 * 130}
    assert t["inference_stats"]["compute_infer"] == {"count": 302, "ns": 300 * 100 + 200}
    assert (t["execution_count"], t["inference_count"], t["inline_count"], t["in_flight"]) == (301, 604, 300, 0)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in t["batch_stats"]] == [(2, 300), (4, 1)]
    assert abs(t["last_inference"] - time.time() * 1000) < 5000
    assert sum(st.latency_counts()) == 300
    counters, in_flight = ModelCounters.read(st)
    assert (counters.success, counters.executions, in_flight) == (300, 301, 0)
    st.record_inline(1, 1, 1, 1, 3, end_ns=time.monotonic_ns())
    assert ModelCounters.read(st)[0].success == 301 and st.latency_counts()[0] >= 1


def test_last_inference_is_when_the_latest_inline_run_ended() -> None:
    st = ModelStats("m", 1)
    now = time.monotonic_ns()
    for ago_s in (30, 10, 20):  # appended out of order, as threads do
        st.enter()
        st.record_inline(1, 1, 1, 1, 3, end_ns=now - ago_s * 10**9)
    assert abs(statistics_entry(st.snapshot())["last_inference"] - (time.time() - 10) * 1000) < 1000
    st.record_batch(1, 1, 1, 1, 1)  # a queued run that ended now, then an older inline one folded later
    st.enter()
    st.record_inline(1, 1, 1, 1, 3, end_ns=now - 5 * 10**9)
    assert abs(statistics_entry(st.snapshot())["last_inference"] - time.time() * 1000) < 1000


def test_inline_runs_recorded_while_readers_fold_are_all_counted() -> None:
    from edged.telemetry.model_metrics import ModelCounters

    st = ModelStats("m", 1)
    per_thread, threads = 3000, 4
    seen_in_flight: list[int] = []

    def record() -> None:
        for _ in range(per_thread):
            st.enter()
            st.record_inline(1, 1, 2, 3, 7, end_ns=time.monotonic_ns())

    def read(stop: threading.Event) -> None:
        while not stop.is_set():
            statistics_entry(st.snapshot())
            _, in_flight = ModelCounters.read(st)
            seen_in_flight.append(in_flight)
            seen_in_flight.append(st.in_flight)

    stop = threading.Event()
    reader = threading.Thread(target=read, args=(stop,))
    reader.start()
    workers = [threading.Thread(target=record) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    reader.join()
    t = statistics_entry(st.snapshot())
    total = per_thread * threads
    assert t["inference_stats"]["success"] == {"count": total, "ns": 7 * total}
    assert (t["execution_count"], t["inline_count"], t["in_flight"], st.in_flight) == (total, total, 0, 0)
    assert sum(st.latency_counts()) == total
    assert seen_in_flight and all(0 <= n <= threads for n in seen_in_flight)


def test_a_version_leaving_between_lookup_and_run_is_retried(digits_service: InferenceService,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A request finding the served version's scheduler refusing (it is unloading) is looked up again."""
    mv = digits_service.ready_model("digits")
    assert mv.scheduler is not None
    real_inline, real_try = Scheduler.run_inline, Scheduler.try_inline
    refusals = [0, 0]

    def refuse_once(i: int, real: Callable[..., object]) -> Callable[..., object]:
        def call(*a: object) -> object:
            if not refusals[i]:
                refusals[i] += 1
                raise ModelNotReadyError("model 'digits' version 1 is unloading")
            return real(*a)
        return call

    monkeypatch.setattr(Scheduler, "run_inline", refuse_once(0, real_inline))
    monkeypatch.setattr(Scheduler, "try_inline", refuse_once(1, real_try))
    x = np.zeros((1, 64), np.float32)
    blocking = digits_service.infer_blocking(InferRequest("digits", {"pixels": x}))
    assert blocking.outputs["probabilities"].shape == (1, 10)
    got = digits_service.infer_or_submit(InferRequest("digits", {"pixels": x}), 10**9)
    resp = got if isinstance(got, InferResponse) else got.result(10)
    assert resp.outputs["probabilities"].shape == (1, 10) and refusals == [1, 1]
