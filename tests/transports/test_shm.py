"""Shared-memory fast path: a real ShmTransport over a real engine, real memfds, real client processes."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.client.shm import AsyncShmClient, ShmClient
from edged.client.shm_memory import create_segment, plan_inputs
from edged.config import ModelsSection, parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import ConfigError, EdgedError, ErrorCode, InvalidInputError, ModelNotFoundError
from edged.profiles import BackendPreference
from edged.protocol import shm as p
from edged.transports.shm.conn import Limits
from edged.transports.shm.segments import clean_stale_shm
from edged.transports.shm.transport import ShmTransport
from tests.conftest import EDGED, REPO_ROOT
from tests.polling import wait_until

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]
MAPS_TAG = "memfd:edged-shm"


class Served:
    def __init__(self, transport: ShmTransport, service: InferenceService) -> None:
        self.transport = transport
        self.service = service
        self.socket = transport.path

    def reference(self, x: np.ndarray) -> np.ndarray:
        engine = self.service.ready_model("digits").engine
        assert engine is not None
        return engine.infer({"pixels": x})["probabilities"]


def _config(tmp: Path) -> Any:
    # A short runtime dir: AF_UNIX paths are limited to 107 bytes.
    return parse_config(f'[device]\nstate_dir = "{tmp}/state"\nruntime_dir = "{tmp}/run"\n')


@contextlib.contextmanager
def _serve(repo: Path, tmp: Path, **kw: Any) -> Iterator[Served]:
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    manager.load_all()
    service = InferenceService(manager)
    transport = ShmTransport(_config(tmp), service, **kw)
    transport.start_blocking()
    try:
        yield Served(transport, service)
    finally:
        transport.stop_blocking()
        manager.shutdown()


@pytest.fixture
def served(model_repo: Callable[..., Path], tmp_path: Path) -> Iterator[Served]:
    with _serve(model_repo("digits"), tmp_path) as s:
        yield s


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    wait_until(cond, timeout, 0.02, what)


def _maps_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(MAPS_TAG in line for line in f)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fds() -> dict[str, str]:
    out = {}
    for f in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[f] = os.readlink(f"/proc/self/fd/{f}")
    return out


def _dev_shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("edged-")}
    except FileNotFoundError:
        return set()


# ---- a raw protocol client, for descriptors the real client would never send ------------------
class Raw:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(path))
        self.sock.settimeout(30)
        self.rid = 0

    def call(self, kind: int, body: bytes = b"", fds: list[int] | None = None) -> tuple[int, int, int, bytes]:
        self.rid += 1
        return self.send_raw(p.header(kind, self.rid) + body, fds)

    def send_raw(self, msg: bytes, fds: list[int] | None = None) -> tuple[int, int, int, bytes]:
        if fds:
            socket.send_fds(self.sock, [msg], fds)
        else:
            self.sock.send(msg)
        data = self.sock.recv(p.MAX_MESSAGE)
        kind, status, count, _ = p.HEADER.unpack_from(data)
        return kind, status, count, data[p.HEADER.size:]

    def register(self, size: int = 8192) -> int:
        fd, seg = create_segment(size)
        try:
            kind, status, _, body = self.call(p.REGISTER, p.U64.pack(seg.size), [fd])
        finally:
            os.close(fd)
            seg.close()
        assert (kind, status) == (p.REGISTER | p.REPLY, 0), p.decode_error(body)
        return int(p.U32.unpack(body)[0])

    def infer(self, inputs: list[bytes], out_seg: int, out_off: int = 4096, out_cap: int = 4096,
              model: str = "digits") -> tuple[int, int, bytes]:
        self.rid += 1
        msg = p.encode_infer(self.rid, model, 0, inputs, out_segment=out_seg, out_offset=out_off,
                             out_capacity=out_cap)
        kind, status, count, body = self.send_raw(msg)
        assert kind == p.INFER | p.REPLY
        return status, count, body

    def close(self) -> None:
        self.sock.close()


def _pixels(seg: int, *, offset: int = 0, shape: tuple[int, ...] = (1, 64), dtype: int = p.DTYPE_CODE["FP32"],
            nbytes: int | None = None, name: str = "pixels") -> bytes:
    n = 4 * int(np.prod(shape)) if nbytes is None else nbytes
    return p.encode_tensor(name, dtype, shape, segment=seg, offset=offset, nbytes=n)


@contextlib.contextmanager
def held_model(service: InferenceService, model: str = "digits") -> Iterator[None]:
    """Another caller holds the model's one instance until the block ends: requests queue and their
    connection goes on reading (tests.http_helpers.held_engine holds a run instead, and an inline run
    stops its connection reading)."""
    sched = service.ready_model(model).scheduler
    assert sched is not None
    # an inline caller gets the instance once the scheduler's memory of overlapping traffic has passed
    wait_until(sched._claim, 10, 0.01, "the model's instance to be free for an inline caller")
    try:
        yield
    finally:
        with sched._lock:
            sched._busy -= 1
            sched._cv.notify()


# ---- tests --------------------------------------------------------------------------------------
def test_socket_mode_peer_and_cleanup(served: Served) -> None:
    st_ = os.stat(served.socket)
    assert stat.S_ISSOCK(st_.st_mode)
    assert stat.S_IMODE(st_.st_mode) == 0o660
    with ShmClient(served.socket) as c:
        assert c.server["protocol"] == p.PROTOCOL_VERSION
        c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})
        (info,) = served.transport.clients()
        assert (info["pid"], info["uid"], info["gid"]) == (os.getpid(), os.getuid(), os.getgid())
        assert info["segments"] >= 1 and info["requests"] == 1
    _wait(lambda: not served.transport.clients(), "the client to be released")
    served.transport.stop_blocking()
    assert not served.socket.exists()


def test_results_equal_the_engine_on_held_out_digits(served: Served,
                                                     digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    with ShmClient(served.socket) as c:
        meta = c.metadata("digits")
        assert meta["max_batch_size"] == 64 and meta["inputs"][0]["name"] == "pixels"
        got = np.concatenate([c.infer("digits", {"pixels": x[i:i + 64]})["probabilities"]
                              for i in range(0, len(x), 64)])
        singles = np.stack([c.infer("digits", {"pixels": x[i:i + 1]})["probabilities"][0] for i in range(40)])
    ref = served.reference(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(singles, ref[:40], rtol=1e-5, atol=1e-6)
    assert (got.argmax(1) == y).mean() > 0.95


def test_zero_copy_inputs_and_output_views(served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    with ShmClient(served.socket) as c:
        buf = c.input_buffer("digits", "pixels", (4, 64))
        assert buf.dtype == np.float32 and not buf.flags.owndata
        buf[:] = x[:4]
        packed = plan_inputs(c._core.segments, {"pixels": buf})
        assert packed.staged == [] and len(packed.refs) == 1  # sent by reference, not copied
        out = c.infer("digits", {"pixels": buf}, copy=False)["probabilities"]
        assert not out.flags.owndata  # a view on the shared output area
        np.testing.assert_allclose(out, served.reference(x[:4]), rtol=1e-5, atol=1e-6)
        kept = out.copy()
        buf[:] = x[4:8]
        out2 = c.infer("digits", {"pixels": buf}, copy=False)["probabilities"]
        np.testing.assert_allclose(out2, served.reference(x[4:8]), rtol=1e-5, atol=1e-6)
        # the view is reused by the next call on the same slot, as documented
        np.testing.assert_allclose(out, out2)
        assert not np.allclose(kept, out2)
        t = c.tensor((2, 64))
        t[:] = x[8:10]
        np.testing.assert_allclose(c.infer("digits", {"pixels": t})["probabilities"],
                                   served.reference(x[8:10]), rtol=1e-5, atol=1e-6)
        segments = served.transport.clients()[0]["segments"]
        c.release(t)
        assert served.transport.clients()[0]["segments"] == segments - 1
        # released: still usable locally, now copied instead of referenced
        np.testing.assert_allclose(c.infer("digits", {"pixels": t})["probabilities"],
                                   served.reference(x[8:10]), rtol=1e-5, atol=1e-6)


def test_prepared_requests_answer_like_the_engine_and_reuse_everything(
        served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    with ShmClient(served.socket) as c:
        prep = c.prepare("digits", {"pixels": (4, 64)})
        buf = prep.inputs["pixels"]
        assert buf.shape == (4, 64) and buf.dtype == np.float32 and not buf.flags.owndata
        with pytest.raises(TypeError):
            prep.inputs["pixels"] = x[:4]  # type: ignore[index]  # written in place, never rebound
        (conn,) = served.transport._conns
        registered = conn._next_segment
        message = prep.message
        first: np.ndarray | None = None
        for i in range(0, 40, 4):
            buf[:] = x[i:i + 4]
            out = prep.run()["probabilities"]
            np.testing.assert_allclose(out, served.reference(x[i:i + 4]), rtol=1e-5, atol=1e-6)
            first = out if first is None else first
            assert not out.flags.owndata and np.shares_memory(out, first)  # the same place every run
        assert first is not None
        first.shape = (40,)  # a caller's reshape of one answer is not the next answer's shape
        assert prep.run()["probabilities"].shape == (4, 10)
        copied = prep.run(copy=True)["probabilities"]
        assert copied.flags.owndata and np.array_equal(copied, first.reshape(4, 10))
        # a plain infer() in between changes nothing; nothing is registered or encoded again per run
        assert c.infer("digits", {"pixels": x[:1]})["probabilities"].shape == (1, 10)
        buf[:] = x[:4]
        np.testing.assert_allclose(prep.run()["probabilities"], served.reference(x[:4]), rtol=1e-5, atol=1e-6)
        assert prep.message is message and conn._next_segment == registered + 1  # + infer()'s own slot
        with pytest.raises(InvalidInputError, match="prepared request"):
            c.release(buf)
        assert prep.slot is not None
        mine = [seg for sid, seg in conn.segments.items() if sid in (prep.segment.id, prep.slot.segment.id)]
        assert len(mine) == 2
        prep.close()
        # the daemon unmapped both at once: its cached views of them went with the plans
        assert all(seg.mm.closed for seg in mine) and prep.segment.id not in conn.segments
        with pytest.raises(EdgedError, match="closed") as ei:
            prep.run()
        assert ei.value.code is ErrorCode.FAILED_PRECONDITION
        with pytest.raises(InvalidInputError, match="BYTES"):
            c.prepare("digits", {"pixels": (1, 64)}, dtypes={"pixels": object})
        with c.prepare("digits", {"pixels": (1, 63)}) as bad, \
                pytest.raises(InvalidInputError, match="dimension 1 is 63"):
            bad.run()  # the daemon checks it, and the connection survives
        with c.prepare("digits", {"pixels": (2, 64)}, dtypes={"pixels": ">f4"}) as swapped:
            assert swapped.inputs["pixels"].dtype == np.dtype("=f4")  # the daemon's byte order, so no copy
            swapped.inputs["pixels"][:] = x[:2]
            np.testing.assert_allclose(swapped.run()["probabilities"], served.reference(x[:2]), rtol=1e-5, atol=1e-6)
        assert c.infer("digits", {"pixels": x[:2]})["probabilities"].shape == (2, 10)


def test_an_interrupted_prepared_run_leaves_nothing_registered(
        served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    with ShmClient(served.socket) as c:
        before = served.transport.clients()[0]["segments"]
        prep = c.prepare("digits", {"pixels": (1, 64)})
        prep.inputs["pixels"][:] = x[:1]

        def interrupted(msg: bytes | bytearray, fd: int = -1, rid: int = -1) -> Any:
            c._sock.send(msg)  # the request goes out; the caller is interrupted before its answer
            raise KeyboardInterrupt

        for _ in range(3):
            c._call = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                prep.run()
            del c._call
            assert len(prep.orphans) == 1
            # the next run answers from a fresh output area and gives the old one back
            np.testing.assert_allclose(prep.run()["probabilities"], served.reference(x[:1]), rtol=1e-5, atol=1e-6)
            assert not prep.orphans and served.transport.clients()[0]["segments"] == before + 2
        prep.close()
        assert served.transport.clients()[0]["segments"] == before


def test_sync_calls_interrupted_while_queued_leave_nothing_registered(
        served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """Calls interrupted while their requests wait in the model's queue: the daemon still uses their
    segments, yet closing the prepared request (and the next infer()) gives them back, and the daemon
    unmaps them once those requests are over."""
    x, _ = digits_holdout

    def daemon() -> dict[str, Any]:
        return served.transport.clients()[0]

    def interrupted(msg: bytes | bytearray, fd: int = -1, rid: int = -1) -> Any:
        c._sock.send(msg)  # the request goes out; the caller is interrupted (Ctrl-C) before its answer
        raise KeyboardInterrupt

    with ShmClient(served.socket) as c:
        c.metadata("digits")
        gc.collect()  # earlier tests' views: their mappings must not go during this one
        maps0 = _maps_count()
        prep = c.prepare("digits", {"pixels": (1, 64)})
        c.infer("digits", {"pixels": x[:1]})  # infer()'s slot for the model
        assert daemon()["segments"] == 3
        with held_model(served.service):
            c._call = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                prep.run()
            with pytest.raises(KeyboardInterrupt):
                c.infer("digits", {"pixels": x[:1]})
            del c._call
            _wait(lambda: daemon()["inflight"] == 2, "both requests to be queued at the daemon")
            prep.close()  # its input segment and output area are still in use: given back all the same
            assert daemon()["segments"] == 1 and daemon()["inflight"] == 2
            del prep  # its input arrays stay readable while it lives, on the client's mapping
        # the next infer() answers from a fresh slot and gives the interrupted one back
        np.testing.assert_allclose(c.infer("digits", {"pixels": x[:1]})["probabilities"], served.reference(x[:1]),
                                   rtol=1e-5, atol=1e-6)
        assert daemon()["segments"] == len(c._core.segments) == 1
        (slot,) = c._core.segments.values()
        # the daemon unmapped every other segment: it maps and counts only the slot, as does the client
        _wait(lambda: daemon()["mapped_bytes"] == slot.size and _maps_count() == maps0 + 2,
              "the daemon to unmap the given-back segments")


class _InterruptedWait:
    """A client socket whose wait for a reply is interrupted (Ctrl-C) once the request has gone out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def recv_into(self, buf: bytearray) -> int:
        raise KeyboardInterrupt


