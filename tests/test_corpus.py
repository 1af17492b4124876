"""Real public models from PyPI wheels, served from variant-only manifests on every transport.

Each model must answer like raw ONNX Runtime over tritonclient (JSON, binary, system shared
memory), the native shm client and `edged infer` (the command line, over HTTP). Skipped with the reason when the wheels
cannot be fetched (tests/corpus.py).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.client.shm import ShmClient
from edged.config import parse_config
from edged.core.model_versions import ModelState
from edged.transports.shm.transport import ShmTransport
from tests import corpus, perf_analyzer
from tests.conftest import EDGED
from tests.http_helpers import AUTH, TOKEN, Served, served

pytestmark = pytest.mark.timeout(600)
JSON_OK = 200_000  # elements: bigger tensors skip the (slow, text) JSON round trip


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    try:
        return corpus.fetch()
    except corpus.UnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def daemon(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    tmp = tmp_path_factory.mktemp("corpus")
    for m in corpus.CORPUS:
        corpus.write_version(tmp / "models", m, files[m.name], declare=False)
    # perf_analyzer names its segments after the tensors: any name, with the token
    with served(tmp / "models", tmp, extra="[shm]\nsystem_shm_prefix = \"\"\n") as s:
        cfg = parse_config(f'[device]\nstate_dir = "{tmp}/state"\nruntime_dir = "{tmp}/run"\n')
        shm = ShmTransport(cfg, s.service)
        shm.start_blocking()
        try:
            yield s, shm.path
        finally:
            shm.stop_blocking()


def raw_ort(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {sess.get_inputs()[0].name: x}),
                    strict=True))


def close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert set(got) == set(want), what
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=1e-4, err_msg=f"{what}: {k}")


@pytest.mark.parametrize("m", corpus.CORPUS, ids=[m.name for m in corpus.CORPUS])
def test_variant_only_manifest_serves_like_raw_ort(m: corpus.CorpusModel, files: dict[str, Path],
                                                  daemon: tuple[Served, Path], tmp_path: Path) -> None:
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as tshm

    srv, shm_path = daemon
    mv = srv.manager.table.find(m.name)
    assert mv is not None and mv.state is ModelState.READY, mv and mv.reason
    # Triton's auto-completion: every tensor starts dynamic -> batched, dynamic batching on.
    assert mv.max_batch_size == (4 if m.batched else 0)
    assert (mv.scheduler is not None and mv.scheduler.batching is not None) == m.batched
    x = np.random.default_rng(7).random(m.shape, dtype=np.float32)
    want = raw_ort(files[m.name], x)
    triton = th.InferenceServerClient(srv.url.removeprefix("http://"))
    try:
        for binary in ((True, False) if x.size <= JSON_OK else (True,)):
            inp = th.InferInput(m.input, list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            outs = [th.InferRequestedOutput(k, binary_data=binary) for k in want]
            r = triton.infer(m.name, [inp], outputs=outs)
            close({k: r.as_numpy(k) for k in want}, want, f"tritonclient binary={binary}")
        tag = uuid.uuid4().hex[:8]
        sizes = {k: v.nbytes for k, v in want.items()}
        hin = tshm.create_shared_memory_region(f"in_{tag}", f"/corpus_in_{tag}", x.nbytes)
        hout = {k: tshm.create_shared_memory_region(f"o{i}_{tag}", f"/corpus_o{i}_{tag}", sizes[k])
                for i, k in enumerate(want)}
        try:
            tshm.set_shared_memory_region(hin, [x])
            triton.register_system_shared_memory(f"in_{tag}", f"/corpus_in_{tag}", x.nbytes, headers=dict(AUTH))
            for i, k in enumerate(want):
                triton.register_system_shared_memory(f"o{i}_{tag}", f"/corpus_o{i}_{tag}", sizes[k], headers=dict(AUTH))
            inp = th.InferInput(m.input, list(x.shape), "FP32")
            inp.set_shared_memory(f"in_{tag}", x.nbytes)
            outs = []
            for i, k in enumerate(want):
                o = th.InferRequestedOutput(k, binary_data=True)
                o.set_shared_memory(f"o{i}_{tag}", sizes[k])
                outs.append(o)
            r = triton.infer(m.name, [inp], outputs=outs, headers=dict(AUTH))
            got = {}
            for k in want:
                meta = r.get_output(k)
                got[k] = tshm.get_contents_as_numpy(hout[k], np.float32, meta["shape"])
            close(got, want, "system shared memory")
        finally:
            triton.unregister_system_shared_memory(headers=dict(AUTH))
            tshm.destroy_shared_memory_region(hin)
            for h in hout.values():
                tshm.destroy_shared_memory_region(h)
    finally:
        triton.close()
    with ShmClient(shm_path) as c:
        close(c.infer(m.name, {m.input: x}), want, "native shm client")
    # the command line a user types: edged infer MODEL --input x.npy, against the serving daemon
    np.save(tmp_path / "x.npy", x)
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[device]\nstate_dir = "{tmp_path}/state"\n[http]\nlisten = "{srv.url.removeprefix("http://")}"\n')
    r = subprocess.run([*EDGED, "infer", m.name, "--input", str(tmp_path / "x.npy"), "--transport", "http",
                        "--config", str(cfg), "--json"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    printed = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
               for o in json.loads(r.stdout)["outputs"]}
    close(printed, want, "edged infer")



@pytest.mark.parametrize("shm", [[], ["--shared-memory", "system", "--output-shared-memory-size", "4096"]],
                         ids=["http", "system-shm"])
def test_perf_analyzer_on_a_real_dynamic_shape_model(daemon: tuple[Served, Path], shm: list[str]) -> None:
    """Triton's C++ client reads the auto-completed config (max_batch_size 4, dims -1) and batches 2."""
    try:
        pa = perf_analyzer.get()
    except perf_analyzer.UnavailableError as e:
        pytest.skip(str(e))
    srv, _ = daemon
    r = pa.run("-m", "ocr_cls", "-u", srv.url.removeprefix("http://"), "-i", "http", "-b", "2",
               "--shape", "x:3,48,192", "--concurrency-range", "1", "--measurement-mode", "count_windows",
               "--measurement-request-count", "20", "-s", perf_analyzer.ANY_STABILITY,
               "-H", f"Authorization: Bearer {TOKEN}", *shm)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Throughput:" in out and "error" not in out.lower(), out[-2000:]
