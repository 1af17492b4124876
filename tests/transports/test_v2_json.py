"""JSON tensor data parsed straight into numpy: exact values, every JSON number form, refusals by name.

Each case runs twice: through simdjson's flat buffer and through the orjson path a device without the
pysimdjson wheel takes, and both must agree with parsing the same JSON into Python numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import InvalidInputError
from edged.protocol import v2_json
from edged.protocol.v2 import decode_request
from edged.protocol.v2_json import JsonArray, loads_request


@pytest.fixture(params=["simdjson", "orjson"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "simdjson":
        pytest.importorskip("simdjson", reason="the pysimdjson wheel is not installed on this platform")
    saved = getattr(v2_json._local, "parser", None)
    if request.param == "orjson":
        v2_json._local.parser = False  # this thread only: the path a device without the wheel takes
    yield str(request.param)
    v2_json._local.parser = saved


def _body(data_text: str, datatype: str = "FP32", shape: list[int] | None = None, name: str = "x") -> bytes:
    n = shape if shape is not None else [len(json.loads(data_text))]
    return (f'{{"id": "r", "inputs": [{{"name": "{name}", "datatype": "{datatype}", "shape": {json.dumps(n)}, '
            f'"data": {data_text}}}]}}').encode()


def _decode(body: bytes) -> dict[str, np.ndarray]:
    return decode_request(loads_request(body), model="m", version=None).request.inputs


def _reference(body: bytes) -> dict[str, np.ndarray]:
    """The same request through Python numbers (orjson's whole-document parse)."""
    return decode_request(orjson.loads(body), model="m", version=None).request.inputs


def test_float32_round_trip_is_bit_exact(path: str) -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    extremes = np.array([0.0, -0.0, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                         np.finfo(np.float32).tiny, np.float32(1e-45), np.float32(-1e-45), 1.0, -1.0,
                         0.1, 1 / 3], dtype=np.float32)
    values = np.concatenate([values, extremes])
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [values.size], "data": values}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    got = _decode(body)["x"]
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), values.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), _reference(body)["x"].view(np.uint32))


def test_float64_round_trip_is_bit_exact(path: str) -> None:
    rng = np.random.default_rng(11)
    values = rng.integers(0, 2**63, 20_000, dtype=np.int64).view(np.float64)
    values = values[np.isfinite(values)]
    values = np.concatenate([values, -values[:1000], [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]])
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [values.size],
                                     "data": values.tolist()}]})
    got = _decode(body)["x"]
    assert np.array_equal(got.view(np.uint64), values.view(np.uint64))


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_every_json_number_form(path: str, datatype: str) -> None:
    forms = ["0", "-0", "7", "-7", "0.5", "-0.5", "1e2", "1E2", "1e+2", "1E-2", "-1.25e-3", "0e0", "0.0E+0",
             "123456789012345678901234567890", "1.00000000000000011102230246251565404236316680908203125",
             "3.4028234663852886e38", "1.401298464324817e-45", "2.5e-10"]
    if datatype == "FP16":  # what half precision can hold
        forms = [f for f in forms if abs(float(f)) < 65504]
    text = "[ " + " ,\n\t".join(forms) + "\r\n]"
    got = _decode(_body(text, datatype))["x"]
    # As Python's json reads them (so "-0" is the integer 0), then rounded once to the tensor's type.
    want = np.array([float(json.loads(f)) for f in forms], dtype=np.float64).astype(got.dtype)
    assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


@pytest.mark.parametrize(("datatype", "values"), [
    ("INT8", [-128, 0, 127]), ("UINT8", [0, 255]), ("INT16", [-32768, 32767]), ("UINT16", [0, 65535]),
    ("INT32", [-(2**31), 2**31 - 1]), ("UINT32", [0, 2**32 - 1]), ("INT64", [-(2**63), 2**63 - 1]),
    ("UINT64", [0, 2**64 - 1])])
def test_integer_tensors_keep_their_whole_range(path: str, datatype: str, values: list[int]) -> None:
    got = _decode(_body(json.dumps(values), datatype))["x"]
    assert [int(v) for v in got] == values
    assert got.dtype == np.dtype(datatype.lower().replace("int", "int"))