def test_a_sync_call_interrupted_while_registering_gives_the_segment_back(
        served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """The daemon maps the segment of a REGISTER whose caller was interrupted before the answer: the
    client gives it back when that answer comes in, so interruptions never use up its segments."""
    x, _ = digits_holdout
    with ShmClient(served.socket) as c:
        c.infer("digits", {"pixels": x[:1]})  # metadata and the model's slot: the next infer() registers nothing
        sock = c._sock
        for _ in range(3):
            c._sock = _InterruptedWait(sock)  # type: ignore[assignment]
            with pytest.raises(KeyboardInterrupt):
                c.tensor((1, 64))
            c._sock = sock
        assert len(c._core.segments) == 1
        np.testing.assert_allclose(c.infer("digits", {"pixels": x[:1]})["probabilities"], served.reference(x[:1]),
                                   rtol=1e-5, atol=1e-6)
        _wait(lambda: served.transport.clients()[0]["segments"] == 1, "the interrupted REGISTERs' segments to go")
        assert c.infer("digits", {"pixels": x[:1]})["probabilities"].shape == (1, 10)  # their replies are dropped


def test_a_prepared_request_grows_its_output_area(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.client import shm_memory

    monkeypatch.setattr(shm_memory, "PAGE", 64)  # exact-size segments, so a bad guess really is too small
    x = np.ones((3, 64), np.float32)
    with ShmClient(served.socket) as c:
        c._info("digits", None)._out_cache[3] = 16  # a wrong guess: "needs N bytes", then a bigger area
        with c.prepare("digits", {"pixels": x.shape}) as prep:
            prep.inputs["pixels"][:] = x
            small = prep.slot
            out = prep.run(copy=True)["probabilities"]
            assert prep.slot is not small and prep.run()["probabilities"].shape == (3, 10)
    np.testing.assert_allclose(out, served.reference(x), rtol=1e-5, atol=1e-6)


def test_errors_are_typed_and_the_connection_survives(served: Served) -> None:
    with ShmClient(served.socket) as c:
        with pytest.raises(ModelNotFoundError) as ei:
            c.infer("nope", {"pixels": np.zeros((1, 64), np.float32)})
        assert ei.value.code is ErrorCode.NOT_FOUND
        with pytest.raises(InvalidInputError, match="datatype FP64, expected FP32"):
            c.infer("digits", {"pixels": np.zeros((1, 64), np.float64)})
        with pytest.raises(InvalidInputError, match="dimension 1 is 63"):
            c.infer("digits", {"pixels": np.zeros((1, 63), np.float32)})
        with pytest.raises(InvalidInputError, match="BYTES"):
            c.infer("digits", {"pixels": np.array([["a"]], dtype=object)})
        assert c.infer("digits", {"pixels": np.zeros((2, 64), np.float32)})["probabilities"].shape == (2, 10)


def test_a_request_that_finds_the_model_busy_does_not_stop_its_connection_reading(served: Served) -> None:
    """A lone request (nothing else in flight, not flagged as queued) that finds the model busy is
    queued, and its connection goes on reading: what the client sends behind it is read and answered
    (or joins the queue and its batch) instead of waiting unread on the socket until the run is done."""
    sched = served.service.ready_model("digits").scheduler
    assert sched is not None
    raw = Raw(served.socket)
    raw.sock.settimeout(10)
    fd, seg = create_segment(8192)
    try:
        kind, status, _, body = raw.call(p.REGISTER, p.U64.pack(seg.size), [fd])
    finally:
        os.close(fd)
    assert (kind, status) == (p.REGISTER | p.REPLY, 0), p.decode_error(body)
    (seg_id,) = p.U32.unpack(body)
    x = np.random.default_rng(3).random((1, 64), dtype=np.float32) * 16
    np.frombuffer(seg.mm, np.float32, 64)[:] = x.ravel()
    assert sched._claim()  # another caller's inline run holds the model's one instance
    try:
        raw.rid += 1
        infer_rid = raw.rid
        raw.sock.send(p.encode_infer(infer_rid, "digits", 0, [_pixels(seg_id)], out_segment=seg_id,
                                     out_offset=4096, out_capacity=4096))
        kind, status, _, body = raw.call(p.METADATA, p.META_BODY.pack(0, 6) + b"digits")
        assert (kind, status) == (p.METADATA | p.REPLY, 0)  # answered while the request waits for the model
    finally:
        with sched._lock:  # the other caller's run ends
            sched._busy -= 1
            sched._cv.notify()
    data = raw.sock.recv(p.MAX_MESSAGE)
    kind, status, count, rid = p.HEADER.unpack_from(data)
    assert (kind, status, rid) == (p.INFER | p.REPLY, 0, infer_rid), p.decode_error(data[p.HEADER.size:])
    _, (out,) = p.decode_outputs(data[p.HEADER.size:], count)
    got = np.frombuffer(seg.mm, np.float32, 10, out.offset).reshape(1, 10)
    np.testing.assert_allclose(got, served.reference(x), rtol=1e-5, atol=1e-6)
    del got
    raw.close()
    seg.close()


def test_output_slot_grows_on_too_small(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.client import shm_memory

    monkeypatch.setattr(shm_memory, "PAGE", 64)  # exact-size segments, so a bad guess really is too small
    x = np.ones((3, 64), np.float32)
    with ShmClient(served.socket) as c:
        info = c._info("digits", None)
        info._out_cache[3] = 16  # a wrong guess: the daemon answers "needs N bytes" and the client grows
        out = c.infer("digits", {"pixels": x})["probabilities"]
        assert info.output_hint >= out.nbytes
    np.testing.assert_allclose(out, served.reference(x), rtol=1e-5, atol=1e-6)


def test_bad_descriptors_get_error_completions(served: Served) -> None:
    raw = Raw(served.socket)
    seg = raw.register(8192)
    ok = _pixels(seg)
    fp32 = p.DTYPE_CODE["FP32"]
    cases: list[tuple[list[bytes], dict[str, int], ErrorCode, str]] = [
        ([_pixels(seg, offset=8192 - 128)], {}, ErrorCode.INVALID_ARGUMENT, "outside segment"),
        ([_pixels(seg, offset=2**64 - 32)], {}, ErrorCode.INVALID_ARGUMENT, "outside segment"),
        ([_pixels(seg, offset=64, nbytes=2**64 - 32, shape=(2**62 - 8, 1))], {}, ErrorCode.INVALID_ARGUMENT,
         "is too large"),  # refused from the shape alone
        ([_pixels(999)], {}, ErrorCode.INVALID_ARGUMENT, "unknown segment 999"),
        ([_pixels(seg, dtype=p.DTYPE_CODE["INT32"])], {}, ErrorCode.INVALID_ARGUMENT, "datatype INT32"),
        ([_pixels(seg, dtype=99)], {}, ErrorCode.INVALID_ARGUMENT, "unknown dtype code"),
        ([_pixels(seg, shape=(1, 63))], {}, ErrorCode.INVALID_ARGUMENT, "dimension 1 is 63"),
        ([_pixels(seg, nbytes=100)], {}, ErrorCode.INVALID_ARGUMENT, "the descriptor says 100"),
        ([_pixels(seg, offset=2)], {}, ErrorCode.INVALID_ARGUMENT, "not aligned"),
        ([ok, ok], {}, ErrorCode.INVALID_ARGUMENT, "appears twice"),
        ([p.encode_tensor("pixels", fp32, (1, -64), segment=seg, offset=0, nbytes=256)], {},
         ErrorCode.INVALID_ARGUMENT, "negative dimension"),
        ([ok], {"out_seg": 77}, ErrorCode.INVALID_ARGUMENT, "unknown segment 77"),
        ([ok], {"out_off": 8000, "out_cap": 1000}, ErrorCode.INVALID_ARGUMENT, "outside segment"),
        ([ok], {"out_off": 64, "out_cap": 2**64 - 1}, ErrorCode.INVALID_ARGUMENT, "outside segment"),
        ([ok], {"out_cap": 8}, ErrorCode.RESOURCE_EXHAUSTED, "too small"),
        ([ok], {"model": 1}, ErrorCode.NOT_FOUND, "not in the repository"),
    ]
    for inputs, kw, code, text in cases:
        status, _, body = raw.infer(inputs, kw.get("out_seg", seg), kw.get("out_off", 4096),
                                    kw.get("out_cap", 4096), model="nope" if kw.get("model") else "digits")
        needed, message = p.decode_error(body)
        assert p.STATUS_CODES[status] is code, (text, message)
        assert text in message
        assert "/" not in message.replace("1..64", "")  # no paths or region names leak
        if code is ErrorCode.RESOURCE_EXHAUSTED:
            assert needed >= 40
    # malformed messages: truncated, trailing garbage, unknown kind, header only, fds on INFER
    good = p.encode_infer(1, "digits", 0, [ok], out_segment=seg, out_offset=4096, out_capacity=4096)
    for msg in (good[:-3], good + b"xx", p.header(42, 5), b"\x04\x00", p.header(p.INFER, 6)):
        _, status, _, body = raw.send_raw(msg)
        assert status == p.STATUS_OF[ErrorCode.INVALID_ARGUMENT], p.decode_error(body)
    r, w = os.pipe()
    try:
        _, status, _, body = raw.send_raw(good, [r])
        assert status and "only with REGISTER" in p.decode_error(body)[1]
    finally:
        os.close(r)
        os.close(w)
    status, count, body = raw.infer([ok], seg)  # the connection still works
    assert status == 0 and count == 1
    raw.close()
    with ShmClient(served.socket) as c:  # and so does everyone else
        assert c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})["probabilities"].shape == (1, 10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300), kind=st.sampled_from([p.INFER, p.REGISTER, p.UNREGISTER, p.METADATA,
                                                           p.HELLO, 0, 99]))
