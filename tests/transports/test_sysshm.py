"""Triton-compatible system shared memory: registration checks, per-request bounds, hostile clients.

Segments are real POSIX shared memory files in /dev/shm made the way a client makes
them; the daemon side is the real registry behind the real HTTP transport.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.client.http import HttpClient
from edged.errors import EdgedError, InvalidInputError
from edged.protocol.types import InferRequest
from edged.transports.shm.sysshm import ShmCaller, SystemShmRegions, check_key
from tests.http_helpers import TOKEN, Segment, Served, copy_models, served

pytestmark = pytest.mark.timeout(180)

MB = 1024 * 1024
ME = ShmCaller("token")  # a TCP caller holding the management credential
BIG = [2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1, 2**64, 2**70, -1, -(2**63), -(2**64) + 32]


def tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment(f"/shmtest_{tag()}", 4096)
    yield seg
    seg.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("sysshm")
    extra = '[shm]\nmax_region_mb = 1\nsystem_shm_prefix = "shmtest_"\n'
    with served(copy_models(tmp / "models", "digits"), tmp, extra=extra) as s:
        yield s


@pytest.fixture
def client(srv: Served) -> Iterator[HttpClient]:
    with HttpClient(srv.url, token=TOKEN) as c:
        yield c
        c.request("POST", "/v2/systemsharedmemory/unregister")


def register(c: HttpClient, name: str, key: str, byte_size: object, offset: object = 0) -> tuple[int, str]:
    body = b'{"key": %s, "offset": %s, "byte_size": %s}' % (
        orjson.dumps(key), str(offset).encode(), str(byte_size).encode())
    r = c.request("POST", f"/v2/systemsharedmemory/region/{name}/register", [body])
    return r.status, (orjson.loads(r.body).get("error", "") if r.body else "")


def infer_from_shm(c: HttpClient, region: str, offset: object, size: object, *, out: tuple[str, object, object]
                   | None = None) -> tuple[int, dict[str, object]]:
    """Infer digits with its input in shm; offset/size are spliced in verbatim (any integer, any size)."""
    def slot(region: object, offset: object, size: object) -> str:
        return (f'{{"shared_memory_region":{orjson.dumps(region).decode()},'
                f'"shared_memory_offset":{offset},"shared_memory_byte_size":{size}}}')

    text = ('{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"parameters":'
            + slot(region, offset, size) + "}]")
    if out is not None:
        text += ',"outputs":[{"name":"probabilities","parameters":' + slot(*out) + "}]"
    r = c.request("POST", "/v2/models/digits/infer", [(text + "}").encode()])
    return r.status, orjson.loads(r.body)


def assert_alive(c: HttpClient) -> None:
    assert c.infer("digits", {"pixels": np.ones((1, 64), np.float32)})["probabilities"].shape == (1, 10)


# ---- registration -----------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["", "/", ".", "..", "/..", "a/b", "/a/b", "../../etc/passwd", "//x", "x\0y",
                                 "edged", "/edged-seg", "EDGED_1", "/edged.sock", "x" * 300, "sp ace", "a\\b"])
def test_bad_keys_are_refused(key: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        check_key(key)
    if len(key) > 5:
        assert key not in str(e.value)


def test_good_keys() -> None:
    assert check_key("/input_data") == "input_data"
    assert check_key("out-put.1") == "out-put.1"
    with pytest.raises(InvalidInputError):
        check_key(5)


def test_register_checks_the_real_segment(client: HttpClient, segment: Segment, tmp_path: Path) -> None:
    status, err = register(client, "r", segment.key, 4096)
    assert status == 200, err
    status, err = register(client, "r", segment.key, 4096)
    assert status == 400 and "already registered" in err
    # bigger than the segment (fstat), alone or with the offset
    assert register(client, "big", segment.key, 4097)[0] == 400
    status, err = register(client, "big", segment.key, 4000, offset=100)
    assert status == 400 and "segment (4096 bytes)" in err
    assert segment.key.lstrip("/") not in err
    # larger than [shm] max_region_mb, whatever the segment's size
    status, err = register(client, "huge", segment.key, 2 * MB)
    assert status == 400 and "max_region_mb" in err
    # absent segment: the error names the region, never the key or a path
    status, err = register(client, "gone", "/shmtest_absent_" + tag(), 16)
    assert status == 400 and "'gone'" in err and "shmtest_absent" not in err and "/dev/shm" not in err
    # the daemon's own prefix is reserved
    assert register(client, "mine", "/edged-anything", 16)[0] == 400
    # bad numbers
    for size in ("0", "-1", "1.5", "true", '"16"', str(2**64 - 32)):
        assert register(client, "n", segment.key, size)[0] == 400, size
    for off in ("-1", str(2**64 - 32), "null"):
        assert register(client, "n", segment.key, 16, offset=off)[0] == 400, off
    # a symlink in /dev/shm to somewhere else is not followed
    link = Path("/dev/shm") / f"shmtest_link_{tag()}"
    target = tmp_path / "secret"
    target.write_bytes(b"s" * 64)
    link.symlink_to(target)
    try:
        status, err = register(client, "link", "/" + link.name, 16)
        assert status == 400 and str(target) not in err
    finally:
        link.unlink()
    r = client.request("GET", "/v2/systemsharedmemory/status")
    assert [x["name"] for x in orjson.loads(r.body)] == ["r"]
    r = client.request("GET", "/v2/systemsharedmemory/region/nope/status")
    assert r.status == 404
    assert client.request("POST", "/v2/systemsharedmemory/region/r/unregister").status == 200
    assert client.request("POST", "/v2/systemsharedmemory/region/r/unregister").status == 200  # idempotent
    assert orjson.loads(client.request("GET", "/v2/systemsharedmemory/status").body) == []


def test_inputs_and_outputs_through_shm(srv: Served, client: HttpClient, segment: Segment,
                                        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x = digits_holdout[0][7:8]
    segment.write(x.tobytes(), 1024)
    assert register(client, "io", segment.key, 3072, offset=512)[0] == 200  # window [512, 3584)
    status, body = infer_from_shm(client, "io", 512, 256, out=("io", 2048, 40))
    assert status == 200, body
    got = np.frombuffer(segment.read(40, 512 + 2048), np.float32)
    want = srv.service.infer(InferRequest("digits", {"pixels": x}), timeout=30).outputs["probabilities"][0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the output slot must hold the output
    status, body = infer_from_shm(client, "io", 512, 256, out=("io", 2048, 39))
    assert status == 400 and "holds 39" in str(body["error"])


# ---- hostile clients --------------------------------------------------------------------------
def test_truncated_segment_is_an_error_not_a_crash(client: HttpClient, segment: Segment) -> None:
    segment.write(np.ones(64, np.float32).tobytes())
    assert register(client, "t", segment.key, 4096)[0] == 200
    assert infer_from_shm(client, "t", 0, 256, out=("t", 1024, 40))[0] == 200
    segment.truncate(0)
    status, body = infer_from_shm(client, "t", 0, 256)
    assert status == 400 and "truncated" in str(body["error"])
    assert_alive(client)
    # input fine, output slot cut off
    segment.truncate(512)
    segment.write(np.ones(64, np.float32).tobytes())
    status, body = infer_from_shm(client, "t", 0, 256, out=("t", 1024, 40))
    assert status == 400 and "truncated" in str(body["error"])
    assert os.fstat(segment.fd).st_size == 512  # the daemon did not grow it back
    assert_alive(client)


def test_unlinked_segment_stays_usable_until_unregistered(client: HttpClient) -> None:
    seg = Segment(f"/shmtest_{tag()}", 4096)
    seg.write(np.ones(64, np.float32).tobytes())
    assert register(client, "u", seg.key, 4096)[0] == 200
    seg.close()  # the client removes its segment (as a dying client's cleanup would)
    assert infer_from_shm(client, "u", 0, 256)[0] == 200  # the daemon's descriptor keeps the memory
    assert client.request("POST", "/v2/systemsharedmemory/region/u/unregister").status == 200
    assert infer_from_shm(client, "u", 0, 256)[0] == 400


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.one_of(st.integers(0, 5000), st.sampled_from(BIG), st.integers(-(2**70), 2**70)),
       size=st.one_of(st.integers(0, 5000), st.sampled_from(BIG), st.integers(-(2**70), 2**70)),
       output=st.booleans())
def test_random_offsets_and_sizes_are_refused_without_crashing(srv: Served, offset: int, size: int,
                                                               output: bool) -> None:
    seg = Segment(f"/shmtest_{tag()}", 4096)
    try:
        with HttpClient(srv.url, token=TOKEN) as c:
            assert register(c, "p", seg.key, 4096)[0] == 200
            try:
                if output:
                    status, body = infer_from_shm(c, "p", 0, 256, out=("p", offset, size))
                else:
                    status, body = infer_from_shm(c, "p", offset, size)
                in_bounds = offset >= 0 and size >= 0 and offset + size <= 4096
                fits = size == 256 if not output else size >= 40
                if in_bounds and fits:
                    assert status == 200, body
                else:
                    assert status == 400, body
                    assert isinstance(body["error"], str) and seg.key.lstrip("/") not in body["error"]
                assert_alive(c)
            finally:
                c.request("POST", "/v2/systemsharedmemory/unregister")
    finally:
        seg.close()


@settings(max_examples=300, deadline=None)
@given(offset=st.one_of(st.integers(), st.sampled_from(BIG), st.none(), st.text(max_size=3)),
       size=st.one_of(st.integers(), st.sampled_from(BIG), st.none(), st.floats()))
def test_registry_bounds_property(offset: object, size: object) -> None:
    seg = Segment(f"/shmtest_{tag()}", 1024)
    reg = SystemShmRegions(1 * MB, tcp_prefix="shmtest_")
    try:
        reg.register(ME, "r", seg.key, 0, 1024)
        ok = (isinstance(offset, int) and isinstance(size, int) and not isinstance(size, bool)
              and offset >= 0 and size >= 0 and offset + size <= 1024)
        try:
            data = reg.read(ME.scope, "r", offset, size)
            assert ok and len(data) == size
            reg.write(ME.scope, "r", offset, bytes(data))
        except InvalidInputError:
            assert not ok
    finally:
        reg.close()
        seg.close()


def _fds_on(file: tuple[int, int]) -> set[int]:
    """This process's descriptors open on the file with this (st_dev, st_ino)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")  # follows the link to the open file
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == file:
            out.add(int(name))
    return out


