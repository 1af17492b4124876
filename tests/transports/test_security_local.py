"""Issue #20 as an attacker on the same device: other users, other processes, hostile local clients.

"Another user" is a real process under another uid (``setpriv`` to nobody, 65534; CI runs as
root). Its code uses the standard library only and runs with the system interpreter in
isolated mode, so it never needs to read this checkout.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged.client.http import HttpClient
from edged.errors import EdgedError, PermissionDeniedError, UnsafePathError
from edged.fsutil import ensure_private_dir
from tests.http_helpers import AUTH, TOKEN, Segment, Served, copy_models, served

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
_PY = os.path.realpath(sys.executable)


def _can_switch_uid() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CI runs as root) to act as another uid"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    return None


needs_other_uid = pytest.mark.skipif(_can_switch_uid() is not None, reason=str(_can_switch_uid()))


def as_other_user(code: str, *args: str, uid: int = NOBODY) -> subprocess.CompletedProcess[str]:
    """Run stdlib-only ``code`` as ``uid`` (its own group, no supplementary groups)."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", _PY, "-I", "-c",
         textwrap.dedent(code), *args], capture_output=True, text=True, timeout=60, check=False)


# A minimal HTTP/1.1 client over a Unix socket: prints "<status> <body>" for each request given as
# METHOD PATH BODY triples on the command line.
UNIX_HTTP = """
    import socket, sys
    path = sys.argv[1]
    args = sys.argv[2:]
    for i in range(0, len(args), 3):
        method, target, body = args[i], args[i + 1], args[i + 2].encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"%s %s HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\nContent-Length: %d\\r\\n\\r\\n"
                  % (method.encode(), target.encode(), len(body)) + body)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\\r\\n\\r\\n")
        print(head.split(b" ")[1].decode(), rest.decode())
"""


def unix_http(sock: Path, *requests: tuple[str, str, str]) -> list[tuple[int, str]]:
    flat = [x for r in requests for x in r]
    out = as_other_user(UNIX_HTTP, str(sock), *flat)
    assert out.returncode == 0, out.stderr
    return [(int(line.split(" ", 1)[0]), line.split(" ", 1)[1]) for line in out.stdout.splitlines()]


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder other users can reach (the attack needs a socket they can connect to)."""
    d = Path(tempfile.mkdtemp(prefix="edged-sec-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def unix_srv(tmp_path: Path, open_dir: Path) -> Iterator[Served]:
    """The HTTP transport on a Unix socket everyone may connect to: only peer credentials protect it."""
    sock = open_dir / "http.sock"
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, listen=f"unix:{sock}", token=None) as s:
        sock.chmod(0o666)
        yield s


# ---- item 6: management authority -----------------------------------------------------------------
def test_default_config_refuses_unload_over_tcp(tmp_path: Path) -> None:
    """Out of the box (no token) a TCP client cannot unload or load anything; inference goes on."""
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, token=None) as s, HttpClient(s.url) as c:
        for action in ("unload", "load"):
            r = c.request("POST", f"/v2/repository/models/digits/{action}", [b"{}"])
            assert r.status == 401 and b"management authority" in r.body
            assert r.header("www-authenticate") is not None
        r = c.request("POST", "/v2/repository/models/digits/unload", [b"{}"], AUTH)  # no token configured
        assert r.status == 403
        assert s.service.is_ready("digits")


def test_model_control_none_refuses_even_the_token_holder(tmp_path: Path) -> None:
    extra = '[control]\nmodel_control = "none"\n'
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, token=None, extra=extra) as s, \
            HttpClient(s.url) as c:
        r = c.request("POST", "/v2/repository/models/digits/unload", [b"{}"], AUTH)
        assert r.status == 403 and b"model_control" in r.body
        assert s.service.is_ready("digits")


@needs_other_uid
def test_unix_socket_peer_credentials_decide(unix_srv: Served) -> None:
    """On a Unix socket the kernel says who is asking: another user is refused, the daemon's own user may."""
    sock = Path(unix_srv.url[5:])
    got = unix_http(sock, ("POST", "/v2/repository/models/digits/unload", "{}"), ("GET", "/v2/health/ready", ""))
    assert got[0][0] == 403 and f"uid {NOBODY} is not trusted" in got[0][1]
    assert got[1][0] == 200  # inference and reads stay open to it
    assert unix_srv.service.is_ready("digits")
    with HttpClient(str(sock)) as c:  # this process runs as the daemon's user
        assert c.request("POST", "/v2/repository/models/digits/unload", [b"{}"]).status == 200
    assert not unix_srv.service.is_ready("digits")