def test_fuzzed_messages_never_break_the_server(served: Served, body: bytes, kind: int) -> None:
    raw = Raw(served.socket)
    try:
        raw.register(4096)
        reply_kind, status, _, reply = raw.call(kind, body)
        assert reply_kind == (kind | p.REPLY)
        if status:
            p.decode_error(reply)
        status, count, _ = raw.infer([_pixels(1)], 1, 1024, 1024)
        assert (status, count) == (0, 1)
    finally:
        raw.close()


def test_register_refuses_unsealed_and_wrong_files(served: Served, tmp_path: Path) -> None:
    raw = Raw(served.socket)
    raw.call(p.HELLO, p.U32.pack(p.PROTOCOL_VERSION))  # accepted and served: its socket is counted
    fds0 = _fd_count()

    def register(fd: int, size: int) -> tuple[int, str]:
        _, status, _, body = raw.call(p.REGISTER, p.U64.pack(size), [fd])
        return status, p.decode_error(body)[1] if status else ""

    unsealed = os.memfd_create("edged-shm-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    status, message = register(unsealed, 4096)
    assert p.STATUS_CODES[status] is ErrorCode.FAILED_PRECONDITION and "F_SEAL_SHRINK" in message
    no_sealing = os.memfd_create("edged-shm-test", os.MFD_CLOEXEC)  # F_SEAL_SEAL set from birth
    os.ftruncate(no_sealing, 4096)
    assert "F_SEAL_SHRINK" in register(no_sealing, 4096)[1]
    fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    assert "announced 8192" in register(unsealed, 8192)[1]  # a size lie is refused
    assert register(unsealed, 4096)[0] == 0  # sealed and honest: accepted
    plain = tmp_path / "plain"
    plain.write_bytes(b"\0" * 4096)
    fd = os.open(plain, os.O_RDWR)
    assert register(fd, 4096)[0] == p.STATUS_OF[ErrorCode.FAILED_PRECONDITION]
    r, w = os.pipe()
    assert "not a memory file" in register(r, 4096)[1]
    for f in (unsealed, no_sealing, fd, r, w):
        os.close(f)
    _, status, _, body = raw.call(p.REGISTER, p.U64.pack(4096))
    assert status and "exactly one file descriptor" in p.decode_error(body)[1]
    # the daemon (this process) closed every fd it was passed; only the one accepted memfd is mapped
    # (before Python 3.13, mmap keeps its own duplicate of the descriptor)
    assert _fd_count() - fds0 == (1 if sys.version_info < (3, 13) else 0)
    assert served.transport.clients()[0]["segments"] == 1
    raw.close()


def test_per_client_limits(model_repo: Callable[..., Path], tmp_path: Path) -> None:
    limits = Limits(max_segments=2, max_mapped_bytes=2 * 4096 + 100, max_inflight=4)
    with _serve(model_repo("digits"), tmp_path, limits=limits) as s:
        raw = Raw(s.socket)
        a = raw.register(4096)
        fd, seg = create_segment(8192)
        _, status, _, body = raw.call(p.REGISTER, p.U64.pack(8192), [fd])
        assert p.STATUS_CODES[status] is ErrorCode.RESOURCE_EXHAUSTED and "budget" in p.decode_error(body)[1]
        raw.register(4096)
        _, status, _, body = raw.call(p.REGISTER, p.U64.pack(8192), [fd])
        assert p.STATUS_CODES[status] is ErrorCode.RESOURCE_EXHAUSTED and "too many segments" in \
            p.decode_error(body)[1]
        os.close(fd)
        seg.close()
        _, status, _, _ = raw.call(p.UNREGISTER, p.U32.pack(a))
        assert status == 0
        _, status, _, body = raw.call(p.UNREGISTER, p.U32.pack(a))
        assert "unknown segment" in p.decode_error(body)[1]
        assert s.transport.clients()[0]["segments"] == 1
        raw.close()


def test_a_segment_unregistered_in_use_loses_its_id_at_once_and_its_mapping_after_its_last_request(
        model_repo: Callable[..., Path], tmp_path: Path) -> None:
    """A client cut off while waiting for an answer gives the request's memory back while the request is
    still queued. The id goes at once (no new request can name it); the mapping stays, counted against
    the client's limits, until the last request using it is over, and is unmapped then."""
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_segments=2)) as s:
        raw = Raw(s.socket)

        def daemon() -> dict[str, Any]:
            return s.transport.clients()[0]

        gc.collect()  # earlier tests' views: their mappings must not go during this one
        maps0 = _maps_count()
        seg = raw.register(8192)  # Raw unmaps its own side at once: only the daemon's mapping is counted
        with held_model(s.service):
            raw.rid += 1
            queued = raw.rid
            raw.sock.send(p.encode_infer(queued, "digits", 0, [_pixels(seg)], out_segment=seg, out_offset=4096,
                                         out_capacity=4096))
            _wait(lambda: daemon()["inflight"] == 1, "the request to be queued")
            _, status, _, body = raw.call(p.UNREGISTER, p.U32.pack(seg))
            assert status == 0, p.decode_error(body)
            assert daemon()["segments"] == 0 and daemon()["mapped_bytes"] == 8192 and _maps_count() == maps0 + 1
            status, _, body = raw.infer([_pixels(seg)], seg)
            assert status and f"unknown segment {seg}" in p.decode_error(body)[1]
            _, status, _, body = raw.call(p.UNREGISTER, p.U32.pack(seg))
            assert "unknown segment" in p.decode_error(body)[1]
            other = raw.register(8192)
            fd, extra = create_segment(8192)  # the one in use still counts: a third is one too many
            try:
                _, status, _, body = raw.call(p.REGISTER, p.U64.pack(extra.size), [fd])
            finally:
                os.close(fd)
                extra.close()
            assert "too many segments" in p.decode_error(body)[1]
        data = raw.sock.recv(p.MAX_MESSAGE)
        _, status, _, rid = p.HEADER.unpack_from(data)
        assert (rid, status) == (queued, 0), p.decode_error(data[p.HEADER.size:])
        _wait(lambda: daemon()["mapped_bytes"] == 8192 and _maps_count() == maps0 + 1,
              "the daemon to unmap the segment after its last request")
        assert raw.register(8192) > other
        raw.close()