def test_registry_unregister_waits_for_users(segment: Segment) -> None:
    reg = SystemShmRegions(MB, tcp_prefix="shmtest_")
    reg.register(ME, "r", segment.key, 0, 4096)
    fd = reg._regions[(ME.scope, "r")].fd
    st = os.fstat(fd)
    region_file = (st.st_dev, st.st_ino)
    with reg._use(ME.scope, "r", 0, 16):
        assert reg.unregister(ME.scope, "r")
        assert fd in _fds_on(region_file)  # still open while in use
    # Closed once the last user is done. Checked by identity: another thread may already have been
    # given the same descriptor number for some other file.
    assert fd not in _fds_on(region_file)
    with pytest.raises(InvalidInputError, match="not registered"):
        reg.read(ME.scope, "r", 0, 16)
    with pytest.raises(EdgedError):
        reg.status(ME.scope, "r")
    assert not reg.unregister(ME.scope, "r")


def test_registry_limits_region_count() -> None:
    segs = [Segment(f"/shmtest_{tag()}", 64) for _ in range(3)]
    reg = SystemShmRegions(MB, max_regions=2, tcp_prefix="shmtest_")
    try:
        reg.register(ME, "a", segs[0].key, 0, 64)
        reg.register(ME, "b", segs[1].key, 0, 64)
        with pytest.raises(EdgedError) as e:
            reg.register(ME, "c", segs[2].key, 0, 64)
        assert e.value.code.value == "resource_exhausted"
        assert len(reg) == 2
    finally:
        reg.close()
        for s in segs:
            s.close()