# ---- item 7: system shared memory acts with the caller's rights, not the daemon's ----------------
REGISTER = '{{"key": "{key}", "offset": 0, "byte_size": 64}}'


@needs_other_uid
def test_other_user_cannot_register_a_segment_it_cannot_open(unix_srv: Served) -> None:
    sock = Path(unix_srv.url[5:])
    tag = uuid.uuid4().hex[:8]
    root_seg = Segment(f"/sectest_root_{tag}", 4096)  # root's 0600 segment
    root_seg.write(b"S" * 64)
    own_key = f"/sectest_nobody_{tag}"
    try:
        # root registers its own region through the same socket: the other user must not see or drop it
        with HttpClient(str(sock)) as c:
            r = c.request("POST", "/v2/systemsharedmemory/region/mine/register",
                          [REGISTER.format(key=root_seg.key).encode()])
            assert r.status == 200, r.body
        made = as_other_user(f"""
            import os
            fd = os.open("/dev/shm/{own_key[1:]}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 4096)
        """)
        assert made.returncode == 0, made.stderr
        got = unix_http(
            sock,
            ("POST", "/v2/systemsharedmemory/region/steal/register", REGISTER.format(key=root_seg.key)),
            ("POST", "/v2/systemsharedmemory/region/own/register", REGISTER.format(key=own_key)),
            ("GET", "/v2/systemsharedmemory/status", ""),
            ("GET", "/v2/systemsharedmemory/region/mine/status", ""),
            ("POST", "/v2/systemsharedmemory/region/mine/unregister", ""),
            ("POST", "/v2/systemsharedmemory/unregister", ""),
        )
        assert got[0][0] == 403 and "may not read that segment" in got[0][1] and "sectest" not in got[0][1]
        assert got[1][0] == 200, got[1]
        assert [x["name"] for x in orjson.loads(got[2][1])] == ["own"]  # only its own
        assert got[3][0] == 404
        with HttpClient(str(sock)) as c:
            status = orjson.loads(c.request("GET", "/v2/systemsharedmemory/status").body)
            assert [x["name"] for x in status] == ["mine"]  # survived the other user's unregister calls
            c.request("POST", "/v2/systemsharedmemory/unregister")
        assert root_seg.read(64) == b"S" * 64
    finally:
        root_seg.close()
        Path("/dev/shm", own_key[1:]).unlink(missing_ok=True)


def test_tcp_registration_is_off_by_default_and_bounded_by_prefix_and_owner(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    plain = Segment(f"/sectest_{tag}", 4096)
    prefixed = Segment(f"/sectest-shm_{tag}", 4096)
    try:
        with served(copy_models(tmp_path / "models", "digits"), tmp_path / "off") as s, \
                HttpClient(s.url, token=TOKEN) as c:
            r = c.request("POST", "/v2/systemsharedmemory/region/a/register", [REGISTER.format(key=plain.key).encode()])
            assert r.status == 403 and b"off" in r.body
        extra = '[shm]\nsystem_shm_prefix = "sectest-shm_"\n'
        with served(copy_models(tmp_path / "models2", "digits"), tmp_path / "on", extra=extra) as s:
            with HttpClient(s.url) as anon:  # no credential: nothing to register, nothing to see
                r = anon.request("POST", "/v2/systemsharedmemory/region/a/register",
                                 [REGISTER.format(key=prefixed.key).encode()])
                assert r.status == 401
                assert anon.request("GET", "/v2/systemsharedmemory/status").status == 401
            with HttpClient(s.url, token=TOKEN) as c:
                r = c.request("POST", "/v2/systemsharedmemory/region/a/register",
                              [REGISTER.format(key=plain.key).encode()])
                assert r.status == 403 and b"system_shm_prefix" in r.body
                if os.geteuid() == 0:  # another user's 0600 segment, even with the prefix: a root daemon refuses
                    os.fchown(prefixed.fd, NOBODY, NOBODY)
                    r = c.request("POST", "/v2/systemsharedmemory/region/a/register",
                                  [REGISTER.format(key=prefixed.key).encode()])
                    assert r.status == 403 and b"owned by the daemon" in r.body
                    os.fchown(prefixed.fd, 0, 0)
                r = c.request("POST", "/v2/systemsharedmemory/region/a/register",
                              [REGISTER.format(key=prefixed.key).encode()])
                assert r.status == 200, r.body
                c.request("POST", "/v2/systemsharedmemory/unregister")
    finally:
        plain.close()
        prefixed.close()


# ---- items 8 and 10: HTTP connections -------------------------------------------------------------
INFER = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [1.0] * 64}]})
INFER_REQ = b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(INFER), INFER)


