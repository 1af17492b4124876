"""BYTES tensors in and out of the engines as each takes them (issue 42), in process on real engines.

ONNX Runtime's string tensors hold text: BYTES elements reach it as ``str`` (every character kept,
NULs included) and come back as the same bytes; a non-UTF-8 element is refused before queueing,
naming the input and the element. OpenVINO refuses string models at load (its CPU plugin has no
string kernels, and freeing a string inference crashed the process), so the next candidate serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged import datatypes
from edged.config import parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import ErrorCode, InvalidInputError
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from tests.triton_models import build_examples

pytestmark = pytest.mark.timeout(120)

OV_THEN_ORT = [BackendPreference(backend="openvino", device="CPU", precisions=["fp32"]),
               BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceService]:
    pytest.importorskip("openvino", reason="the OpenVINO refusal needs openvino (the dev extra)")
    repo = build_examples(tmp_path_factory.mktemp("strings") / "models")
    manager = ModelManager(Path(repo), parse_config('[device]\nid = "x"\n').models, OV_THEN_ORT)
    manager.load_all()
    yield InferenceService(manager)
    manager.shutdown()


def _row(items: list[bytes]) -> np.ndarray:
    out = np.empty((1, len(items)), dtype=object)
    for i, b in enumerate(items):
        out[0, i] = b
    return out


def test_string_models_skip_openvino_with_the_reason_and_serve_on_onnx_runtime(service: InferenceService) -> None:
    for name in ("simple_string", "simple_identity"):
        mv = service.model(name)
        assert mv.candidate is not None and mv.candidate.backend == "onnxruntime", name
        reasons = [why for cand, why in mv.skipped if cand.startswith("openvino")]
        assert reasons and "string tensors" in reasons[0] and "ONNX Runtime serves them" in reasons[0], mv.skipped
    assert service.model("simple").candidate.backend == "openvino"  # numbers: OpenVINO as the profile says


def test_bytes_reach_onnx_runtime_as_text_and_come_back_as_the_same_bytes(service: InferenceService) -> None:
    sent = [b"0", b"he\x00llo", b"a\x00", b"\x00\x01\x02\x03", "température ☃ 数据".encode(), b""] + [b"x"] * 10
    out = service.infer(InferRequest("simple_identity", {"INPUT0": _row(sent)})).outputs["OUTPUT0"]
    assert out.dtype == np.object_ and out.ravel().tolist() == sent  # trailing NULs too (numpy 'U' drops them)
    # numbers as text through Cast(string -> int32) and back
    a = _row([str(i).encode() for i in range(16)])
    got = service.infer(InferRequest("simple_string", {"INPUT0": a, "INPUT1": _row([b"-3"] * 16)})).outputs
    assert got["OUTPUT0"].ravel().tolist() == [str(i - 3).encode() for i in range(16)]
    assert got["OUTPUT1"].ravel().tolist() == [str(i + 3).encode() for i in range(16)]


def test_a_non_utf8_element_is_refused_before_queueing_naming_input_and_index(service: InferenceService) -> None:
    bad = _row([b"ok"] * 9 + [b"caf\xe9"] + [b"ok"] * 6)  # Latin-1, not UTF-8
    with pytest.raises(InvalidInputError) as err:
        service.submit(InferRequest("simple_identity", {"INPUT0": bad}))  # raised at submit: nothing queued
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "input 'INPUT0' element 9 is not UTF-8 text (byte 3 (0xe9)" in str(err.value)
    # the same in the second row of a batch of two: the element's index is in the request's tensor
    two = np.concatenate([_row([b"ok"] * 16), bad], axis=0)
    with pytest.raises(InvalidInputError, match="element 25 is not UTF-8"):
        service.infer(InferRequest("simple_identity", {"INPUT0": two}))
    ok = service.infer(InferRequest("simple_identity", {"INPUT0": _row([b"ok"] * 16)})).outputs["OUTPUT0"]
    assert ok.ravel().tolist() == [b"ok"] * 16


def test_tritons_wording_in_process(service: InferenceService) -> None:
    with pytest.raises(Exception, match=r"^Request for unknown model: 'nope' is not found \(model 'nope' is not in"):
        service.infer(InferRequest("nope", {}))
    z = np.zeros((9, 16), np.int32)
    with pytest.raises(InvalidInputError, match=r"^inference request batch-size must be <= 8 for 'simple' \("):
        service.infer(InferRequest("simple", {"INPUT0": z, "INPUT1": z}))
    z = np.zeros((16,), np.int32)
    with pytest.raises(InvalidInputError, match=r"^unexpected shape for input 'INPUT0' for model 'simple'\. "
                                                r"Expected \[-1,16\], got \[16\] \("):
        service.infer(InferRequest("simple", {"INPUT0": z, "INPUT1": z}))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=6), min_size=0, max_size=12))
def test_the_utf8_check_finds_the_first_element_that_is_not_utf8(items: list[bytes]) -> None:
    """The one-pass check (elements joined at NULs) agrees with decoding each element on its own."""
    def first_bad() -> int | None:
        for i, b in enumerate(items):
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                return i
        return None

    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    got = datatypes.utf8_error(arr)
    assert (got[0] if got else None) == first_bad()
    if got is None:
        assert datatypes.as_bytes(datatypes.as_text(arr)).tolist() == items  # and back, byte for byte
