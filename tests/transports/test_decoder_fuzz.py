"""Issue #20: every request decoder fuzzed (bounded slice of ``python -m bench.fuzz_decoders``) and
a property test of memory per request against payload size.

A crash is anything but a typed ``EdgedError``; memory is the process's peak RSS over the fuzz run
and, per decoded request, the peak of Python and numpy allocations (tracemalloc sees both).
"""

from __future__ import annotations

import struct
import tracemalloc

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import fuzz_decoders as fz
from edged.errors import EdgedError
from edged.protocol import mqtt as codec
from edged.protocol.v2 import decode_request

pytestmark = pytest.mark.timeout(120)

FUZZ_SECONDS = 15.0


def test_fuzz_every_decoder_no_crash_bounded_memory() -> None:
    rep = fz.run(FUZZ_SECONDS, seed=20)
    assert not rep.crashes, "\n".join(rep.lines())
    assert all(rep.cases[d] > 200 for d in fz.DECODERS), rep.lines()
    # Each decoder both refuses and accepts some: the cases reach past the first check.
    assert all(0 < rep.refused[d] < rep.cases[d] for d in fz.DECODERS), rep.lines()
    assert rep.rss_growth < 32 * 2**20, rep.lines()


DIMS = st.one_of(st.integers(0, 8), st.sampled_from([2**16, 2**29, 2**31, 2**40, 2**62]))
DATATYPES = st.sampled_from(["BYTES", "FP32", "UINT8", "INT64", "BOOL", "FP16"])


@st.composite
def binary_request(draw: st.DrawFn) -> tuple[bytes, int]:
    """A binary v2 body whose declared shape, element lengths and byte size may disagree."""
    dt = draw(DATATYPES)
    shape = draw(st.lists(DIMS, min_size=0, max_size=4))
    if dt == "BYTES":
        lengths = draw(st.lists(st.one_of(st.integers(0, 40), st.just(2**31)), max_size=40))
        tail = b"".join(struct.pack("<I", n) + b"z" * min(n, 40) for n in lengths)
    else:
        tail = bytes(draw(st.integers(0, 4096)))
    size = draw(st.one_of(st.just(len(tail)), st.integers(0, len(tail) + 8)))
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": dt, "shape": shape,
                                       "parameters": {"binary_data_size": size}}]})
    return header + tail[:size] + tail[size:], len(header)


@st.composite
def json_request(draw: st.DrawFn) -> bytes:
    dt = draw(DATATYPES)
    shape = draw(st.lists(DIMS, min_size=0, max_size=4))
    n = draw(st.integers(0, 300))
    data: list[object] = ["ab"] * n if dt == "BYTES" else [1.5 if dt.startswith("FP") else 1] * n
    return orjson.dumps({"inputs": [{"name": "x", "datatype": dt, "shape": shape, "data": data}]})


def _peak(call: object) -> int:
    assert callable(call)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            call()
        except EdgedError:
            pass
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# Memory per request: Python objects for JSON numbers and BYTES elements cost more than their text,
# so the bound is a small multiple of the payload plus a fixed allowance for the header's objects.
FACTOR, FIXED = 16, 64 * 1024
PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(binary_request())
def test_http_binary_memory_is_bounded_by_the_payload(req: tuple[bytes, int]) -> None:
    body, hlen = req
    assert _peak(lambda: fz.http_binary(body, hlen)) <= FACTOR * len(body) + FIXED


@PROPERTY
@given(json_request())
def test_http_json_memory_is_bounded_by_the_payload(body: bytes) -> None:
    assert _peak(lambda: fz.http_json(body)) <= FACTOR * len(body) + FIXED


@PROPERTY
@given(binary_request(), st.booleans())
def test_mqtt_memory_is_bounded_by_the_payload(req: tuple[bytes, int], prefixed: bool) -> None:
    body, hlen = req
    payload = codec.PREFIX.pack(hlen) + body if prefixed else body
    assert _peak(lambda: fz.mqtt(payload, None if prefixed else hlen)) <= FACTOR * len(payload) + FIXED


def test_declared_count_the_bytes_cannot_hold_is_refused_before_allocating() -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2**31],
                                     "parameters": {"binary_data_size": 4}}]})
    with pytest.raises(EdgedError, match="2147483648 BYTES elements but the data has 4 bytes"):
        decode_request(orjson.loads(body), b"\0\0\0\0", model="m", version=None)
    # a zero dimension makes no element, but numpy cannot describe the rest: refused, not a ValueError
    for shape in ([0, 2**62, 2**62], [2**41], [2**21, 2**21]):
        hdr = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]}
        with pytest.raises(EdgedError, match="too large"):
            decode_request(hdr, model="m", version=None)


def test_bytes_data_takes_strings_and_grpc_bytes_only() -> None:
    hdr = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["ab", b"\xff"]}]}
    arr = decode_request(hdr, model="m", version=None).request.inputs["x"]
    assert arr.tolist() == [b"ab", b"\xff"]
    hdr["inputs"][0]["data"] = ["ab", 7]
    with pytest.raises(EdgedError, match="BYTES element 1 is int"):
        decode_request(hdr, model="m", version=None)
