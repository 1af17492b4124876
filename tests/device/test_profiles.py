"""Device profiles: loading, overriding, rule semantics, and the profile each fixture device gets."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import pytest

from edged.backends.options import OpenVinoOptions, TensorRtOptions
from edged.detect import render_detect
from edged.errors import ConfigError
from edged.hardware import HardwareFacts, probe
from edged.hardware.facts import CpuFacts, JetsonFacts, MemoryFacts
from edged.profiles import (
    BackendPreference,
    DeviceProfile,
    MatchRule,
    MatchSpec,
    bundled_profiles_dir,
    load_profiles,
    match_profile,
)

SYSROOTS = Path(__file__).parent.parent / "fixtures" / "sysroots"

EXPECTED_PROFILE = {
    "jetson-orin-nano": "jetson-orin",
    "jetson-agx-orin": "jetson-orin",
    "jetson-xavier-nx": "jetson-xavier",
    "jetson-xavier-nx-jp4": "jetson-xavier",
    "jetson-nano": "jetson-nano",
    "intel-core-ultra-npu": "intel-npu",
    "intel-core-igpu": "intel-igpu",
    "intel-atom-celeron": "intel-cpu",
    "amd-x86-64": "x86-64-cpu",
    "raspberry-pi-5": "arm64-dotprod",
    "x86-64-nvidia-dgpu": "nvidia-dgpu",
}


@pytest.fixture(scope="module")
def bundled() -> list[DeviceProfile]:
    return load_profiles()


def test_every_fixture_has_an_expected_profile() -> None:
    assert {p.name for p in SYSROOTS.iterdir() if p.is_dir()} == set(EXPECTED_PROFILE)


@pytest.mark.parametrize(("fixture", "expected"), sorted(EXPECTED_PROFILE.items()))
def test_fixture_profile(bundled: list[DeviceProfile], fixture: str, expected: str) -> None:
    match = match_profile(probe(SYSROOTS / fixture, engines=False), bundled)
    assert match.profile.name == expected
    assert match.reasons
    names = [p.name for p in bundled]
    assert [name for name, _ in match.rejected] == names[: names.index(expected)]
    assert all(why for _, why in match.rejected)


def test_this_machine(bundled: list[DeviceProfile]) -> None:
    facts = probe(Path("/"))
    match = match_profile(facts, bundled)
    if platform.machine() == "x86_64":
        assert match.profile.name in {"nvidia-dgpu", "intel-npu", "intel-igpu", "intel-cpu", "x86-64-cpu"}
    assert match.profile.name != "generic" or platform.machine() not in ("x86_64", "aarch64")


def test_bundled_profiles_are_complete(bundled: list[DeviceProfile]) -> None:
    names = [p.name for p in bundled]
    assert {"jetson-orin", "jetson-xavier", "jetson-nano", "nvidia-dgpu", "intel-npu", "intel-igpu", "intel-cpu",
            "x86-64-cpu", "arm64-dotprod", "arm64-cpu", "generic"} <= set(names)
    assert names[-1] == "generic"
    assert bundled == sorted(bundled, key=lambda p: (p.priority, p.name))
    assert len({p.priority for p in bundled}) == len(bundled)  # no accidental ties among bundled ones
    for profile in bundled:
        assert profile.description, profile.name
        assert profile.source is not None and profile.source.parent == bundled_profiles_dir()
        assert profile.source.stem == profile.name
    # An unknown machine (nothing readable) still gets the catch-all.
    assert match_profile(HardwareFacts(), bundled).profile.name == "generic"


def test_bundled_dir_is_the_checkout() -> None:
    assert bundled_profiles_dir() == Path(__file__).resolve().parents[2] / "device_profiles"


OVERRIDE = """
name = "jetson-orin"
priority = 10
description = "site override: DLA first"
[match]
all = [ { fact = "jetson.module", equals = "agx-orin" } ]
[[backends]]
backend = "tensorrt"
device = "DLA"
precisions = ["int8"]
options = { dla_core = 0, gpu_fallback = true }
"""


def test_user_dir_overrides_by_name(tmp_path: Path) -> None:
    (tmp_path / "my-orin.toml").write_text(OVERRIDE)
    profiles = load_profiles([tmp_path])
    orin = [p for p in profiles if p.name == "jetson-orin"]
    assert len(orin) == 1 and orin[0].source == tmp_path / "my-orin.toml"
    assert orin[0].backends[0].options == TensorRtOptions(dla_core=0, gpu_fallback=True)  # typed from the file
    assert match_profile(probe(SYSROOTS / "jetson-agx-orin", engines=False), profiles).profile.description == (
        "site override: DLA first")
    # The override only matches AGX Orin, so the Orin Nano now falls through to the next Jetson profile.
    nano = match_profile(probe(SYSROOTS / "jetson-orin-nano", engines=False), profiles)
    assert nano.profile.name == "jetson-generic"
    assert nano.rejected[0] == ("jetson-orin", 'jetson.module equals "agx-orin" (is "orin-nano")')


def test_later_dir_wins_and_new_profile_can_jump_the_queue(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    lab = ('name = "lab"\npriority = {p}\ndescription = "{d}"\n[match]\n'
           '[[backends]]\nbackend = "openvino"\ndevice = "AUTO"\nprecisions = ["fp16"]\n')
    (first / "lab.toml").write_text(lab.format(p=1, d="first"))
    (second / "lab.toml").write_text(lab.format(p=1, d="second"))
    profiles = load_profiles([first, second])
    assert profiles[0].name == "lab" and profiles[0].description == "second"
    assert match_profile(probe(SYSROOTS / "amd-x86-64", engines=False), profiles).profile.name == "lab"


def _bad(tmp_path: Path, text: str) -> ConfigError:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_profiles([tmp_path])
    assert str(path) in str(info.value)
    return info.value


GOOD_HEAD = 'name = "x"\npriority = 5\n[match]\n'
GOOD_BACKEND = '[[backends]]\nbackend = "onnxruntime"\ndevice = "CPU"\nprecisions = ["fp32"]\n'


@pytest.mark.parametrize(("text", "key"), [
    (GOOD_HEAD + '[[backends]]\nbackend = "onnxruntime"\nprecisions = ["fp64"]\n', "backends[0].precisions[0]"),
    (GOOD_HEAD + '[[backends]]\nbackend = "tvm"\nprecisions = ["fp32"]\n', "backends[0].backend"),
    (GOOD_HEAD + '[[backends]]\nbackend = "tensorrt"\ndevice = "NPU"\nprecisions = ["fp16"]\n', "backends[0]"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "jetson.modul", equals = "nano" } ]\n' + GOOD_BACKEND,
     "match.all[0].fact"),
    ('name = "x"\npriority = 5\n[match]\nany = [ { fact = "cpu.arch" } ]\n' + GOOD_BACKEND, "match.any[0]"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "cpu.arch", equals = "a", in = ["b"] } ]\n'
     + GOOD_BACKEND, "match.all[0]"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "cpu.model", matches = "(" } ]\n' + GOOD_BACKEND,
     "match.all[0].matches"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "cpu.arch", equals = [1] } ]\n' + GOOD_BACKEND,
     "match.all[0].equals"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "cpu.flags", has = 3 } ]\n' + GOOD_BACKEND,
     "match.all[0].has"),
    ('name = "x"\npriority = 5\n[match]\nnone = [ { fact = "cpu.cores", gte = true } ]\n' + GOOD_BACKEND,
     "match.none[0].gte"),
    ('name = "x"\npriority = 5\n[match]\nall = [ { fact = "cpu.arch", in = "x86_64" } ]\n' + GOOD_BACKEND,
     "match.all[0].in"),
    ('name = "x"\npriority = "high"\n[match]\n' + GOOD_BACKEND, "priority"),
    ('name = "x"\n[match]\n' + GOOD_BACKEND, "priority"),
    ('name = "x"\npriority = 1\n', "match"),
    (GOOD_HEAD, "backends"),
    ('thread = 4\n' + GOOD_HEAD + GOOD_BACKEND, "thread"),
    (GOOD_HEAD + GOOD_BACKEND + 'dla = 1\n', "backends[0].dla"),
    ('name = "Has Spaces"\npriority = 1\n[match]\n' + GOOD_BACKEND, "name"),
    (GOOD_HEAD + GOOD_BACKEND + '[cache]\ndir = "/abs"\n', "cache.dir"),
    ('source = "/etc/passwd"\n' + GOOD_HEAD + GOOD_BACKEND, "source"),
])
def test_bad_profile_names_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    error = _bad(tmp_path, text)
    assert error.context["key"] == key
    assert f": {key}:" in str(error)


@pytest.mark.parametrize(("backend", "options", "problem"), [
    ('backend = "tensorrt"\ndevice = "GPU"\nprecisions = ["fp16"]\n', "{ dla_cor = 0 }", "dla_cor: unknown key"),
    ('backend = "tensorrt"\ndevice = "GPU"\nprecisions = ["fp16"]\n', '{ dla_core = "zero" }', "dla_core: "),
    ('backend = "onnxruntime"\nprecisions = ["fp32"]\n', '{ dla_core = 0 }', "dla_core: unknown key"),
    ('backend = "openvino"\ndevice = "CPU"\nprecisions = ["fp32"]\n', '{ streams = 2 }', "streams: unknown key"),
])
def test_backend_options_are_typed_per_backend(tmp_path: Path, backend: str, options: str, problem: str) -> None:
    error = _bad(tmp_path, GOOD_HEAD + "[[backends]]\n" + backend + f"options = {options}\n")
    assert error.context["key"] == "backends[0].options"
    assert f": backends[0].options: {problem}" in str(error)


def test_every_bundled_backend_option_is_known(bundled: list[DeviceProfile]) -> None:
    options = [(b.backend, b.options.model_dump(exclude_unset=True)) for p in bundled for b in p.backends]
    assert any(backend == "tensorrt" and "dla_core" in o for backend, o in options)
    assert any(backend == "onnxruntime" and "providers" in o for backend, o in options)


def test_bad_toml(tmp_path: Path) -> None:
    error = _bad(tmp_path, 'name = "x\n')
    assert "TOML" in str(error)


def test_duplicate_name_in_one_dir(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(GOOD_HEAD + GOOD_BACKEND)
    (tmp_path / "b.toml").write_text(GOOD_HEAD + GOOD_BACKEND)
    with pytest.raises(ConfigError, match="also defined") as info:
        load_profiles([tmp_path])
    assert str(tmp_path / "b.toml") in str(info.value) and info.value.context["key"] == "name"


def test_missing_extra_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_profiles([tmp_path / "nope"])


def test_nothing_matches(tmp_path: Path) -> None:
    profile = DeviceProfile.model_validate({
        "name": "only-jetson", "priority": 1,
        "match": {"all": [{"fact": "jetson.present", "equals": True}]},
        "backends": [{"backend": "onnxruntime", "precisions": ["fp32"]}],
    })
    with pytest.raises(ConfigError, match="catch-all") as info:
        match_profile(HardwareFacts(), [profile])
    assert info.value.problems == ["only-jetson: jetson.present equals true (is false)"]


def rule(**kwargs: Any) -> MatchRule:
    return MatchRule.model_validate(kwargs)


@pytest.mark.parametrize(("spec", "value", "holds"), [
    ({"equals": "x86_64"}, "x86_64", True),
    ({"equals": "x86_64"}, "X86_64", False),
    ({"equals": True}, True, True),
    ({"equals": True}, 1, False),
    ({"equals": 0}, False, False),
    ({"equals": 2}, 2, True),
    ({"in": ["a", "b"]}, "b", True),
    ({"in": ["a", "b"]}, ["c", "a"], True),
    ({"in": ["a", "b"]}, "c", False),
    ({"contains": "orin"}, "NVIDIA Jetson Orin Nano", True),
    ({"contains": "tegra"}, ["nvidia,p3767-0005", "nvidia,tegra234"], True),
    ({"has": "avx2"}, ["avx", "avx2"], True),
    ({"has": ["avx2", "avx512f"]}, ["avx", "avx2"], False),
    ({"has": "avx2"}, "avx2", False),
    ({"exists": True}, "x", True),
    ({"exists": True}, [], False),
    ({"exists": False}, None, True),
    ({"exists": False}, 0, False),
    ({"gte": 4096}, 8192, True),
    ({"gte": 4096}, 2048, False),
    ({"lte": 4096}, 4096, True),
    ({"gte": "36"}, "36.3.0", True),
    ({"gte": "36.4"}, "36.3.0", False),
    ({"gte": "8.6"}, "10.0", True),
    ({"gte": 8.0}, "8.9", True),
    ({"lte": "35"}, "36.3.0", False),
    ({"gte": 1}, True, False),
    ({"gte": 1}, "unknown", False),
    ({"matches": r"^32\."}, "32.7.1", True),
    ({"matches": r"^32\."}, "36.3.0", False),
    ({"matches": "tegra23"}, ["nvidia,tegra234"], True),
    ({"equals": "x"}, None, False),
    ({"in": ["x"]}, None, False),
    ({"gte": 1}, None, False),
])
def test_rule_semantics(spec: dict[str, Any], value: Any, holds: bool) -> None:
    assert rule(fact="cpu.arch", **spec).holds(value) is holds


def test_match_spec_all_any_none() -> None:
    spec = MatchSpec.model_validate({
        "all": [{"fact": "cpu.arch", "equals": "x86_64"}],
        "any": [{"fact": "cpu.vendor", "equals": "AuthenticAMD"}, {"fact": "cpu.flags", "has": "avx2"}],
        "none": [{"fact": "intel_gpu.present", "equals": True}],
    })
    ok, reasons, _ = spec.evaluate({"cpu.arch": "x86_64", "cpu.vendor": "GenuineIntel", "cpu.flags": ["avx2"],
                                    "intel_gpu.present": False})
    assert ok and reasons == ['cpu.arch equals "x86_64" (is "x86_64")', 'cpu.flags has "avx2" (is ["avx2"])',
                              'not intel_gpu.present equals true (is false)']
    ok, _, why = spec.evaluate({"cpu.arch": "x86_64", "cpu.vendor": "GenuineIntel", "cpu.flags": []})
    assert not ok and why.startswith("none of `any` held")
    ok, _, why = spec.evaluate({"cpu.arch": "x86_64", "cpu.vendor": "AuthenticAMD", "intel_gpu.present": True})
    assert not ok and why == "not intel_gpu.present equals true (is true)"


def _profile(**overrides: Any) -> DeviceProfile:
    data: dict[str, Any] = {"name": "p", "priority": 1, "match": {},
                            "backends": [{"backend": "onnxruntime", "precisions": ["fp32"]}]}
    return DeviceProfile.model_validate({**data, **overrides})


def test_memory_budget() -> None:
    facts = HardwareFacts(memory=MemoryFacts(total_mb=8000))
    assert _profile().effective_memory_budget_mb(facts) == pytest.approx(4800)
    assert _profile(memory_budget_mb=1500).effective_memory_budget_mb(facts) == 1500
    assert _profile().effective_memory_budget_mb(HardwareFacts()) == 1024


def test_backend_preference_defaults() -> None:
    pref = BackendPreference(backend="openvino", precisions=["fp16"])
    assert pref.device == "CPU" and pref.options == OpenVinoOptions()
    with pytest.raises(ValueError, match="repeat"):
        BackendPreference(backend="openvino", precisions=["fp16", "fp16"])
    assert "source" not in _profile(source=Path("/x.toml")).model_dump()


def test_render_detect(bundled: list[DeviceProfile]) -> None:
    facts = probe(SYSROOTS / "jetson-orin-nano", engines=False)
    match = match_profile(facts, bundled)
    doc = json.loads(render_detect(facts, match, as_json=True))
    assert doc["profile"] == "jetson-orin"
    assert doc["facts"]["jetson.l4t"] == "36.3.0"
    assert doc["reasons"] and doc["backends"][0]["backend"] == "tensorrt"
    assert doc["rejected"] == []
    assert doc["memory_budget_mb"] == pytest.approx(7619 * 0.6)
    text = render_detect(facts, match, as_json=False)
    assert text.startswith("profile: jetson-orin")
    assert "jetson.module" in text and "orin-nano" in text
    assert "intel_npu" not in text  # absent devices are left out of the human view


def test_render_detect_lists_rejections() -> None:
    facts = HardwareFacts(cpu=CpuFacts(arch="riscv64"), jetson=JetsonFacts())
    match = match_profile(facts, load_profiles())
    text = render_detect(facts, match, as_json=False)
    assert match.profile.name == "generic"
    assert "x86-64-cpu: cpu.arch equals \"x86_64\" (is \"riscv64\")" in text


# ---- the JetPack matrix applied to each generation's fixture --------------------------------------------------
# fixture: (JetPack row, engine lines in resolved order, engine lines taken out)
JETPACK_EXPECTED = {
    "jetson-nano": ("4.x", ["onnxruntime CPU"], ["tensorrt GPU"]),
    "jetson-xavier-nx-jp4": ("4.x", ["onnxruntime CPU"], ["tensorrt GPU", "onnxruntime GPU"]),
    "jetson-xavier-nx": ("5.x", ["tensorrt GPU", "onnxruntime CPU"], ["onnxruntime GPU"]),
    "jetson-agx-orin": ("5.x", ["tensorrt GPU", "onnxruntime CPU"], ["onnxruntime GPU"]),
    "jetson-orin-nano": ("6.x", ["tensorrt GPU", "onnxruntime GPU", "onnxruntime CPU"], []),
}


def test_every_jetson_fixture_has_a_matrix_expectation() -> None:
    assert {p.name for p in SYSROOTS.iterdir() if p.name.startswith("jetson-")} == set(JETPACK_EXPECTED)


@pytest.mark.parametrize("fixture", sorted(JETPACK_EXPECTED))
def test_jetpack_matrix_resolution(bundled: list[DeviceProfile], fixture: str) -> None:
    jetpack, order, gone = JETPACK_EXPECTED[fixture]
    facts = probe(SYSROOTS / fixture, engines=False)
    match = match_profile(facts, bundled)
    assert match.release is not None and match.release.jetpack == jetpack
    assert [f"{b.backend} {b.device}" for b in match.profile.backends] == order
    assert [f"{b.backend} {b.device}" for b, _ in match.unavailable] == gone
    # Never first (nor anywhere) an engine the release cannot load; every removal says why.
    for b in match.profile.backends:
        assert match.release.support(b.backend, b.device).status != "unavailable"
    assert all(why for _, why in match.unavailable)
    trt = next((b for b in match.profile.backends if b.backend == "tensorrt"), None)
    if jetpack == "5.x":  # TensorRT's bindings are for the system Python 3.8: the engine worker serves them
        assert trt is not None and TensorRtOptions.of(trt.options).engine_worker == "/usr/bin/python3"
    elif trt is not None:
        assert "engine_worker" not in trt.options.model_fields_set


def test_forced_profile_gets_the_matrix_too(tmp_path: Path) -> None:
    from edged.config import parse_config
    from edged.daemon import choose_profile

    cfg = parse_config('[device]\nprofile = "jetson-orin"\n', source=tmp_path / "edged.toml")
    match = choose_profile(cfg, probe(SYSROOTS / "jetson-nano", engines=False))
    assert match.profile.name == "jetson-orin" and match.reasons[0].startswith("forced")
    assert [b.backend for b in match.profile.backends] == ["onnxruntime"]
    assert any("Python 3.6" in why for b, why in match.unavailable if b.backend == "tensorrt")


def test_no_matrix_off_jetson_or_when_the_release_is_unknown(bundled: list[DeviceProfile]) -> None:
    assert match_profile(probe(SYSROOTS / "x86-64-nvidia-dgpu", engines=False), bundled).release is None
    facts = HardwareFacts(cpu=CpuFacts(arch="aarch64"), jetson=JetsonFacts(present=True, soc="tegra194"))
    match = match_profile(facts, bundled)
    assert match.release is None and match.unavailable == []
    assert match.profile.backends[0].backend == "tensorrt"  # unknown release: the profile as written


@pytest.mark.parametrize("fixture", sorted(JETPACK_EXPECTED))
def test_detect_prints_the_matrix_row(fixture: str, capsys: pytest.CaptureFixture[str]) -> None:
    from edged.cli import main

    jetpack, order, gone = JETPACK_EXPECTED[fixture]
    assert main(["detect", "--json", "--root", str(SYSROOTS / fixture)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["jetpack"]["jetpack"] == jetpack
    assert [f"{b['backend']} {b['device']}" for b in doc["backends"]] == order
    assert [f"{u['backend']} {u['device']}" for u in doc["unavailable"]] == gone
    assert all(u["reason"] for u in doc["unavailable"])
    assert main(["detect", "--root", str(SYSROOTS / fixture)]) == 0
    text = capsys.readouterr().out
    assert f"JetPack {jetpack} (L4T " in text
    for name in gone:
        assert f"-  {name} " in text and ": unavailable: " in text
    if jetpack == "4.x":
        assert "TensorRT bindings are for Python 3.6" in text
    if jetpack == "5.x":
        assert "TensorRT bindings are for Python 3.8" in text


# ---- every profile ends in the host's CPU engines ------------------------------------------------------------
@pytest.mark.parametrize("fixture", sorted(EXPECTED_PROFILE))
def test_every_profile_ends_in_the_hosts_cpu_engines(bundled: list[DeviceProfile], fixture: str) -> None:
    facts = probe(SYSROOTS / fixture, engines=False)
    match = match_profile(facts, bundled)
    lines = [(b.backend, b.device) for b in match.profile.backends]
    cpu = ({("openvino", "CPU"), ("onnxruntime", "CPU")} if facts.cpu.arch == "x86_64"
           else {("onnxruntime", "CPU")})
    assert set(lines[-len(cpu):]) == cpu, f"{fixture}: {match.profile.name} ends in {lines[-len(cpu):]}"
    assert all(b.precisions for b in match.profile.backends[-len(cpu):])


def test_a_gpu_profile_gets_the_cpu_engines_its_author_left_out(tmp_path: Path) -> None:
    (tmp_path / "gpu-only.toml").write_text(
        'name = "gpu-only"\npriority = 1\n[match]\nall = [ { fact = "nvidia_gpu.present", equals = true } ]\n'
        '[[backends]]\nbackend = "tensorrt"\ndevice = "GPU"\nprecisions = ["fp16"]\n')
    facts = probe(SYSROOTS / "x86-64-nvidia-dgpu", engines=False)
    match = match_profile(facts, load_profiles([tmp_path]))
    assert match.profile.name == "gpu-only"
    assert (match.profile.backends[0].backend, match.profile.backends[0].device) == ("tensorrt", "GPU")
    assert {(b.backend, b.device) for b in match.added} == {("openvino", "CPU"), ("onnxruntime", "CPU")}
    assert match.profile.backends[1:] == match.added
    out = render_detect(facts, match, as_json=False)
    assert "added: the host's CPU engines" in out
    # An arm64 host gets ONNX Runtime (edged's CPU engine there), never an x86-only line.
    arm = probe(SYSROOTS / "raspberry-pi-5", engines=False)
    arm_match = match_profile(arm, load_profiles())
    assert [(b.backend, b.device) for b in arm_match.profile.backends] == [("onnxruntime", "CPU")]
    assert arm_match.added == []