def test_a_client_that_reads_its_replies_late_within_max_inflight_stays_connected(
        model_repo: Callable[..., Path], tmp_path: Path) -> None:
    """Replies go out without waiting (a scheduler thread never blocks on one client), so a full socket
    buffer reads as a client that does not read and is disconnected. Each client's buffer holds its
    max_inflight replies: one that sends that many before it reads a single reply is served in full."""
    n = 400  # far more replies than the kernel's default socket buffer holds (about 270)
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_inflight=n)) as s:
        raw = Raw(s.socket)
        seg = raw.register(8192)
        for _ in range(n):
            raw.rid += 1
            raw.sock.send(p.encode_infer(raw.rid, "digits", 0, [_pixels(seg)], out_segment=seg, out_offset=4096,
                                         out_capacity=4096, flags=p.FLAG_QUEUE))
        _wait(lambda: not (cs := s.transport.clients()) or cs[0]["requests"] == n,
              "every request to be answered (or the client disconnected)")
        replies = [raw.sock.recv(p.MAX_MESSAGE) for _ in range(n)]
        assert [p.HEADER.unpack_from(r)[1:3] if r else "EOF" for r in replies] == [(0, 1)] * n
        assert s.transport.clients()
        raw.close()


def test_max_inflight_is_bounded_in_the_config() -> None:
    """Each client's socket buffer is sized to hold max_inflight replies, pinned in the kernel: bounded."""
    assert parse_config("[shm]\nmax_inflight = 1024\n").shm.max_inflight == 1024
    with pytest.raises(ConfigError, match=r"shm\.max_inflight: .*less than or equal to 1024"):
        parse_config("[shm]\nmax_inflight = 5000\n")