def _tcp(url: str, source: str | None = None, timeout: float = 30) -> socket.socket:
    host, port = url.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    if source:
        s.bind((source, 0))
    s.connect((host, int(port)))
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:  # the server closed while we were still sending (a refused hog)
        pass
    return data


def _statuses(data: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def test_half_closed_connections_get_their_answers(tmp_path: Path) -> None:
    """The client sends its request(s), shuts down its sending side, and still reads every answer."""
    with served(copy_models(tmp_path / "models", "digits"), tmp_path) as s:
        socks = [_tcp(s.url) for _ in range(20)]
        for i, sk in enumerate(socks):
            sk.sendall(INFER_REQ * (1 + i % 2) + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            sk.shutdown(socket.SHUT_WR)
        for i, sk in enumerate(socks):
            data = _read_all(sk)  # ends: the server closes after the last answer
            sk.close()
            assert _statuses(data) == [200] * (2 + i % 2), data[:300]
            assert data.count(b'"shape":[1,10]') == 1 + i % 2
        # cut off mid-request, then half-closed: closed without an answer, the server goes on
        with _tcp(s.url) as sk:
            sk.sendall(INFER_REQ[:60])
            sk.shutdown(socket.SHUT_WR)
            assert _read_all(sk) == b""
        with HttpClient(s.url) as c:
            assert c.ready()


@pytest.mark.parametrize("hog_address", ["127.0.0.1", "127.0.0.2"], ids=["same-address", "other-address"])
def test_one_client_cannot_take_every_connection(tmp_path: Path, hog_address: str) -> None:
    """1,000 idle and partial connections from one address; another client is served throughout, also
    from the same address (on the default loopback listener every local TCP client is 127.0.0.1)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with served(copy_models(tmp_path / "models", "digits"), tmp_path) as s:
        limit = s.cfg.http.max_client_connections
        hog: list[socket.socket] = []
        try:
            for i in range(1000):
                sk = _tcp(s.url, source=hog_address)
                if i % 2:
                    sk.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n")  # never finished
                hog.append(sk)
                if i % 100 == 99:  # the other client, while the hog keeps connecting
                    with HttpClient(s.url) as c:
                        assert c.infer("digits", {"pixels": np.ones((1, 64), np.float32)})["probabilities"].shape \
                            == (1, 10)
            # the hog holds at most its share: each new connection took the place of its longest-idle one,
            # which was told why and closed
            assert s.transport.open_connections <= limit + 1
            data = _read_all(hog[0])  # idle from the start: nothing sent, so the refusal is read in full
            assert _statuses(data) == [503] and b"too many connections from this client" in data
            assert _read_all(hog[1]) != b""  # a partial request was answered before the close, not dropped
            with HttpClient(s.url) as c:
                assert c.ready()
        finally:
            for sk in hog:
                sk.close()


def test_slow_headers_are_cut_off_and_a_full_server_makes_room(tmp_path: Path) -> None:
    extra = "max_connections = 40\nmax_client_connections = 16\nheader_timeout_s = 0.5\n"
    with served(copy_models(tmp_path / "models", "digits"), tmp_path, extra=extra) as s:
        hog = [_tcp(s.url, source=f"127.0.0.{2 + i // 16}") for i in range(48)]  # 3 addresses x 16 > 40
        try:
            # a newcomer is not refused: an idle connection of the biggest holder makes room
            with HttpClient(s.url) as c:
                assert c.ready()
            # slowloris: headers that never end are answered 408 and closed (the sweep runs twice a second)
            with _tcp(s.url, source="127.0.0.9") as slow:
                slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
                data = _read_all(slow)
                assert _statuses(data) == [408] and b"headers not received in time" in data
            # connections that never sent a request are closed after the same deadline (or were made room
            # from, or refused when their client already held the most)
            ends = [_read_all(sk) for sk in hog]
            assert all(e == b"" or _statuses(e) == [503] for e in ends)
            assert any(e == b"" for e in ends)
        finally:
            for sk in hog:
                sk.close()


@needs_other_uid
def test_unix_socket_connection_limit_is_per_uid(unix_srv: Served) -> None:
    sock = Path(unix_srv.url[5:])
    limit = unix_srv.cfg.http.max_client_connections
    mine = []
    try:
        for _ in range(limit + 5):
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sk.settimeout(30)
            sk.connect(str(sock))
            mine.append(sk)
        # the first ones, idle longest, gave way to the newer ones (all idle): told why, then closed
        for refused in mine[:5]:
            assert _statuses(_read_all(refused)) == [503]
        # another uid is still served
        assert unix_http(sock, ("GET", "/v2/health/live", ""))[0][0] == 200
    finally:
        for sk in mine:
            sk.close()


# ---- item 1: the shared-memory socket cannot be hijacked ------------------------------------------
def _shm_transport(tmp_path: Path, runtime_dir: Path) -> Any:
    from edged.config import parse_config
    from edged.core.manager import ModelManager
    from edged.core.service import InferenceService
    from edged.transports.shm.transport import ShmTransport
    from tests.http_helpers import ORT

    cfg = parse_config(f'[device]\nstate_dir = "{tmp_path / "state"}"\nruntime_dir = "{runtime_dir}"\n'
                       f'model_repository = "{copy_models(tmp_path / "models", "digits")}"\n')
    return ShmTransport(cfg, InferenceService(ModelManager(cfg.device.model_repository, cfg.models, ORT)))


@needs_other_uid
def test_runtime_dir_pre_created_by_another_user_is_refused(tmp_path: Path) -> None:
    """The attack: another user makes /tmp/edged-<uid> first, then waits to swap the socket inside."""
    planted = Path(f"/tmp/edged-sectest-{uuid.uuid4().hex[:8]}")
    made = as_other_user(f"import os; os.mkdir({str(planted)!r}); os.chmod({str(planted)!r}, 0o777)")
    assert made.returncode == 0, made.stderr
    try:
        shm = _shm_transport(tmp_path, planted / "edged")
        with pytest.raises(UnsafePathError, match=f"owned by uid {NOBODY}"):
            shm.start_blocking()
        assert os.listdir(planted) == []  # nothing was made inside it
    finally:
        shutil.rmtree(planted, ignore_errors=True)


def test_runtime_dir_checks(tmp_path: Path) -> None:
    base = tmp_path / "run"
    base.mkdir(mode=0o777)
    base.chmod(0o777)  # ours, but anyone may write into it
    with pytest.raises(UnsafePathError, match="writable by others"):
        ensure_private_dir(base / "edged", "test")
    assert not (base / "edged").exists()
    base.chmod(0o755)
    ensure_private_dir(base / "a" / "b", "test")  # what is missing is made 0700
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (base / "a", base / "a" / "b")] == [0o700, 0o700]
    (base / "link").symlink_to(base / "a")
    ensure_private_dir(base / "link", "test")  # a link of this user's own to a good folder is fine
    (base / "file").write_text("x")
    with pytest.raises(UnsafePathError, match="not a directory"):
        ensure_private_dir(base / "file", "test")
    shm = _shm_transport(tmp_path, base / "edged")
    shm.start_blocking()
    try:
        assert stat.S_IMODE(os.stat(base / "edged").st_mode) == 0o700
        assert stat.S_ISSOCK(os.lstat(base / "edged" / "edged.sock").st_mode)
    finally:
        shm.stop_blocking()


FAKE_SHM_SERVER = """
    import array, socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(sys.argv[1])
    s.listen(1)
    print("ready", flush=True)
    s.settimeout(30)
    got = fds = 0
    for _ in range(2):  # the sync client, then the asyncio one
        c, _ = s.accept()
        c.settimeout(30)
        while True:
            data, anc, _, _ = c.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
            got += len(data)
            fds += sum(len(a[2]) // 4 for a in anc if a[1] == socket.SCM_RIGHTS)
            if not data:
                break
        c.close()
    print(got, fds, flush=True)
"""


@needs_other_uid
def test_client_refuses_a_socket_served_by_another_user(open_dir: Path) -> None:
    """The attack: another user serves the socket path; the client must send it nothing, memfds least of all."""
    import asyncio

    from edged.client.shm import AsyncShmClient, ShmClient

    os.chown(open_dir, NOBODY, NOBODY)  # a folder the impostor controls (as in the /tmp/edged-<uid> attack)
    path = open_dir / "edged.sock"
    proc = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", _PY, "-I", "-c",
                             textwrap.dedent(FAKE_SHM_SERVER), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.raises(PermissionDeniedError, match=f"served by uid {NOBODY}"):
            ShmClient(path)

        async def use_async() -> None:
            await AsyncShmClient(path).connect()

        with pytest.raises(PermissionDeniedError, match="nothing was sent"):
            asyncio.run(use_async())
        out, _ = proc.communicate(timeout=30)
        assert out.split() == ["0", "0"]  # no byte, no descriptor reached the impostor
    finally:
        proc.kill()
        proc.wait()


def test_expected_server_uid_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.client.shm import SERVER_UID_ENV, expected_server_uids

    monkeypatch.delenv(SERVER_UID_ENV, raising=False)
    assert {0, os.geteuid()} <= expected_server_uids()
    assert NOBODY not in expected_server_uids()
    assert expected_server_uids(1234) == {1234}
    monkeypatch.setenv(SERVER_UID_ENV, str(NOBODY))
    assert expected_server_uids() == {NOBODY}
    monkeypatch.setenv(SERVER_UID_ENV, "nobody")
    with pytest.raises(EdgedError, match="numeric uid"):
        expected_server_uids()


@needs_other_uid
def test_readable_but_not_writable_segment_cannot_take_outputs(unix_srv: Served) -> None:
    """Another user may use root's world-readable segment as input, never as a place the daemon writes."""
    sock = Path(unix_srv.url[5:])
    seg = Segment(f"/sectest_ro_{uuid.uuid4().hex[:8]}", 4096)
    os.fchmod(seg.fd, 0o644)
    seg.write(np.ones(64, np.float32).tobytes())
    slot = '{{"shared_memory_region":"ro","shared_memory_offset":{},"shared_memory_byte_size":{}}}'
    infer = ('{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"parameters":' + slot.format(0, 256)
             + "}]%s}")
    try:
        got = unix_http(
            sock,
            ("POST", "/v2/systemsharedmemory/region/ro/register", REGISTER.format(key=seg.key).replace("64}", "4096}")),
            ("POST", "/v2/models/digits/infer", infer % ""),
            ("POST", "/v2/models/digits/infer",
             infer % (',"outputs":[{"name":"probabilities","parameters":' + slot.format(1024, 40) + "}]")),
        )
        assert got[0][0] == 200, got[0]
        assert got[1][0] == 200, got[1]  # reading it is what it could do itself
        assert got[2][0] == 400 and "may not write" in got[2][1]
        assert seg.read(40, 1024) == bytes(40)  # untouched
    finally:
        seg.close()


def test_authority_rules() -> None:
    from edged.config import ControlSection
    from edged.transports.authority import LOAD, Authority, Peer, bearer

    assert bearer(b"Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer(b"Basic abc") is None and bearer(None) is None and bearer(b"Bearer ") is None
    auth = Authority(ControlSection(token="t" * 16, unix_uids=[1000]), daemon_uid=999)
    assert auth.require(Peer(address="127.0.0.1", credential="t" * 16), LOAD) == "token"
    assert auth.require(Peer(uid=1000, gid=1000, pid=1), LOAD) == "uid:1000"
    assert auth.require(Peer(uid=999, gid=999, pid=1), LOAD) == "uid:999"
    with pytest.raises(PermissionDeniedError):
        auth.require(Peer(uid=1001, gid=1001, pid=1), LOAD)
    with pytest.raises(PermissionDeniedError):
        auth.require(Peer(address="127.0.0.1", credential="t" * 15 + "u"), LOAD)
    with pytest.raises(EdgedError) as e:
        auth.require(Peer(address="127.0.0.1"), LOAD)
    assert e.value.code.value == "unauthenticated"
    # regions are scoped by uid on a Unix socket, to the token holder over TCP, to nobody without either
    assert auth.known_scope(Peer(uid=1001, gid=1, pid=1)) == "uid:1001"
    assert auth.known_scope(Peer(address="::1")) is None
    with pytest.raises(ValueError):
        ControlSection(token="short")


@needs_other_uid
def test_daemon_refuses_to_start_in_a_planted_runtime_dir(tmp_path: Path) -> None:
    """Whatever transports are on, `edged run` stops before writing anything under a planted folder."""
    from tests.conftest import EDGED

    planted = Path(f"/tmp/edged-sectest-{uuid.uuid4().hex[:8]}")
    made = as_other_user(f"import os; os.mkdir({str(planted)!r}); os.chmod({str(planted)!r}, 0o777)")
    assert made.returncode == 0, made.stderr
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[device]\nstate_dir = "{tmp_path / "state"}"\nruntime_dir = "{planted / "edged"}"\n'
                   f'model_repository = "{copy_models(tmp_path / "models", "digits")}"\n'
                   "[http]\nenabled = false\n[mqtt]\nenabled = false\n[shm]\nenabled = false\n")
    try:
        r = subprocess.run([*EDGED, "run", "--config", str(cfg)], capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode != 0
        assert f"owned by uid {NOBODY}" in r.stderr and "[device] runtime_dir" in r.stderr, r.stderr[-2000:]
        assert os.listdir(planted) == []
    finally:
        shutil.rmtree(planted, ignore_errors=True)