@pytest.mark.parametrize(("datatype", "text", "said"), [
    ("INT8", "[1, 128]", "outside the range of INT8"),
    ("UINT8", "[-1, 2]", "UINT8"),
    ("UINT16", "[1, 70000]", "outside the range of UINT16"),
    ("INT32", "[1, 2.5]", "fraction or exponent"),
    ("INT64", "[1, 1e3]", "fraction or exponent"),
    ("FP32", "[1, true]", "boolean, null or string"),
    ("FP32", "[1, null]", "boolean, null or string"),
    ("FP32", '[1, "2"]', "boolean, null or string"),
    ("INT32", "[false, 1]", "boolean, null or string"),
    ("FP32", "[1e39, 1]", "outside the range of FP32"),
    ("FP32", "[1, 2,]", "not valid JSON"),
    ("FP32", "[01, 2]", "not valid JSON"),
    ("FP32", "[1., 2]", "not valid JSON"),
    ("FP32", "[.5, 2]", "not valid JSON"),
    ("FP32", "[+1, 2]", "not valid JSON"),
    ("FP32", "[NaN, 2]", "non-numeric value"),
    ("FP32", "[Infinity, 2]", "non-numeric value"),
])
def test_bad_elements_are_refused_with_the_tensor_named(path: str, datatype: str, text: str, said: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        _decode(_body(text, datatype, [2], name="pixels"))
    assert said in str(e.value)
    if "valid JSON" not in said:
        assert "'pixels'" in str(e.value)


def test_counts_are_checked_before_anything_is_allocated(path: str) -> None:
    with pytest.raises(InvalidInputError, match=r"input 'x': 2 elements for shape \[1073741824, 4\]"):
        _decode(_body("[1, 2]", "FP32", [2**30, 4]))
    with pytest.raises(InvalidInputError, match=r"input 'x': 3 elements for shape \[2\]"):
        _decode(_body("[1, 2, 3]", "FP32", [2]))
    with pytest.raises(InvalidInputError, match=r"input 'x': 0 elements for shape \[1\]"):
        _decode(_body("[]", "FP32", [1]))
    assert _decode(_body("[]", "FP32", [0]))["x"].shape == (0,)


def test_nested_arrays_are_accepted_when_they_fill_the_shape(path: str) -> None:
    got = _decode(_body("[[1, 2, 3], [4, 5, 6]]", "FP32", [2, 3]))["x"]
    assert got.tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(InvalidInputError, match="input 'x'"):
        _decode(_body("[[1, 2, 3], [4, 5]]", "FP32", [2, 3]))
    with pytest.raises(InvalidInputError, match="input 'x': data holds a non-numeric value"):
        _decode(_body("[[true, false], [true, false]]", "FP32", [2, 2]))


def test_bool_and_bytes_tensors_keep_their_json_forms(path: str) -> None:
    assert _decode(_body("[true, false, true]", "BOOL"))["x"].tolist() == [True, False, True]
    assert _decode(_body('["a", "b"]', "BYTES"))["x"].tolist() == [b"a", b"b"]
    assert _decode(_body("[1, 0]", "BOOL"))["x"].tolist() == [True, False]


def _header_without_arrays(header: Any) -> Any:
    return {k: ([{kk: vv for kk, vv in i.items() if kk != "data"} for i in v] if k == "inputs" else v)
            for k, v in header.items()}


@pytest.mark.parametrize("doc", [
    # the array sits under a key that only ends in "data" (an escaped quote inside the key)
    '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], "x\\"data": [2]}]}',
    # "data" arrays outside inputs: parameters, outputs and a string that spells one out
    '{"parameters": {"data": [5, 6]}, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
    '"data": [1], "parameters": {"note": "\\"data\\": [9, 9]"}}], "outputs": [{"name": "y", "data": [3]}]}',
    # a duplicate key: the last one wins, as in every other JSON parser here
    '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], "data": [4]}]}',
    # arrays that are not flat numbers (strings holding brackets, nesting) before a flat one
    '{"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["a]", "[b \\"data\\": [1]"]}, '
    '{"name": "n", "datatype": "FP32", "shape": [2, 1], "data": [[1], [2]]}, '
    '{"name": "x", "datatype": "FP32", "shape": [2], "data": [3, 4]}]}',
    # no whitespace, and whitespace everywhere
    '{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,2]}]}',
    '{ "inputs" : [ { "name" : "x" , "datatype" : "FP32" , "shape" : [ 2 ] , "data" \n:\t[ 1 , 2 ] } ] }',
])
def test_the_split_never_changes_what_the_request_says(path: str, doc: str) -> None:
    body = doc.encode()
    header = loads_request(body)
    assert _header_without_arrays(header) == _header_without_arrays(orjson.loads(body))
    got, want = _decode(body), _reference(body)
    assert got.keys() == want.keys()
    for k in got:
        assert np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype


def test_flat_input_arrays_are_left_as_bytes_until_the_datatype_is_known() -> None:
    header = loads_request(_body("[1, 2.5]"))
    assert isinstance(header["inputs"][0]["data"], JsonArray)
    assert header["inputs"][0]["data"].text == b"[1, 2.5]"


def test_placeholders_cannot_be_forged(path: str) -> None:
    forged = v2_json._MARK.replace(v2_json._NONCE, "0" * 24) + "0"
    body = orjson.dumps({"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [1], "data": [1.5]},
        {"name": "b", "datatype": "BYTES", "shape": [1], "data": [forged]}]})
    got = _decode(body)
    assert got["a"].tolist() == [1.5]
    assert got["b"].tolist() == [forged.encode()]


def test_invalid_json_is_refused_whole(path: str) -> None:
    for body in (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}',
                 b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]} x',
                 b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]]}'):
        with pytest.raises(InvalidInputError, match="not valid JSON"):
            _decode(body)
