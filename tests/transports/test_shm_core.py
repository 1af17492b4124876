"""The shm client core's operations driven on their own: both faces run the same operation, and a
failed round trip reaches the operation at its ``yield``, so its cleanup runs whichever face drives it."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson
import pytest

from edged.client.shm_core import Reply, ShmCore, arun, run
from edged.errors import EdgedError, ErrorCode, ResourceExhaustedError
from edged.protocol import shm as p

META = {
    "name": "m",
    "version": 1,
    "max_batch_size": 0,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _reply(msg: bytes | bytearray) -> Reply:
    """What a daemon would answer to METADATA, REGISTER and UNREGISTER (status 0)."""
    kind = p.HEADER.unpack_from(msg)[0]
    if kind == p.METADATA:
        return 0, 0, orjson.dumps(META)
    if kind == p.REGISTER:
        return 0, 0, p.U32.pack(7)
    return 0, 0, b""


def test_both_faces_send_the_same_bytes_for_the_same_operation() -> None:
    sent: dict[str, list[tuple[bytes, bool]]] = {"sync": [], "async": []}

    def call(msg: bytes | bytearray, fd: int) -> Reply:
        sent["sync"].append((bytes(msg), fd >= 0))
        return _reply(msg)

    async def acall(msg: bytes | bytearray, fd: int) -> Reply:
        sent["async"].append((bytes(msg), fd >= 0))
        return _reply(msg)

    cores = ShmCore(), ShmCore()
    buf = run(cores[0].input_buffer("m", "x", (2, 4), None, None), call)
    abuf = asyncio.run(arun(cores[1].input_buffer("m", "x", (2, 4), None, None), acall))
    assert sent["sync"] == sent["async"] and [fd for _, fd in sent["sync"]] == [False, True]  # METADATA, REGISTER
    assert buf.shape == abuf.shape == (2, 4) and str(buf.dtype) == "float32"
    assert cores[0].models[("m", 0)].inputs == {"x": ("FP32", [4])} and 7 in cores[0].segments


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_register_cut_off_closes_its_memfd_and_records_nothing(face: str) -> None:
    core = ShmCore()
    before = _open_fds()
    fds: list[int] = []

    def fail(msg: bytes | bytearray, fd: int) -> Reply:
        fds.append(fd)
        raise KeyboardInterrupt if face == "sync" else asyncio.CancelledError

    async def afail(msg: bytes | bytearray, fd: int) -> Reply:
        return fail(msg, fd)

    with pytest.raises((KeyboardInterrupt, asyncio.CancelledError)):
        if face == "sync":
            run(core.register(4096), fail)
        else:
            asyncio.run(arun(core.register(4096), afail))
    assert fds and fds[0] >= 0
    assert _open_fds() == before and not core.segments


def test_a_refused_register_raises_the_daemons_error_and_a_failed_unregister_still_drops_the_segment() -> None:
    core = ShmCore()

    def refuse(msg: bytes | bytearray, fd: int) -> Reply:
        err = p.encode_error(p.REGISTER, p.HEADER.unpack_from(msg)[3], ErrorCode.RESOURCE_EXHAUSTED, "no room")
        _, status, count, _ = p.HEADER.unpack_from(err)
        return status, count, err[p.HEADER.size :]

    with pytest.raises(ResourceExhaustedError, match="no room"):
        run(core.register(4096), refuse)
    seg = run(core.register(4096), lambda msg, fd: _reply(msg))

    def gone(msg: bytes | bytearray, fd: int) -> Any:
        raise EdgedError("edged closed the shared-memory connection", code=ErrorCode.UNAVAILABLE)

    run(core.unregister(seg), gone)  # the connection's end releases it on the daemon's side
    assert not core.segments and seg.u8 is None
