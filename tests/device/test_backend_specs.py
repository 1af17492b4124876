"""Backends as data: one spec per engine is all the daemon needs to know of it (edged.backends.specs)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from edged.backends.base import Backend, Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.options import BackendOptions
from edged.backends.specs import SPECS, BackendSpec, native_backend, platform_of
from edged.config import ModelsSection, VersionPolicy
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import ConfigError, EngineUnavailableError
from edged.profiles import BackendPreference, load_profiles
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import metadata_response
from edged.transports.http.config import model_config

MakeRepo = Callable[..., Path]


# ---- a new engine, declared the way a real one is ----------------------------------------------------
class TaggedOptions(BackendOptions):
    tag: str = ""


class TaggedEngine(Engine):
    """ONNX Runtime's engine, carrying the profile's ``tag`` (its answers must pass the golden check)."""

    def __init__(self, inner: Engine, tag: str) -> None:
        self.inner, self.tag = inner, tag
        self.backend, self.device, self.precision = "tagged", inner.device, inner.precision
        self.inputs, self.outputs = inner.inputs, inner.outputs

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        return self.inner.infer(inputs, outputs)


class TaggedBackend(Backend):
    name = "tagged"

    def check_available(self) -> None:
        OnnxRuntimeBackend().check_available()

    def load(self, request: LoadRequest) -> Engine:
        options = TaggedOptions.of(request.options)  # typed all the way from the profile
        inner = OnnxRuntimeBackend().load(dataclasses.replace(request, options=BackendOptions()))
        return TaggedEngine(inner, options.tag)


def _tagged() -> type[Backend]:
    return TaggedBackend


def _missing() -> type[Backend]:
    import edged_no_such_engine  # type: ignore[import-not-found]  # noqa: F401

    raise AssertionError("unreachable")


TAGGED = BackendSpec(name="tagged", title="Tagged ORT", options=TaggedOptions, devices=("CPU",),
                     platform="tagged_onnx", formats=("onnx",), library="onnxruntime", distributions=(),
                     install="nothing: it is a test", implementation=_tagged)


@pytest.fixture
def tagged(monkeypatch: pytest.MonkeyPatch) -> BackendSpec:
    monkeypatch.setitem(SPECS, TAGGED.name, TAGGED)
    return TAGGED


def test_a_new_spec_is_all_the_daemon_needs(tagged: BackendSpec, model_repo: MakeRepo, tmp_path: Path) -> None:
    """Profiles, the factory, selection, the loader, the service and Triton's config all take it up."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "tagged.toml").write_text('name = "tagged"\npriority = 1\n[match]\n[[backends]]\n'
                                          'backend = "tagged"\nprecisions = ["fp32"]\noptions = { tag = "blue" }\n')
    (pref,) = next(p for p in load_profiles([profiles]) if p.name == "tagged").backends
    assert pref.options == TaggedOptions(tag="blue")
    assert pref.model_dump(mode="json")["options"] == {"tag": "blue"}  # what `edged detect --json` shows

    repo = model_repo("digits")
    manager = ModelManager(repo, ModelsSection(), [pref])
    manager.load_all()
    svc = InferenceService(manager)
    try:
        mv = svc.ready_model("digits")
        plain = OnnxRuntimeBackend().load(LoadRequest("digits", 1, repo / "digits" / "1", mv.candidate.variant,
                                                      max_batch_size=mv.max_batch_size))
        x = np.random.default_rng(0).random((3, 64), dtype=np.float32)
        got = svc.infer(InferRequest("digits", {"pixels": x}), timeout=30).outputs["probabilities"]
        np.testing.assert_allclose(got, plain.infer({"pixels": x})["probabilities"], rtol=1e-5)
        assert mv.scheduler is not None and getattr(mv.scheduler.engine, "tag", None) == "blue"
        meta = metadata_response(svc.describe("digits"))
        assert meta["platform"] == "tagged_onnx"
        assert meta["parameters"]["backend"] == "tagged"
        config = model_config(mv, VersionPolicy())
        assert (config["platform"], config["backend"]) == ("tagged_onnx", "tagged")
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("line", "problem"), [
    ('device = "GPU"\noptions = { tag = "x" }', "backends[0]: device 'GPU' is not one tagged offers (CPU)"),
    ('options = { tga = "x" }', "backends[0].options: tga: unknown key"),
])
def test_a_new_spec_checks_its_own_devices_and_options(tagged: BackendSpec, tmp_path: Path, line: str,
                                                       problem: str) -> None:
    (tmp_path / "bad.toml").write_text('name = "bad"\npriority = 1\n[match]\n[[backends]]\n'
                                       f'backend = "tagged"\nprecisions = ["fp32"]\n{line}\n')
    with pytest.raises(ConfigError) as info:
        load_profiles([tmp_path])
    assert problem in str(info.value)


def test_every_place_that_names_backends_reads_the_registry() -> None:
    for name, spec in SPECS.items():
        assert get_backend(name).name == name  # the implementation the spec imports is that engine's
        pref = BackendPreference(backend=name, device=spec.devices[0], precisions=["fp32"])
        assert type(pref.options) is spec.options
        assert platform_of(name) == spec.platform
        assert native_backend(spec.formats[0]) == name
    with pytest.raises(ValidationError) as info:
        BackendPreference(backend="tflite", precisions=["fp32"])
    expected = ", ".join(repr(n) for n in SPECS).rsplit(", ", 1)
    assert f"Input should be {' or '.join(expected)}" in str(info.value)
    with pytest.raises(EngineUnavailableError, match=f"known: {', '.join(SPECS)}"):
        get_backend("tflite")


def test_a_missing_implementation_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SPECS, "gone", dataclasses.replace(TAGGED, name="gone", title="Gone",
                                                           install="the 'gone' package", implementation=_missing))
    with pytest.raises(EngineUnavailableError, match=r"Gone backend cannot be imported .*install the 'gone' package"):
        get_backend("gone")


def test_importing_the_specs_imports_no_engine() -> None:
    """The registry, the factory and profile validation load no engine library and no engine module."""
    code = (
        "import sys\n"
        "from edged.backends.specs import SPECS\n"
        "import edged.backends.factory\n"
        "from edged.profiles import load_profiles\n"
        "assert load_profiles()\n"
        "engines = {s.library for s in SPECS.values()}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in engines)\n"
        "allowed = {'edged.backends', 'edged.backends.specs', 'edged.backends.options', 'edged.backends.factory',\n"
        "           'edged.backends.base'}\n"
        "bad += sorted(m for m in sys.modules if m.startswith('edged.backends') and m not in allowed)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