def test_many_clients_at_once(served: Served, tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    ref = served.reference(x)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "ref.npy", ref)
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from edged.client.shm import ShmClient
        x, ref = np.load({str(tmp_path / 'x.npy')!r}), np.load({str(tmp_path / 'ref.npy')!r})
        with ShmClient({str(served.socket)!r}) as c:
            for i in range(150):
                j = (i * 7) % len(x)
                out = c.infer("digits", {{"pixels": x[j:j + 1 + i % 5]}})["probabilities"]
                np.testing.assert_allclose(out, ref[j:j + 1 + i % 5], rtol=1e-5, atol=1e-6)
        print("ok")
        """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    errors: list[BaseException] = []
    seen_clients: list[int] = []

    def worker(k: int) -> None:
        try:
            with ShmClient(served.socket) as c:
                for i in range(60):
                    j = (k * 31 + i * 3) % (len(x) - 4)
                    out = c.infer("digits", {"pixels": x[j:j + 1 + (i + k) % 4]})["probabilities"]
                    np.testing.assert_allclose(out, ref[j:j + 1 + (i + k) % 4], rtol=1e-5, atol=1e-6)
                    if i == 30:
                        seen_clients.append(len(served.transport.clients()))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client thread did not finish"
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failure above must not leave the client process behind
            proc.kill()
            proc.wait(10)
    assert not errors, errors
    assert proc.returncode == 0 and out.strip() == "ok"
    assert max(seen_clients) >= 2
    _wait(lambda: not served.transport.clients(), "every client to be released")


def test_async_pipelined_requests(served: Served, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    ref = served.reference(x)

    async def run() -> list[dict[str, np.ndarray]]:
        async with AsyncShmClient(served.socket) as c:
            meta = await c.metadata("digits")
            assert meta["name"] == "digits"
            outs = await asyncio.gather(*(c.infer("digits", {"pixels": x[i:i + 1 + i % 3]}) for i in range(120)))
            with pytest.raises(ModelNotFoundError):
                await c.infer("nope", {"pixels": x[:1]})
            t = await c.tensor((5, 64))
            t[:] = x[:5]
            outs.append(await c.infer("digits", {"pixels": t}))
            # cancelled calls: their slots are reused only after their late completions arrived
            for _ in range(3):
                tasks = [asyncio.ensure_future(c.infer("digits", {"pixels": x[i:i + 2]})) for i in range(40)]
                for _ in range(3):
                    await asyncio.sleep(0)  # sleep-ok: let the calls get under way, then cancel some
                for task in tasks[::3]:
                    task.cancel()
                done = await asyncio.gather(*tasks, return_exceptions=True)
                for i, r in enumerate(done):
                    if not isinstance(r, BaseException):
                        np.testing.assert_allclose(r["probabilities"], ref[i:i + 2], rtol=1e-5, atol=1e-6)
            return outs

    outs = asyncio.run(run())
    for i in range(120):
        np.testing.assert_allclose(outs[i]["probabilities"], ref[i:i + 1 + i % 3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[120]["probabilities"], ref[:5], rtol=1e-5, atol=1e-6)
    stats = served.service.statistics("digits")[0]
    assert stats["inference_stats"]["success"]["count"] >= 121
    _wait(lambda: not served.transport.clients(), "the async client to be released")


def test_async_prepared_requests_run_side_by_side(served: Served,
                                                  digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    frames = len(x) // 2

    async def run() -> list[list[tuple[int, np.ndarray]]]:
        async with AsyncShmClient(served.socket) as c:
            preps = [await c.prepare("digits", {"pixels": (2, 64)}) for _ in range(4)]
            messages = [prep.message for prep in preps]

            async def loop(k: int, prep: Any) -> list[tuple[int, np.ndarray]]:
                outs = []
                for i in range(12):
                    lo = (k * 12 + i) % frames * 2
                    prep.inputs["pixels"][:] = x[lo:lo + 2]
                    outs.append((lo, (await prep.run(copy=True))["probabilities"]))
                return outs

            results = list(await asyncio.gather(*(loop(k, prep) for k, prep in enumerate(preps))))
            first, second = (await preps[0].run())["probabilities"], (await preps[0].run())["probabilities"]
            assert not first.flags.owndata and np.shares_memory(first, second)  # views made once
            busy = asyncio.ensure_future(preps[1].run())
            await asyncio.sleep(0)  # sleep-ok: one turn of the loop starts the run
            with pytest.raises(EdgedError, match="already running") as ei:
                await preps[1].run()  # one request at a time per prepared request
            assert ei.value.code is ErrorCode.FAILED_PRECONDITION
            del ei  # its traceback holds this frame and the shared views in it
            await busy
            # cancelled runs: whatever the daemon still writes lands in an area the next run no longer
            # uses, and that area is used again later (a loop cut off by timeouts does not pile them up)
            segments = served.transport.clients()[0]["segments"]
            cut_in_flight = 0
            preps[2].inputs["pixels"][:] = x[:2]
            for _ in range(200):
                cut = asyncio.ensure_future(preps[2].run())
                await asyncio.sleep(0)  # sleep-ok: one turn of the loop sends it, then it is cut
                cut.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await cut
                cut_in_flight += preps[2].slot is None
                np.testing.assert_allclose((await preps[2].run())["probabilities"], served.reference(x[:2]),
                                           rtol=1e-5, atol=1e-6)
            assert cut_in_flight > 100
            assert served.transport.clients()[0]["segments"] <= segments + 2
            assert [prep.message is m for prep, m in zip(preps, messages, strict=True)][:2] == [True, True]
            # closed while a run is in flight: the run finishes, then its buffers go back
            running = asyncio.ensure_future(preps[3].run(copy=True))
            await asyncio.sleep(0)  # sleep-ok: one turn of the loop sends it, then close
            await preps[3].close()
            assert (await running)["probabilities"].shape == (2, 10)
            assert served.transport.clients()[0]["segments"] <= segments + 2 - 2
            for prep in preps:
                await prep.close()
            with pytest.raises(EdgedError, match="closed"):
                await preps[0].run()
            with pytest.raises(InvalidInputError, match="BYTES"):
                await c.prepare("digits", {"pixels": (1, 64)}, dtypes={"pixels": object})
            return results

    for outs in asyncio.run(run()):
        for lo, out in outs:
            np.testing.assert_allclose(out, served.reference(x[lo:lo + 2]), rtol=1e-5, atol=1e-6)
    _wait(lambda: not served.transport.clients(), "the async client to be released")


KILLED_CLIENT = """
import asyncio, sys
import numpy as np
from edged.client.shm import AsyncShmClient

