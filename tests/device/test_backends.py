"""The two real engines on the bundled models."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backends import openvino as openvino_backend
from edged.backends.base import LoadRequest
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.openvino import OpenVinoBackend, _numpy_dtype
from edged.backends.options import BackendOptions, OnnxRuntimeOptions, OpenVinoOptions
from edged.errors import EngineUnavailableError, ModelLoadError
from edged.repository.manifest import parse_manifest
from tests.conftest import MODELS
from tests.fresh import imported_by
from tests.spying import results_of

DIGITS = MODELS / "digits" / "1"


def _request(variant_file: str, device: str = "CPU", cache: Path | None = None,
             options: BackendOptions | None = None) -> LoadRequest:
    manifest = parse_manifest(DIGITS / "model.toml")
    variant = next(v for v in manifest.variants if v.file == variant_file)
    return LoadRequest(model="digits", version=1, version_dir=DIGITS, variant=variant, device=device,
                       options=options or BackendOptions(), max_batch_size=manifest.max_batch_size, cache_dir=cache)


def test_onnxruntime_classifies_held_out_digits(digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    engine = OnnxRuntimeBackend().load(_request("model.onnx"))
    assert [t.name for t in engine.inputs] == ["pixels"]
    assert engine.inputs[0].shape == (-1, 64)
    out = engine.infer({"pixels": x})["probabilities"]
    assert out.shape == (len(x), 10)
    assert float(np.mean(out.argmax(1) == y)) >= 0.95


def test_openvino_agrees_with_onnxruntime(tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    ort = OnnxRuntimeBackend().load(_request("model.onnx"))
    ov = OpenVinoBackend().load(_request("openvino/model.xml", cache=tmp_path / "ovcache"))
    assert ov.backend == "openvino" and ov.device == "CPU"
    a = ort.infer({"pixels": x[:32]})["probabilities"]
    b = ov.infer({"pixels": x[:32]})["probabilities"]
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_openvino_copies_inputs_in_and_owned_outputs_out(digits_holdout: tuple[np.ndarray, np.ndarray],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine feeds each input into its request's own tensor: batches of any size from read-only
    buffers (an HTTP body), no reference kept to the caller's array once it returns (its memory may be
    a client's segment, released then), answers that a later run does not overwrite."""
    x, _ = digits_holdout
    fed = results_of(monkeypatch, openvino_backend, "_feed")
    ort = OnnxRuntimeBackend().load(_request("model.onnx"))
    ov = OpenVinoBackend().load(_request("openvino/model.xml"))
    kept = []
    for lo, hi in ((0, 5), (5, 6), (6, 38), (38, 41)):
        body = np.ascontiguousarray(x[lo:hi], dtype=np.float32).tobytes()
        frame = np.frombuffer(body, dtype=np.float32).reshape(hi - lo, 64)
        assert not frame.flags.writeable
        got = ov.infer({"pixels": frame})["probabilities"]
        assert got.shape == (hi - lo, 10)
        np.testing.assert_allclose(got, ort.infer({"pixels": frame})["probabilities"], atol=1e-5)
        kept.append((got, got.copy()))
    for got, first in kept:  # later runs did not write into earlier answers
        np.testing.assert_array_equal(got, first)

    own = np.ascontiguousarray(x[:4], dtype=np.float32)
    ref = weakref.ref(own)
    ov.infer({"pixels": own})
    del own
    gc.collect()
    assert ref() is None, "the engine still holds the caller's input array"

    wide = x[:4].astype(np.float64)  # another dtype: the library's own conversion runs it
    np.testing.assert_allclose(ov.infer({"pixels": wide})["probabilities"], kept[0][1][:4], atol=1e-5)
    assert fed == [True] * 5 + [False], fed  # the float32 runs were fed directly, the float64 one was not


def test_openvino_feeds_only_element_types_whose_arrays_are_the_tensor_bytes() -> None:
    """OpenVINO maps bf16 to float16, a different layout: such inputs stay with the library's conversion."""
    import openvino

    class Port:
        def __init__(self, element: Any) -> None:
            self.element = element

        def get_element_type(self) -> Any:
            return self.element

    assert _numpy_dtype(Port(openvino.Type.f32)) == np.float32
    assert _numpy_dtype(Port(openvino.Type.u8)) == np.uint8
    assert _numpy_dtype(Port(openvino.Type.bf16)) is None
    assert _numpy_dtype(Port(openvino.Type.string)) is None


