"""One refused request must not break the next: the poison sequence on every engine, over HTTP.

OpenVINO's CPU plugin keeps a refused shape in its compiled model: after a request it refuses,
requests at the shape that last succeeded failed (500) until one of another shape succeeded,
while readiness said 200. One real ``edged run`` serves four real public models (tests/corpus.py)
twice, once on ONNX Runtime (the ONNX file) and once on OpenVINO (the same model as OpenVINO IR,
which only OpenVINO reads), and every one gets good, bad, good, good, other shape, good: every good
request must answer 200 with the answer it gave before the bad one. The same daemon shows ONNX
Runtime's own stderr in its log without colour codes.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edged.client.http import HttpClient, HttpStatusError
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import EdgedError, InvalidInputError
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.transports.v2_ops import server_ready
from tests import corpus
from tests.conftest import device_config, sha256_file
from tests.edged_process import edged_run
from tests.netutil import free_port

pytestmark = pytest.mark.timeout(300)

# Per model: a shape OpenVINO refuses (detector strides, recogniser pooling) and another good one.
SHAPES = {"nudenet": ((33, 47), (256, 256)), "ocr_det": ((33, 47), (256, 256)),
          "ocr_rec": ((8, 8), (48, 256)), "ocr_cls": ((8, 8), (48, 128))}
ENGINES = ("onnxruntime", "openvino")
PROFILE = """
name = "containment-cpu"
priority = 1
select = "first"
[match]
all = [ { fact = "cpu.arch", equals = "x86_64" } ]
[[backends]]
backend = "onnxruntime"
device = "CPU"
precisions = ["fp32"]
[[backends]]
backend = "openvino"
device = "CPU"
precisions = ["fp32"]
"""


def _write(repo: Path, m: corpus.CorpusModel, engine: str) -> None:
    """``<name>_<engine>``: the ONNX file (ONNX Runtime is the profile's first) or OpenVINO IR (only
    OpenVINO reads it), with the real shape declared so warm-up and self-test run on it."""
    import openvino as ov

    vdir = repo / f"{m.name}_{engine}" / "1"
    vdir.mkdir(parents=True)
    if engine == "onnxruntime":
        shutil.copyfile(m.fetch(), vdir / "model.onnx")
        variant = f'file = "model.onnx"\nformat = "onnx"\nsha256 = "{sha256_file(vdir / "model.onnx")}"\n'
    else:
        ov.save_model(ov.Core().read_model(str(m.fetch())), str(vdir / "model.xml"), compress_to_fp16=False)
        variant = (f'file = "model.xml"\nformat = "openvino"\nsha256 = "{sha256_file(vdir / "model.xml")}"\n'
                   f'extra_files = [{{ file = "model.bin", sha256 = "{sha256_file(vdir / "model.bin")}" }}]\n')
    shapes = f"[warmup.shapes.{m.input}]\nshape = {list(m.shape[1:])}\n"
    (vdir / "model.toml").write_text(f"[[variants]]\n{variant}\n{shapes}")


@dataclass
class Daemon:
    url: str
    log: Path
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    pytest.importorskip("openvino")
    tmp = tmp_path_factory.mktemp("containment")
    models = [m for m in corpus.CORPUS if m.name in SHAPES]
    try:
        for m in models:
            m.fetch()
    except corpus.UnavailableError as e:
        pytest.skip(str(e))
    repo = tmp / "models"
    for m in models:
        for engine in ENGINES:
            _write(repo, m, engine)
    (tmp / "profiles").mkdir()
    (tmp / "profiles" / "containment-cpu.toml").write_text(PROFILE)
    port = free_port()
    cfg = device_config(tmp, repo, f"""
        profiles_dir = "{tmp / 'profiles'}"
        profile = "containment-cpu"
        [http]
        listen = "127.0.0.1:{port}"
        [telemetry]
        enabled = false
        [logging]
        level = "info"
        """, device_id="containment-test")
    log_path = tmp / "edged.log"
    names = [f"{m.name}_{e}" for m in models for e in ENGINES]
    url = f"127.0.0.1:{port}"

    def ready() -> bool:
        with HttpClient(url, timeout=5) as c:
            return all(c.ready(n) for n in names)

    # OSError, EdgedError: not listening yet
    with edged_run(cfg, log_path, ready, timeout=180, interval=0.2, transient=(OSError, EdgedError)) as proc:
        with HttpClient(url, timeout=5) as c:
            for m in models:  # each served by the engine it is named after
                for e in ENGINES:
                    assert c.metadata(f"{m.name}_{e}")["parameters"]["backend"] == e
        yield Daemon(url, log_path, proc)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", list(SHAPES))
def test_poison_sequence_every_good_request_answers(daemon: Daemon, model: str, engine: str) -> None:
    m = next(c for c in corpus.CORPUS if c.name == model)
    bad_hw, other_hw = SHAPES[model]
    rng = np.random.default_rng(7)
    good = {m.input: rng.random(m.shape, dtype=np.float32)}
    bad = {m.input: rng.random((*m.shape[:2], *bad_hw), dtype=np.float32)}
    other = {m.input: rng.random((*m.shape[:2], *other_hw), dtype=np.float32)}
    name = f"{model}_{engine}"
    with HttpClient(daemon.url, timeout=60) as c:
        want = c.infer(name, good)
        try:
            c.infer(name, bad)
        except HttpStatusError as e:  # refused as the input's fault, naming the dimension
            assert e.status == 400 and "cannot take this input" in str(e), e
        else:
            assert engine == "onnxruntime", f"{name} took a {bad_hw} input; pick a shape it refuses"
        for x in (good, good, other, good):
            got = c.infer(name, x)  # raises on anything but 200
            if x is good:
                for k in want:
                    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert c.ready(name) and c.ready()


def test_engine_library_stderr_is_in_the_log_without_colour_codes(daemon: Daemon) -> None:
    m = next(c for c in corpus.CORPUS if c.name == "nudenet")
    with HttpClient(daemon.url, timeout=60) as c, pytest.raises(HttpStatusError):
        c.infer("nudenet_onnxruntime", {m.input: np.zeros((1, 3, 33, 47), np.float32)})
    deadline = time.monotonic() + 30
    while "edged.engine" not in daemon.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)
    text = daemon.log.read_bytes()
    lines = [ln for ln in text.decode(errors="replace").splitlines() if "edged.engine" in ln]
    # ONNX Runtime's own line for the refused run, now a record of the daemon's log at its level
    assert any(" ERROR edged.engine: " in ln and "[E:onnxruntime" in ln for ln in lines), lines[-5:]
    assert b"\x1b[" not in text


# ---- readiness while OpenVINO restores a clean compiled model (in process) -------------------------
@pytest.fixture
def ov_cls(tmp_path: Path) -> Iterator[tuple[ModelManager, InferenceService]]:
    pytest.importorskip("openvino")
    m = next(c for c in corpus.CORPUS if c.name == "ocr_cls")
    try:
        corpus.write_version(tmp_path / "models", m, m.fetch(), declare=True)
    except corpus.UnavailableError as e:
        pytest.skip(str(e))
    mgr = ModelManager(tmp_path / "models", ModelsSection(),
                       [BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])])
    mgr.load_all()
    try:
        yield mgr, InferenceService(mgr)
    finally:
        mgr.shutdown()


def test_openvino_restores_off_the_request_path_and_readiness_says_so(ov_cls: tuple[ModelManager,
                                                                                     InferenceService]) -> None:
    mgr, svc = ov_cls
    mv = mgr.table.find("ocr_cls")
    assert mv is not None and mv.scheduler is not None
    engine = mv.scheduler.engine
    assert engine.backend == "openvino"
    # Hold the restore (the real one runs once let go) so that "meanwhile" can be looked at.
    remake, gate = engine._remake, threading.Event()  # type: ignore[attr-defined]

    def held(compiled: object) -> object:
        gate.wait(60)
        return remake(compiled)

    engine._remake = held  # type: ignore[attr-defined]
    rng = np.random.default_rng(3)
    good = rng.random((1, 3, 48, 192), dtype=np.float32)
    want = svc.infer(InferRequest(model="ocr_cls", inputs={"x": good}), 30).outputs
    with pytest.raises(InvalidInputError, match="cannot take this input"):  # answered at once, not after a restore
        svc.infer(InferRequest(model="ocr_cls", inputs={"x": rng.random((1, 3, 8, 8), dtype=np.float32)}), 30)
    assert engine.restoring
    assert not svc.is_ready("ocr_cls") and not server_ready(svc, stopping=False)
    # An event loop never runs it inline meanwhile (it would block until the restore ends): it queues.
    assert mv.scheduler.try_inline(InferRequest(model="ocr_cls", inputs={"x": good}), 1, 1 << 62) is None
    with ThreadPoolExecutor(1) as pool:
        waiting: Future[object] = pool.submit(
            lambda: svc.infer(InferRequest(model="ocr_cls", inputs={"x": good}), 60).outputs)
        assert not waiting.done()  # waits for the clean model instead of failing on the poisoned one
        gate.set()
        got = waiting.result(60)
    assert isinstance(got, dict)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert not engine.restoring and svc.is_ready("ocr_cls") and server_ready(svc, stopping=False)
    assert engine.describe()["restores"] == 1


def test_unloading_waits_for_a_restore_in_progress(ov_cls: tuple[ModelManager, InferenceService]) -> None:
    """A restore still inside OpenVINO when the process exits aborts it (std::terminate): unload, which
    shutdown and `edged models list` call last, lets the restore finish first."""
    mgr, svc = ov_cls
    mv = mgr.table.find("ocr_cls")
    assert mv is not None and mv.scheduler is not None
    engine = mv.scheduler.engine
    remake, entered, gate = engine._remake, threading.Event(), threading.Event()  # type: ignore[attr-defined]

    def held(compiled: object) -> object:
        entered.set()
        gate.wait(60)
        return remake(compiled)

    engine._remake = held  # type: ignore[attr-defined]
    bad = np.random.default_rng(5).random((1, 3, 8, 8), dtype=np.float32)
    with pytest.raises(EdgedError):  # the input's fault or the engine's: either way the run failed
        svc.infer(InferRequest(model="ocr_cls", inputs={"x": bad}), 30)
    assert entered.wait(30), "no restore started after the failed run"
    with ThreadPoolExecutor(1) as pool:
        unloading = pool.submit(engine.unload)
        with pytest.raises(FuturesTimeout):
            unloading.result(timeout=0.3)  # still waiting: the restore is held inside OpenVINO's remake
        gate.set()
        unloading.result(60)
    assert not [t for t in threading.enumerate() if t.name == "edged-openvino-restore" and t.is_alive()]