async def main():
    async with AsyncShmClient(sys.argv[1]) as c:
        x = np.random.default_rng(1).random((4, 64), dtype=np.float32) * 16
        async def loop():
            while True:
                await c.infer("digits", {"pixels": x})
        tasks = [asyncio.ensure_future(loop()) for _ in range(8)]
        await c.infer("digits", {"pixels": x})
        print("ready", flush=True)
        await asyncio.gather(*tasks)

asyncio.run(main())
"""


def test_kill_9_of_a_client_mid_requests(served: Served, tmp_path: Path) -> None:
    shm_before = _dev_shm()
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) % 17
    ref = served.reference(x)
    with ShmClient(served.socket) as other:
        np.testing.assert_allclose(other.infer("digits", {"pixels": x})["probabilities"], ref, rtol=1e-5)
        # Earlier tests' segments stay mapped while a reference cycle (a caught exception's frames)
        # still holds a view on them; collect those first, or they go during this test and the
        # count below comes out lower than the start.
        gc.collect()
        maps0, fds0 = _maps_count(), _fd_count()
        script = tmp_path / "killed.py"
        script.write_text(KILLED_CLIENT)
        proc = subprocess.Popen([sys.executable, str(script), str(served.socket)], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"

        def victim() -> dict[str, Any] | None:
            return next((c for c in served.transport.clients() if c["pid"] == proc.pid), None)

        _wait(lambda: (v := victim()) is not None and v["requests"] > 50, "the victim to be busy")
        info = victim()
        assert info is not None and info["segments"] >= 1
        assert _maps_count() > maps0  # the daemon maps the victim's segments
        os.kill(proc.pid, signal.SIGKILL)
        # the other client keeps being served while the victim dies
        for _ in range(20):
            np.testing.assert_allclose(other.infer("digits", {"pixels": x})["probabilities"], ref, rtol=1e-5)
        proc.wait(30)
        proc.stdout.close()
        _wait(lambda: victim() is None, "the daemon to notice the dead client")
        assert _maps_count() == maps0  # every segment of the victim is unmapped
        assert _fd_count() == fds0  # and its socket is closed
        np.testing.assert_allclose(other.infer("digits", {"pixels": x})["probabilities"], ref, rtol=1e-5)
        assert [c["pid"] for c in served.transport.clients()] == [os.getpid()]
    assert _dev_shm() <= shm_before  # memfds leave nothing behind in /dev/shm


def test_stop_disconnects_clients_and_refuses_a_second_server(model_repo: Callable[..., Path],
                                                              tmp_path: Path) -> None:
    repo = model_repo("digits")
    with _serve(repo, tmp_path) as s:
        c = ShmClient(s.socket)
        c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})
        with pytest.raises(EdgedError, match="already serving") as ei:
            ShmTransport(_config(tmp_path), s.service).start_blocking()
        assert ei.value.code is ErrorCode.UNAVAILABLE
        s.transport.stop_blocking()
        assert s.transport.clients() == []
        with pytest.raises(EdgedError) as ei:
            c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})
        assert ei.value.code is ErrorCode.UNAVAILABLE
        c.close()
    # a leftover socket file (crashed daemon) is replaced; a non-socket file is never touched
    sock_path = _config(tmp_path).shm_socket
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    leftover.bind(str(sock_path))
    leftover.close()
    with _serve(repo, tmp_path) as s, ShmClient(s.socket) as c:
        assert c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})["probabilities"].shape == (1, 10)
    sock_path.write_text("not a socket")
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    with pytest.raises(EdgedError, match="not a socket"):
        ShmTransport(_config(tmp_path), InferenceService(manager)).start_blocking()
    assert sock_path.read_text() == "not a socket"


def test_async_start_stop_as_the_daemon_does(model_repo: Callable[..., Path], tmp_path: Path) -> None:
    manager = ModelManager(model_repo("digits"), ModelsSection(), ORT_CPU)
    manager.load_all()
    transport = ShmTransport(_config(tmp_path), InferenceService(manager))

    async def run() -> None:
        await transport.start()
        async with AsyncShmClient(transport.path) as c:
            out = await c.infer("digits", {"pixels": np.zeros((2, 64), np.float32)})
            assert out["probabilities"].shape == (2, 10)
        await transport.stop()

    try:
        asyncio.run(run())
    finally:
        manager.shutdown()
    assert not transport.path.exists()


def test_stale_dev_shm_files_are_cleaned(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"edged-{dead.pid}-seg0").write_bytes(b"x")
    (tmp_path / "edged-garbage").write_bytes(b"x")
    (tmp_path / f"edged-{os.getpid()}-seg0").write_bytes(b"x")  # its owner is alive: kept
    (tmp_path / "other-1").write_bytes(b"x")
    removed = clean_stale_shm(tmp_path)
    assert sorted(removed) == sorted([f"edged-{dead.pid}-seg0", "edged-garbage"])
    assert sorted(os.listdir(tmp_path)) == sorted([f"edged-{os.getpid()}-seg0", "other-1"])


def test_against_edged_run(model_repo: Callable[..., Path], write_config: Callable[..., Path],
                           digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """The daemon starts the transport; a crash of the daemon leaves a socket the next start replaces."""
    x, y = digits_holdout
    with tempfile.TemporaryDirectory(prefix="edged-") as run_dir:  # short path for the socket
        cfg = write_config(model_repo("digits"), f"""
            [http]
            enabled = false
            [mqtt]
            enabled = false
            [shm]
            socket = "{run_dir}/edged.sock"
            """)
        sock = Path(run_dir) / "edged.sock"
        shm_before = _dev_shm()
        for attempt in range(2):
            proc = subprocess.Popen([*EDGED, "run", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            try:
                _wait(lambda p_=proc: _connects(sock) or p_.poll() is not None,  # type: ignore[misc]
                      "edged run to listen", 90)
                assert proc.poll() is None, proc.communicate()[1]
                assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
                with ShmClient(sock) as c:
                    out = c.infer("digits", {"pixels": x[:64]})["probabilities"]
                    assert (out.argmax(1) == y[:64]).mean() > 0.9
                    if attempt == 0:
                        os.kill(proc.pid, signal.SIGKILL)  # crash the daemon under a connected client
                        proc.wait(30)
                        with pytest.raises(EdgedError) as ei:
                            c.infer("digits", {"pixels": x[:1]})
                        assert ei.value.code is ErrorCode.UNAVAILABLE
                        assert sock.exists()  # stale; the next start must replace it
                    else:
                        proc.send_signal(signal.SIGTERM)
                        assert proc.wait(30) == 0
                        assert not sock.exists()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert _dev_shm() <= shm_before


def _connects(path: Path) -> bool:
    try:
        ShmClient(path).close()
    except EdgedError:
        return False
    return True


# ---- a request sent like one before goes from its template ------------------------------------------------
def _count_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from edged.client import shm as client_shm

    planned: list[int] = []
    real = client_shm.plan_inputs

    def counted(*a: Any, **kw: Any) -> Any:
        planned.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(client_shm, "plan_inputs", counted)
    return planned


def test_a_repeated_request_goes_from_its_template_with_each_calls_inputs(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second call of the same shapes is not packed or encoded again, yet carries its own inputs:
    every answer is the engine's for that very input, whatever came before."""
    planned = _count_plans(monkeypatch)
    rng = np.random.default_rng(3)
    xs = [rng.random((2, 64), dtype=np.float32) * 16 for _ in range(6)]
    with ShmClient(served.socket) as c:
        for x in xs:
            np.testing.assert_allclose(c.infer("digits", {"pixels": x})["probabilities"], served.reference(x),
                                       rtol=1e-5, atol=1e-6)
        assert len(planned) == 1, planned  # only the first call was packed
        # Another output list and another timeout are other messages: each packed once, then templated.
        for _ in range(2):
            got = c.infer("digits", {"pixels": xs[0]}, outputs=["probabilities"], timeout=5.0)
            np.testing.assert_allclose(got["probabilities"], served.reference(xs[0]), rtol=1e-5, atol=1e-6)
        assert len(planned) == 2, planned
        assert len(c._slots[("digits", 0)].templates) == 2