def test_openvino_static_batch_reshape(tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    ov = OpenVinoBackend().load(_request("openvino/model.xml",
                                         options=OpenVinoOptions(static_batch=8, hint="throughput")))
    assert ov.inputs[0].shape == (8, 64)
    assert ov.infer({"pixels": x[:8]})["probabilities"].shape == (8, 10)


def test_openvino_writes_its_compiled_model_cache(tmp_path: Path) -> None:
    cache = tmp_path / "ovcache"
    OpenVinoBackend().load(_request("openvino/model.xml", cache=cache, options=OpenVinoOptions(static_batch=4)))
    assert any(cache.iterdir()), "OpenVINO should have written a compiled blob to the cache dir"


def test_engines_are_thread_safe(digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    x, _ = digits_holdout
    for engine in (OnnxRuntimeBackend().load(_request("model.onnx")),
                   OpenVinoBackend().load(_request("openvino/model.xml"))):
        want = engine.infer({"pixels": x[:16]})["probabilities"]
        def run(_: int, engine: object = engine) -> np.ndarray:
            return engine.infer({"pixels": x[:16]})["probabilities"]  # type: ignore[attr-defined,no-any-return]

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(run, range(40)))
        for o in outs:
            np.testing.assert_allclose(o, want, atol=1e-6)


def test_corrupt_file_is_a_load_error_naming_the_model(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"garbage")
    manifest = parse_manifest(DIGITS / "model.toml")
    req = LoadRequest(model="digits", version=7, version_dir=tmp_path, variant=manifest.variants[0])
    with pytest.raises(ModelLoadError, match=r"model 'digits' version 7 \(model.onnx\)"):
        OnnxRuntimeBackend().load(req)


def test_unavailable_accelerator_provider_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="providers"):
        OnnxRuntimeBackend().load(_request("model.onnx", device="GPU",
                                           options=OnnxRuntimeOptions(providers=["CUDAExecutionProvider"])))


def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate a device without OpenVINO installed: the import itself fails.
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(EngineUnavailableError, match=r"pip install 'edged\[openvino\]'"):
        OpenVinoBackend().check_available()


def test_availability_is_checked_without_importing_the_library() -> None:
    """Listing OpenVINO as an alternative (a remembered engine choice) must not map its runtime into
    the daemon: the import alone costs ~34 MB of RSS; it happens when an engine is loaded."""
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("OpenVINO is not installed here")
    code = (
        "from edged.backends.openvino import OpenVinoBackend; "
        "from edged.backends.selection import unavailable_reason; "
        "OpenVinoBackend().check_available(); assert unavailable_reason('openvino') is None"
    )
    assert imported_by(code, ["openvino"]) == []


def _with_instances(req: LoadRequest, instances: int, threads: int = 0) -> LoadRequest:
    return dataclasses.replace(req, instances=instances, threads=threads)


def test_cpu_instances_share_the_thread_budget_instead_of_each_spanning_it() -> None:
    """N runs at once on one session: its pool shrinks so that callers and pool together fill the budget."""
    base = _request("model.onnx")
    backend = OnnxRuntimeBackend()

    def pool(req: LoadRequest) -> int:
        return int(backend.load(req).describe()["intra_op_threads"])

    assert pool(_with_instances(base, 1)) == 0  # ONNX Runtime's own default
    assert pool(_with_instances(base, 1, threads=4)) == 4
    assert pool(_with_instances(base, 2, threads=8)) == 7  # 2 callers + 6 pool threads = 8
    assert pool(_with_instances(base, 2, threads=2)) == 1  # each run on its caller's thread alone
    assert pool(_with_instances(base, 8, threads=4)) == 1
    assert pool(_with_instances(base, 2)) == max(1, len(os.sched_getaffinity(0)) - 1)  # budget: usable CPUs
    asked = _request("model.onnx", options=OnnxRuntimeOptions(intra_op_threads=3))
    assert pool(_with_instances(asked, 2, threads=4)) == 3  # asked for


def test_openvino_gives_each_cpu_instance_a_stream(digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    backend = OpenVinoBackend()
    one = backend.load(_with_instances(_request("openvino/model.xml"), 1, threads=2))
    two = backend.load(_with_instances(_request("openvino/model.xml"), 2, threads=2))
    assert one.describe()["streams"] == 1
    assert two.describe()["streams"] == 2 and two.describe()["threads"] == 2
    own = _request("openvino/model.xml", options=OpenVinoOptions(num_streams=1))
    chosen = backend.load(_with_instances(own, 2, threads=2))
    assert chosen.describe()["streams"] == 1  # the profile's own choice wins
    np.testing.assert_allclose(two.infer({"pixels": x[:8]})["probabilities"],
                               one.infer({"pixels": x[:8]})["probabilities"], atol=1e-5)