def test_a_zero_copy_or_borrowed_input_is_not_taken_for_a_template(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input in the client's shared memory goes by reference even after a plain array of its shape was
    templated (its bytes are not copied into the slot), and a view of another array is packed as before."""
    rng = np.random.default_rng(4)
    x = rng.random((2, 64), dtype=np.float32) * 16
    with ShmClient(served.socket) as c:
        c.infer("digits", {"pixels": x})
        slot = c._slots[("digits", 0)]
        (tpl,) = slot.templates.values()
        planned = _count_plans(monkeypatch)
        zc = c.tensor((2, 64))
        zc[:] = rng.random((2, 64), dtype=np.float32) * 16
        np.testing.assert_allclose(c.infer("digits", {"pixels": zc})["probabilities"], served.reference(zc),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(tpl.views[0], x)  # the slot still holds the last copied input
        big = rng.random((4, 64), dtype=np.float32) * 16
        part = big[1:3]  # borrows big's memory
        np.testing.assert_allclose(c.infer("digits", {"pixels": part})["probabilities"], served.reference(part),
                                   rtol=1e-5, atol=1e-6)
        assert len(planned) == 2, planned


def test_a_templated_request_answered_needs_n_bytes_is_packed_and_sent_again(served: Served) -> None:
    """An answer that does not fit the template's output area ('needs N bytes') is not an error: the
    request is packed and encoded afresh for a slot that fits, and answered."""
    x = np.ones((3, 64), np.float32)
    with ShmClient(served.socket) as c:
        c.infer("digits", {"pixels": x})
        slot = c._slots[("digits", 0)]
        (tpl,) = slot.templates.values()
        # Make the template's output capacity too small for the answer (3 x 10 float32).
        fields = list(p.INFER_BODY.unpack_from(tpl.message, p.HEADER.size))
        fields[4] = 16
        p.INFER_BODY.pack_into(tpl.message, p.HEADER.size, *fields)
        out = c.infer("digits", {"pixels": x})["probabilities"]
        np.testing.assert_allclose(out, served.reference(x), rtol=1e-5, atol=1e-6)
        assert c._info("digits", None).output_hint >= out.nbytes


def test_async_requests_in_flight_together_each_carry_their_own_inputs_from_templates(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight requests of one shape at once, several rounds: each pooled slot keeps its own template, and
    every answer is the engine's for that request's input, never a neighbour's."""
    planned = _count_plans(monkeypatch)
    rng = np.random.default_rng(5)
    rounds = [[rng.random((1, 64), dtype=np.float32) * 16 for _ in range(8)] for _ in range(4)]

    async def go() -> list[list[np.ndarray]]:
        async with AsyncShmClient(served.socket) as c:
            out = []
            for xs in rounds:
                got = await asyncio.gather(*(c.infer("digits", {"pixels": x}) for x in xs))
                out.append([g["probabilities"] for g in got])
            return out

    for xs, outs in zip(rounds, asyncio.run(go()), strict=True):
        for x, o in zip(xs, outs, strict=True):
            np.testing.assert_allclose(o, served.reference(x), rtol=1e-5, atol=1e-6)
    assert len(planned) < 32, planned  # later rounds went from the slots' templates
