"""The device's update path against a real registry server process.

Each test gets its own model name and device id on one shared registry (releases are
signed for that device only), a real ModelManager/InferenceService, and the real agent.
"""

from __future__ import annotations

import http.server
import itertools
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.protocol.fleet.release import TargetSelector
from tests.registry_helpers import (
    DaemonProcess,
    InProcessDevice,
    Keys,
    RegistryServer,
    device_toml,
    free_port,
    make_version,
    wait_for,
)

_ids = itertools.count(1)


@dataclass
class World:
    tmp: Path
    keys: Keys
    attacker: Keys
    server: RegistryServer
    client: Any


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("sync")
    keys, attacker = Keys.make(tmp), Keys.make(tmp, "attacker")
    # The registry trusts both keys, devices only the operator's: lets a test get a release signed by
    # a key the device does not trust all the way to the device.
    server = RegistryServer(tmp, [keys.public, attacker.public]).start()
    client = server.client()
    yield World(tmp, keys, attacker, server, client)
    client.close()
    server.stop()


@dataclass
class Case:
    model: str
    device_id: str
    tmp: Path
    world: World

    def push(self, version: int, **kw: Any) -> Path:
        folder = make_version(self.tmp / "pub" / self.model / str(version), salt=f"{self.model}-{version}", **kw)
        self.world.client.push_folder(folder, self.model, version)
        return folder

    def release(self, version: int, *, key: Keys | None = None, expires_in_s: float = 3600) -> int:
        info = self.world.client.release((key or self.world.keys).load(), self.model, version,
                                         expires_in_s=expires_in_s, selector=TargetSelector(devices=[self.device_id]))
        return int(info.release)

    def device(self, token: str | None = None, **overrides: Any) -> InProcessDevice:
        token = token or self.world.client.enrollment_token().token
        cfg = device_toml(self.tmp, self.tmp / "repo", self.world.server.url, [self.world.keys.public], token=token,
                          device_id=self.device_id, poll_s=0.1)
        (self.tmp / "repo").mkdir(exist_ok=True)
        overrides.setdefault("trial_s", 0.5)
        return InProcessDevice(cfg, **overrides).start()

    def events(self) -> list[Any]:
        return list(self.world.client.device(self.device_id, events=200).events)

    def event(self, step: str, release: int) -> Any:
        def find() -> Any:
            return next((e for e in self.events() if e.step == step and e.release == release), None)

        return wait_for(find, 30, 0.1, f"a {step!r} report for release {release}")


@pytest.fixture
def case(world: World, tmp_path: Path) -> Case:
    n = next(_ids)
    return Case(model=f"digits{n}", device_id=f"dev-{n}", tmp=tmp_path, world=world)


def committed(dev: InProcessDevice, model: str, release: int) -> bool:
    ms = dev.state().models.get(model)
    return bool(ms and ms.pending is None and ms.current and ms.current.release == release)


def at_v1(case: Case, **overrides: Any) -> InProcessDevice:
    case.push(1)
    r1 = case.release(1)
    dev = case.device(**overrides)
    wait_for(lambda: committed(dev, case.model, r1), 30, 0.05, "release 1 committed")
    assert dev.serving(case.model) == [1]
    return dev


def only_v1_serving(case: Case, dev: InProcessDevice, x: np.ndarray) -> None:
    assert dev.serving(case.model) == [1]
    assert sorted(p.name for p in (case.tmp / "repo" / case.model).iterdir()) == ["1"]
    assert dev.infer(x, case.model).version == 1


def pixels(n: int = 1) -> np.ndarray:
    return np.random.default_rng(0).random((n, 64), dtype=np.float32) * 16


# ---- the update itself ---------------------------------------------------------------------------
def test_update_commits_and_reports_every_step(case: Case) -> None:
    dev = at_v1(case)
    try:
        case.push(2)
        r2 = case.release(2)
        wait_for(lambda: committed(dev, case.model, r2), 30, 0.05, "release 2 committed")
        assert dev.serving(case.model) == [2]
        assert dev.infer(pixels(), case.model).version == 2
        ms = dev.state().models[case.model]
        assert (ms.current.version, ms.lkg.version, ms.highest_release) == (2, 1, r2)
        # the previous version stays on disk as last-known-good; nothing else does
        assert sorted(p.name for p in (case.tmp / "repo" / case.model).iterdir()) == ["1", "2"]
        case.event("committed", r2)  # reports are sent by their own thread
        steps = [e.step for e in case.events() if e.release == r2]
        assert steps == ["downloading", "verifying", "prepared", "active-trial", "committed"]
        info = case.world.client.device(case.device_id)
        assert [(m.model, m.state, m.version) for m in info.models] == [(case.model, "committed", 2)]
    finally:
        dev.stop()


def test_a_release_with_an_empty_file_installs(case: Case) -> None:
    """A 0-byte file (an empty README, __init__.py or labels file) is made and verified like any other file,
    not taken for a local storage fault that blocks the update for ever."""
    dev = at_v1(case)
    try:
        folder = make_version(case.tmp / "pub" / case.model / "2", salt=f"{case.model}-2")
        (folder / "EMPTY").write_bytes(b"")
        case.world.client.push_folder(folder, case.model, 2)
        r2 = case.release(2)
        wait_for(lambda: committed(dev, case.model, r2), 30, 0.05, "release 2 (with an empty file) committed")
        assert (case.tmp / "repo" / case.model / "2" / "EMPTY").read_bytes() == b""
        case.event("committed", r2)
        assert not [e.reason for e in case.events() if e.release == r2 and e.step == "failed"]
    finally:
        dev.stop()


def test_zero_failed_requests_during_update_under_load(case: Case) -> None:
    dev = at_v1(case, trial_s=1.0)
    stop = threading.Event()
    results: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def hammer(seed: int) -> None:
        from edged.protocol.types import InferRequest

        x = np.random.default_rng(seed).random((1, 64), dtype=np.float32) * 16
        while not stop.is_set():
            out: tuple[int, str | None]
            try:
                v = dev.service.infer(InferRequest(model=case.model, inputs={"pixels": x}), timeout=30).version
                out = (v, None)
            except Exception as e:
                out = (0, f"{type(e).__name__}: {e}")
            with lock:
                results.append(out)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(results) > 200, 30, 0.05, "traffic on version 1")
        case.push(2)
        r2 = case.release(2)
        wait_for(lambda: committed(dev, case.model, r2), 60, 0.05, "release 2 committed under load")
        n = len(results)
        wait_for(lambda: len(results) > n + 200, 30, 0.05, "traffic on version 2")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        dev.stop()
    failures = [err for _, err in results if err]
    assert failures == [], f"{len(failures)} of {len(results)} requests failed, first: {failures[:3]}"
    by_version = {v: sum(1 for r, _ in results if r == v) for v in (1, 2)}
    assert by_version[1] > 0 and by_version[2] > 0, by_version
    # the trial saw the live traffic and found it healthy
    assert case.event("committed", r2).detail["requests"] > 0


# ---- tampering: each refused before activation; the old version keeps serving --------------------------
def _blob_path(case: Case, version: int, rel: str) -> Path:
    info = case.world.client.version(case.model, version)
    sha: str = next(f.sha256 for f in info.files if f.path == rel)
    return Path(case.world.server.data_dir / "blobs" / "sha256" / sha[:2] / sha)


def _refused(case: Case, dev: InProcessDevice, release: int, expect: str) -> None:
    ev = case.event("failed", release)
    assert expect in (ev.reason or ""), ev.reason
    time.sleep(0.3)  # sleep-ok: a few more polls: still nothing activated
    only_v1_serving(case, dev, pixels())
    ms = dev.state().models[case.model]
    assert ms.current.release == 1 and (ms.pending is None or ms.pending.step == "download")
    assert not any(e.step in ("prepared", "active-trial", "committed") for e in case.events() if e.release == release)


def test_flipped_byte_is_refused(case: Case) -> None:
    dev = at_v1(case)
    try:
        case.push(2)
        blob = _blob_path(case, 2, "labels.txt")  # salted: no other version shares it
        blob.chmod(0o644)
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x01
        blob.write_bytes(bytes(data))
        _refused(case, dev, case.release(2), "sha256")
    finally:
        dev.stop()


def test_wrong_length_is_refused(case: Case) -> None:
    dev = at_v1(case)
    try:
        case.push(2)
        blob = _blob_path(case, 2, "labels.txt")  # salted: no other version shares it
        blob.chmod(0o644)
        with blob.open("ab") as f:
            f.write(b"\0" * 100)
        _refused(case, dev, case.release(2), "the release says")
    finally:
        dev.stop()


def test_untrusted_signature_is_refused(case: Case) -> None:
    dev = at_v1(case)
    try:
        case.push(2)
        _refused(case, dev, case.release(2, key=case.world.attacker), "does not verify with any trusted")
    finally:
        dev.stop()


def test_expired_release_is_refused(case: Case) -> None:
    dev = at_v1(case)
    dev.stop()  # the device is off while the short-lived release comes and expires
    case.push(2)
    r2 = case.release(2, expires_in_s=1)
    time.sleep(1.5)  # sleep-ok: the release expires
    dev = case.device()
    try:
        _refused(case, dev, r2, "expired")
    finally:
        dev.stop()


def test_oversized_release_is_refused_before_download(case: Case) -> None:
    dev = at_v1(case, max_download_mb=1.0)
    try:
        case.push(2, pad_mb=1.5)
        r2 = case.release(2)
        _refused(case, dev, r2, "download limit")
        assert not any(e.step == "downloading" for e in case.events() if e.release == r2)
    finally:
        dev.stop()


def test_lower_release_number_is_refused(case: Case) -> None:
    """Revoking the newest release makes the registry offer an older one: a rollback attack, refused."""
    dev = at_v1(case)
    try:
        case.push(2)
        r2 = case.release(2)
        wait_for(lambda: committed(dev, case.model, r2), 30, 0.05, "release 2 committed")
        case.world.client.revoke(case.model, r2)
        ev = case.event("failed", 1)
        assert "lower than release" in (ev.reason or "")
        time.sleep(0.3)  # sleep-ok: a few more polls: the older release is never taken
        assert dev.serving(case.model) == [2]
        assert dev.state().models[case.model].current.release == r2
    finally:
        dev.stop()


def test_a_release_reusing_a_local_version_number_with_other_files_is_refused(case: Case) -> None:
    """The device serves version 1 from a local copy; the fleet releases another version 1. Installing it would
    replace the serving folder in place, and a rollback would then "return" to the rejected files."""
    from edged.fsutil import sha256_file
    from edged.sync.state import VersionRef

    local = make_version(case.tmp / "repo" / case.model / "1", salt="the local copy")
    before = {p.name: sha256_file(p) for p in local.iterdir()}
    case.push(1)  # the registry's version 1: other files
    r1 = case.release(1)
    dev = case.device()
    try:
        ev = case.event("failed", r1)
        assert "served from a local copy" in (ev.reason or "") and "new version number" in (ev.reason or ""), ev
        ms = dev.state().models[case.model]
        assert ms.pending is None and ms.current == VersionRef(version=1, release=0) and r1 in ms.rejected
        cycles = dev.agent.cycles
        wait_for(lambda: dev.agent.cycles >= cycles + 3, 30, 0.05, "three more polls")
        assert [e.step for e in case.events() if e.release == r1] == ["failed"]  # refused for good
        assert {p.name: sha256_file(p) for p in local.iterdir()} == before
        assert sorted(p.name for p in (case.tmp / "repo" / case.model).iterdir()) == ["1"]
        assert dev.serving(case.model) == [1]
    finally:
        dev.stop()


def test_a_release_of_the_same_files_as_a_local_version_is_adopted(case: Case) -> None:
    """The same version number with the very same files: nothing to install, that version is already serving."""
    shutil.copytree(case.push(1), case.tmp / "repo" / case.model / "1")
    r1 = case.release(1)
    dev = case.device()
    try:
        wait_for(lambda: committed(dev, case.model, r1), 30, 0.05, "release 1 adopted")
        assert case.event("committed", r1).detail.get("note") == "this version was already serving"
        assert dev.serving(case.model) == [1]
    finally:
        dev.stop()


class _HostileRegistry(http.server.BaseHTTPRequestHandler):
    """Answers every request with an endless stream: the device must stop reading, not buffer it."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        chunk = b" " * 65536
        try:
            for _ in range(1000):  # 64 MB, far over any limit
                self.wfile.write(chunk)
        except OSError:
            pass

    def do_POST(self) -> None:
        self.do_GET()

    def log_message(self, *args: Any) -> None:
        pass


def test_oversized_response_is_refused(tmp_path: Path, world: World) -> None:
    from edged.sync.capped_http import RegistryHttp, TransferError

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileRegistry)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        http_ = RegistryHttp(url, timeout=10)
        with pytest.raises(TransferError, match="limit"):
            http_.request("GET", "/api/v1/device/desired-state", token="x")
        part = tmp_path / "part"
        with pytest.raises(TransferError, match="longer than"):
            http_.download("/api/v1/blobs/x", token="x", dest=part, size=1000, etag='"x"', chunk=4096,
                           should_stop=lambda: False)
        # and the agent survives it: keeps serving, keeps retrying
        (tmp_path / "repo").mkdir()
        shutil.copytree(Path(__file__).parents[2] / "models" / "digits", tmp_path / "repo" / "digits")
        cfg = device_toml(tmp_path, tmp_path / "repo", url, [world.keys.public], token="edge_x", poll_s=0.1)
        dev = InProcessDevice(cfg).start()
        try:
            wait_for(lambda: dev.agent.cycles >= 2, 30, 0.05, "two failed sync cycles")
            assert dev.serving() == [1]
            assert dev.infer(pixels()).version == 1
        finally:
            dev.stop()
    finally:
        srv.shutdown()


def test_an_empty_file_is_made_and_verified_without_a_request(tmp_path: Path) -> None:
    from edged.protocol.fleet.release import FileEntry, ReleaseManifest
    from edged.sync.capped_http import RegistryHttp, TransferError
    from edged.sync.download import fetch_release

    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes

    def manifest(sha: str) -> ReleaseManifest:
        return ReleaseManifest(model="m", version=1, release=1, issued_at=0, expires_at=1,
                               files=[FileEntry(path="model.toml", sha256=sha, size=0)])

    http_ = RegistryHttp("http://127.0.0.1:9", timeout=1)  # nothing listens: no request may be needed
    stats = fetch_release(http_, "x", manifest(empty), tmp_path / "a", chunk=4096, should_stop=lambda: False)
    assert (tmp_path / "a" / "model.toml").read_bytes() == b"" and (stats.files, stats.bytes) == (1, 0)
    with pytest.raises(TransferError, match="sha256"):  # a size of 0 with another digest: refused as ever
        fetch_release(http_, "x", manifest("0" * 64), tmp_path / "b", chunk=4096, should_stop=lambda: False)


# ---- automatic rollback ----------------------------------------------------------------------------
def test_golden_check_failure_rolls_back(case: Case) -> None:
    dev = at_v1(case)
    try:
        case.push(2, golden_fail=True)
        r2 = case.release(2)
        ev = case.event("rolled-back", r2)
        assert "golden check failed" in (ev.reason or ""), ev.reason
        only_v1_serving(case, dev, pixels())
        ms = dev.state().models[case.model]
        assert r2 in ms.rejected and ms.pending is None
        info = case.world.client.device(case.device_id)
        assert info.models[0].state == "rolled-back" and "golden check" in (info.models[0].reason or "")
        time.sleep(0.3)  # sleep-ok: a few more polls: never retried
        assert sum(1 for e in case.events() if e.step == "rolled-back") == 1
    finally:
        dev.stop()


def test_errors_under_live_traffic_roll_back(case: Case) -> None:
    dev = at_v1(case, trial_s=4.0, trial_min_requests=10)  # errors fail it long before 4 s
    stop = threading.Event()

    def traffic() -> None:
        from edged.protocol.types import InferRequest

        x = pixels(2)  # batch 2: the broken version only takes batch 1
        while not stop.is_set():
            try:
                dev.service.infer(InferRequest(model=case.model, inputs={"pixels": x}), timeout=30)
            except Exception:
                pass
            time.sleep(0.005)  # sleep-ok: paces the traffic

    t = threading.Thread(target=traffic)
    t.start()
    try:
        case.push(2, fixed_batch=True)
        r2 = case.release(2)
        ev = case.event("rolled-back", r2)
        assert "trial failed: error rate" in (ev.reason or ""), ev.reason
        assert case.event("active-trial", r2) is not None  # it did go live first
        only_v1_serving(case, dev, pixels(2))
    finally:
        stop.set()
        t.join(10)
        dev.stop()


def test_local_unload_during_trial_needs_authority_and_is_never_a_failed_release(case: Case) -> None:
    """The attack: an unauthenticated local unload during a trial used to reject a healthy release for good."""
    import asyncio

    from edged.client.http import HttpClient
    from edged.transports.http.transport import HttpTransport
    from tests.http_helpers import AUTH

    dev = at_v1(case, trial_s=2.0)
    cfg = dev.cfg.model_copy(deep=True)
    cfg.http.listen = "127.0.0.1:0"
    cfg.control.token = AUTH["Authorization"].split()[1]
    http = HttpTransport(cfg, dev.service)
    asyncio.run_coroutine_threadsafe(http.start(), dev.loop).result(10)
    unload = f"/v2/repository/models/{case.model}/unload"
    try:
        case.push(2)
        r2 = case.release(2)
        case.event("active-trial", r2)
        with HttpClient(http.address) as c:
            r = c.request("POST", unload, [b"{}"])
            assert r.status == 401 and dev.serving(case.model) == [2]
            assert c.request("POST", unload, [b"{}"], {"Authorization": "Bearer not-the-token-at-all"}).status == 403
            assert dev.serving(case.model) == [2]
            # with the authority the operator may unload; the trial pauses instead of failing
            assert c.request("POST", unload, [b"{}"], AUTH).status == 200
            assert dev.serving(case.model) == []
            time.sleep(2.5)  # sleep-ok: longer than the whole trial, which must pause, not fail
            ms = dev.state().models[case.model]
            assert ms.pending is not None and ms.pending.step == "trial" and r2 not in ms.rejected
            assert c.request("POST", f"/v2/repository/models/{case.model}/load", [b"{}"], AUTH).status == 200
        wait_for(lambda: committed(dev, case.model, r2), 30, 0.05, "release 2 committed after the reload")
        case.event("committed", r2)
        assert not [e for e in case.events() if e.release == r2 and e.step == "rolled-back"]
        assert dev.serving(case.model) == [2]
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), dev.loop).result(30)
        dev.stop()


# ---- evaluation set and trials without traffic ----------------------------------------------------
def test_trial_without_traffic_says_what_it_committed_on(case: Case) -> None:
    """No traffic: without an evaluation set the trial waits trial_extend_s more, then commits unjudged; with one
    it commits on the set alone, scoring the version it replaced on the same samples."""
    dev = at_v1(case, trial_s=0.3, trial_extend_s=1.0)
    try:
        case.push(2)
        r2 = case.release(2)
        done = case.event("committed", r2)
        began = case.event("active-trial", r2)
        assert done.detail["judged"] == "unjudged" and "no evaluation set" in done.detail["note"], done.detail
        assert done.at - began.at >= 1.2  # 0.3 s of trial, then up to 1 s more waiting for traffic
        case.push(3, evaluation=True)
        r3 = case.release(3)
        done = case.event("committed", r3)
        began = case.event("active-trial", r3)
        q = began.detail["quality"]
        assert q["samples"] == 300 and q["score"] > 0.9 and q["baseline_version"] == 2
        assert abs(q["baseline_score"] - q["score"]) < 0.02
        assert done.detail["judged"] == "evaluation-set" and done.at - began.at < 1.2
    finally:
        dev.stop()


def on_trial(dev: InProcessDevice, model: str, release: int) -> bool:
    ms = dev.state().models.get(model)
    return bool(ms and ms.pending and ms.pending.step == "trial" and ms.pending.release == release)


def test_a_trial_does_not_hold_other_models_updates(case: Case) -> None:
    """A trial is a state the sync loop comes back to, not a wait on its thread: model A stays on trial (no
    traffic and no evaluation set, so it waits up to trial_extend_s for requests) while model B downloads,
    activates, passes its own trial on its evaluation set and commits."""
    b = Case(model=f"{case.model}b", device_id=case.device_id, tmp=case.tmp, world=case.world)
    case.push(1)
    ra = case.release(1)
    dev = case.device(trial_s=0.3, trial_extend_s=600)
    try:
        wait_for(lambda: on_trial(dev, case.model, ra), 30, 0.05, "model A on trial")
        b.push(1, evaluation=True)
        rb = b.release(1)
        wait_for(lambda: committed(dev, b.model, rb), 30, 0.05, "model B committed while A is on trial")
        assert on_trial(dev, case.model, ra)
        assert dev.serving(b.model) == [1] and dev.serving(case.model) == [1]
        assert dev.infer(pixels(), b.model).version == 1
    finally:
        dev.stop()


def test_trial_resumed_after_a_restart_scores_its_evaluation_set_again(case: Case) -> None:
    at_v1(case).stop()
    dev = case.device(trial_s=30.0)
    try:
        case.push(2, evaluation=True)
        r2 = case.release(2)
        case.event("active-trial", r2)
    finally:
        dev.stop()  # mid-trial: the next start carries on with the trial
    dev = case.device(trial_s=0.3)
    try:
        done = case.event("committed", r2)
        assert done.detail["judged"] == "evaluation-set", done.detail
    finally:
        dev.stop()


def test_version_answering_its_evaluation_set_worse_is_rolled_back(case: Case) -> None:
    """Random weights with a golden file made from them pass the golden check; the evaluation set catches them
    at trial start, on a device with no rollout and no traffic."""
    dev = at_v1(case)
    try:
        case.push(2, evaluation=True, random_weights=True)
        r2 = case.release(2)
        ev = case.event("rolled-back", r2)
        assert "evaluation set: version 2 scores" in (ev.reason or ""), ev.reason
        q = ev.detail["quality"]
        assert q["score"] < 0.3 and q["baseline_score"] > 0.9, q
        assert dev.serving(case.model) == [1]
        assert r2 in dev.state().models[case.model].rejected
    finally:
        dev.stop()


# ---- offline and restarts --------------------------------------------------------------------------
PIPELINE = """description = "the digits model's top 3, as a pipeline"

[[files]]
file = "labels.txt"
sha256 = "{sha}"

[[inputs]]
name = "pixels"
datatype = "FP32"
shape = [-1, 64]

[[outputs]]
name = "labels"
datatype = "BYTES"
shape = [-1, 3]

[[steps]]
name = "classifier"
model = "{model}"
inputs = {{ pixels = "pixels" }}
outputs = {{ probabilities = "probabilities" }}

[[steps]]
name = "top"
kind = "topk"
inputs = {{ scores = "probabilities" }}
outputs = {{ labels = "labels" }}
params = {{ k = 3, labels = "labels.txt" }}
"""


def test_a_pipeline_is_released_and_updated_like_a_model(case: Case) -> None:
    """A pipeline version (pipeline.toml, its listed files) is pushed, signed, released, downloaded,
    prepared against the device's models and served; a tampered [[files]] digest is refused at push."""
    import hashlib

    from edged.protocol.types import InferRequest

    dev = at_v1(case)
    try:
        labels = "".join(f"digit {i}\n" for i in range(10))
        folder = case.tmp / "pub" / "pipe" / "1"
        folder.mkdir(parents=True)
        (folder / "labels.txt").write_text(labels)
        text = PIPELINE.format(sha=hashlib.sha256(labels.encode()).hexdigest(), model=case.model)
        (folder / "pipeline.toml").write_text(text)
        pipe = f"pipe-{case.model}"
        case.world.client.push_folder(folder, pipe, 1)
        info = case.world.client.release(case.world.keys.load(), pipe, 1, expires_in_s=3600,
                                         selector=TargetSelector(devices=[case.device_id]))
        wait_for(lambda: committed(dev, pipe, int(info.release)), 60, 0.05, "the pipeline release committed")
        assert dev.serving(pipe) == [1]
        x = pixels(2)
        want = np.argsort(-dev.infer(x, case.model).outputs["probabilities"], axis=1, kind="stable")[:, :3]
        got = dev.service.infer(InferRequest(model=pipe, inputs={"pixels": x}), timeout=30).outputs["labels"]
        assert [[v.decode() for v in row] for row in got] == [[f"digit {i}" for i in row] for row in want]

        bad = case.tmp / "pub" / "pipe" / "2"
        shutil.copytree(folder, bad)
        (bad / "labels.txt").write_text(labels + "extra\n")
        with pytest.raises(Exception, match=r"sha256 in pipeline\.toml differs"):
            case.world.client.push_folder(bad, pipe, 2)
    finally:
        dev.stop()


def test_offline_keeps_serving_then_updates(case: Case, tmp_path: Path) -> None:
    keys = case.world.keys
    server = RegistryServer(tmp_path / "own", [keys.public]).start()
    own = Case(case.model, case.device_id, tmp_path, World(tmp_path, keys, keys, server, server.client()))
    dev = at_v1(own, retry_max_s=1.0)
    try:
        own.push(2)
        server.stop()
        time.sleep(1.0)  # sleep-ok: several failed polls with back-off, serving all along
        assert dev.serving(own.model) == [1]
        assert dev.infer(pixels(), own.model).version == 1
        server.start()
        own.world.client = server.client()
        r2 = own.release(2)
        wait_for(lambda: committed(dev, own.model, r2), 60, 0.1, "release 2 committed after reconnecting")
        assert dev.serving(own.model) == [2]
    finally:
        dev.stop()
        server.stop()


@pytest.mark.parametrize("loss", ["deleted and re-enrolled", "corrupt"])
def test_reports_reach_the_registry_after_the_device_lost_its_state(case: Case, loss: str) -> None:
    """The registry ignores report numbers it already holds for the device id: a state that starts over must
    not number its reports from 1 again. A corrupt state is moved aside and the credential kept: no operator
    re-enrolls it, so the device alone has to get this right."""
    dev = at_v1(case)
    wait_for(lambda: not dev.state().outbox, 30, 0.05, "release 1's reports delivered")
    dev.stop()
    token = None
    if loss == "corrupt":
        (case.tmp / "state" / "sync" / "state.json").write_text('{"models": "not a state"}')
    else:
        shutil.rmtree(case.tmp / "state")  # e.g. a replaced SD card: state and credential gone
        token = case.world.client.reenroll(case.device_id).token
    case.push(2)
    r2 = case.release(2)
    dev = case.device(token)
    try:
        wait_for(lambda: committed(dev, case.model, r2), 30, 0.05, "release 2 committed on the device")
        case.event("committed", r2)
        steps = [e.step for e in case.events() if e.release == r2]
        assert steps == ["downloading", "verifying", "prepared", "active-trial", "committed"]
        info = case.world.client.device(case.device_id)
        assert [(m.model, m.state, m.release) for m in info.models] == [(case.model, "committed", r2)]
    finally:
        dev.stop()


def test_daemon_process_updates_end_to_end(case: Case) -> None:
    """The real daemon process: push version 2, release it, it serves version 2, the registry says committed."""
    case.push(1)
    r1 = case.release(1)
    port = free_port()
    token = case.world.client.enrollment_token().token
    (case.tmp / "repo").mkdir()
    cfg = device_toml(case.tmp, case.tmp / "repo", case.world.server.url, [case.world.keys.public], token=token,
                      device_id=case.device_id, http_port=port, poll_s=0.1)
    daemon = DaemonProcess(cfg, port, case.tmp / "daemon.log", sets={"trial_s": 0.5})
    daemon.start()
    try:
        daemon.wait_http()
        case.event("committed", r1)
        wait_for(lambda: daemon.versions(case.model) == [1], 30, 0.05, "version 1 served")
        case.push(2)
        r2 = case.release(2)
        case.event("committed", r2)
        assert daemon.versions(case.model) == [2]
        r = daemon.infer(pixels(), case.model)
        assert r.status_code == 200 and r.json()["model_version"] == "2"
        st = case.world.client.status(case.model)
        assert st.models[0].releases[-1].devices == {"committed": 1}
    finally:
        daemon.stop()
        print((case.tmp / "daemon.log").read_text()[-3000:])


def test_a_read_only_repository_is_reported_as_such_and_retried_with_back_off(case: Case) -> None:
    """Issue 17 item 2 outside nspawn: the repository is not writable. The registry hears the real cause (not
    'internal error: OSError'), edged status shows a failure (not a download in progress), the log has one
    line per attempt and no traceback, and the attempts back off."""
    import os
    import re

    from edged import status
    from edged.config import load_config

    case.push(1)
    r1 = case.release(1)
    repo = case.tmp / "repo"
    repo.mkdir()
    port = free_port()
    token = case.world.client.enrollment_token().token
    cfg = device_toml(case.tmp, repo, case.world.server.url, [case.world.keys.public], token=token,
                      device_id=case.device_id, http_port=port, poll_s=0.1)
    if os.geteuid() == 0:  # root writes through permissions: a read-only bind mount in the daemon's namespace
        if shutil.which("unshare") is None:
            pytest.skip("unshare (util-linux) is needed to give the daemon a read-only repository")
        prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                  'mount --bind -o ro "$0" "$0" && exec "$@"', str(repo)]
        cause = "read-only file system"
    else:
        repo.chmod(0o555)
        prefix, cause = [], "permission denied"
    daemon = DaemonProcess(cfg, port, case.tmp / "daemon.log", sets={"trial_s": 0.5}, prefix=prefix)
    daemon.start()
    log = case.tmp / "daemon.log"
    try:
        daemon.wait_http()
        failed = case.event("failed", r1)
        assert failed.reason.startswith(f"{cause}: {repo}"), failed.reason
        assert ".staging" in failed.reason and "during download" in failed.reason
        assert "internal error" not in failed.reason
        info = case.world.client.device(case.device_id)
        assert [(m.model, m.state) for m in info.models] == [(case.model, "failed")]

        def delays() -> list[float]:
            return [float(x) for x in re.findall(r"update blocked by a local fault: .*; retry in ([\d.]+)s",
                                                 log.read_text())]

        wait_for(lambda: len(delays()) >= 3, 60, 0.1, "three attempts")
        first, _second, third = delays()[:3]
        assert first <= 1.0 and third >= 2.0  # edged/backoff.py: from 1 s doubling, half of each jitter
        line = f"-> v1 r{r1}: FAILED at download: {cause}"
        assert line in status.update_states(load_config(cfg))[case.model]
        assert "Traceback" not in log.read_text()
    finally:
        daemon.stop()
        repo.chmod(0o755)
        print(log.read_text()[-3000:])


@pytest.mark.slow
def test_crash_loop_serves_last_known_good(case: Case) -> None:
    """A version that keeps the daemon dying during its trial: after N quick restarts the old one serves."""
    case.push(1)
    r1 = case.release(1)
    port = free_port()
    token = case.world.client.enrollment_token().token
    (case.tmp / "repo").mkdir()
    cfg = device_toml(case.tmp, case.tmp / "repo", case.world.server.url, [case.world.keys.public], token=token,
                      device_id=case.device_id, http_port=port, poll_s=0.1)
    daemon = DaemonProcess(cfg, port, case.tmp / "daemon.log", sets={"trial_s": 0.5})
    daemon.start()
    try:
        daemon.wait_http()
        case.event("committed", r1)
        daemon.stop()  # an orderly restart, now with a long trial
        daemon.sets = {"trial_s": 120, "crash_loop_restarts": 3, "crash_loop_window_s": 600}
        daemon.start()
        daemon.wait_http()
        case.push(2)
        r2 = case.release(2)
        case.event("active-trial", r2)
        for _ in range(3):  # the "crash": the process dies while version 2 is on trial
            wait_for(lambda: daemon.versions(case.model) == [2], 30, 0.05, "version 2 on trial")
            daemon.kill()
            daemon.start()
            daemon.wait_http()
        ev = case.event("rolled-back", r2)
        assert "crash loop" in (ev.reason or ""), ev.reason
        assert daemon.versions(case.model) == [1]
        assert daemon.infer(pixels(), case.model).json()["model_version"] == "1"
    finally:
        daemon.stop()


def test_mqtt_nudge_makes_the_device_poll_at_once(tmp_path: Path, world: World) -> None:
    """With a 10-minute poll interval, only the registry's MQTT nudge can explain a quick update."""
    from tests.mqtt_helpers import running_broker

    keys = world.keys
    with running_broker(tmp_path / "mqtt") as broker:
        regcfg = tmp_path / "registry.toml"
        regcfg.write_text(f'[registry]\nnudge_mqtt_url = "{broker.url}"\n')
        server = RegistryServer(tmp_path / "reg", [keys.public], extra_args=["--config", str(regcfg)]).start()
        try:
            own = Case("nudged", "dev-nudged", tmp_path, World(tmp_path, keys, keys, server, server.client()))
            own.push(1)
            r1 = own.release(1)
            token = server.client().enrollment_token().token
            (tmp_path / "repo").mkdir()
            cfg = device_toml(tmp_path, tmp_path / "repo", server.url, [keys.public], token=token,
                              device_id=own.device_id, poll_s=600, mqtt_url=broker.url)
            dev = InProcessDevice(cfg, trial_s=0.2, mqtt_nudge=True).start()
            try:
                wait_for(lambda: committed(dev, own.model, r1), 30, 0.05, "release 1 (first poll at start)")
                time.sleep(0.5)  # sleep-ok: the nudge subscription is up (its SUBACK shows nowhere outside)
                own.push(2)
                r2 = own.release(2)
                wait_for(lambda: committed(dev, own.model, r2), 30, 0.05, "release 2 after the nudge")
            finally:
                dev.stop()
        finally:
            server.stop()


def test_a_flood_of_nudges_does_not_make_the_device_hammer_its_registry(tmp_path: Path, world: World,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A nudge carries no authority, only timing, and anyone who may publish on the fleet's nudge topic can
    send it: 100 nudges in 3 s made a device poll its registry back to back (one round every ~0.5 s, and
    past any back-off); a fleet does that all at once. Nudged polls are at least NUDGE_SPACING_S apart."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from edged.protocol.fleet.nudge import fleet_topic
    from edged.sync.agent import NUDGE_SPACING_S, SyncAgent
    from tests.mqtt_helpers import running_broker

    # When each poll round starts (the one at start included): the spacing is measured on these, not on
    # a count after a fixed sleep (a nudged poll is due up to NUDGE_SPACING_S after the last round ended).
    starts: list[float] = []
    one_round = SyncAgent._round

    async def timed_round(self: SyncAgent) -> float | None:
        starts.append(time.monotonic())
        return await one_round(self)

    monkeypatch.setattr(SyncAgent, "_round", timed_round)
    with running_broker(tmp_path / "mqtt") as broker:
        case = Case("flood", "dev-flood", tmp_path, world)
        case.push(1)
        r1 = case.release(1)
        token = world.client.enrollment_token().token
        (tmp_path / "repo").mkdir()
        cfg = device_toml(tmp_path, tmp_path / "repo", world.server.url, [world.keys.public], token=token,
                          device_id=case.device_id, poll_s=600, mqtt_url=broker.url)
        dev = InProcessDevice(cfg, trial_s=0.2, mqtt_nudge=True).start()
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="flood")
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        try:
            wait_for(lambda: committed(dev, case.model, r1), 30, 0.05, "release 1 (first poll at start)")
            time.sleep(0.5)  # sleep-ok: the nudge subscription is up (its SUBACK shows nowhere outside)
            before, t0 = len(starts), time.monotonic()
            while time.monotonic() - t0 < 3.0:
                pub.publish(fleet_topic("edged"), b"{}", qos=0)
                time.sleep(0.03)  # sleep-ok: the flood's pace
            wait_for(lambda: len(starts) > before, 15, 0.05, "a poll after the nudges")
            polls, spent = len(starts) - before, time.monotonic() - t0
            allowed = 1 + int(spent / NUDGE_SPACING_S)
            gaps = [round(b - a, 2) for a, b in itertools.pairwise(starts)]
            assert polls <= allowed, f"{polls} polls in {spent:.1f} s of nudges (at most {allowed}), {gaps = }"
            assert min(gaps) >= NUDGE_SPACING_S - 0.05, f"poll rounds {gaps} s apart"
        finally:
            pub.loop_stop()
            pub.disconnect()
            dev.stop()


def test_boot_pins_and_counts_crash_loops(tmp_path: Path, world: World) -> None:
    """Without a registry: the sync state alone decides what a start loads (and SIGHUP re-applies it)."""
    from edged.config import load_config
    from edged.errors import ConfigError
    from edged.protocol.fleet.release import SignedRelease
    from edged.sync import boot
    from edged.sync.settings import SyncSettings
    from edged.sync.state import ModelSync, Pending, StateStore, SyncState, VersionRef

    repo = tmp_path / "repo"
    repo.mkdir()
    cfg_path = device_toml(tmp_path, repo, "http://127.0.0.1:9", [world.keys.public], token=None)
    cfg = load_config(cfg_path)
    settings = SyncSettings.from_config(cfg, {"crash_loop_restarts": 2})
    signed = SignedRelease(manifest="e30=", signature="", key_id="")
    state = SyncState(models={
        "a": ModelSync(current=VersionRef(version=3, release=5)),
        "b": ModelSync(current=VersionRef(version=1, release=1),
                       pending=Pending(release=2, version=2, step="trial", signed=signed)),
        "c": ModelSync(pending=Pending(release=1, version=1, step="activate", signed=signed)),
        "d": ModelSync(),
    })
    StateStore(settings.sync_dir).save(state)
    first = boot.prepare_boot(cfg, settings)
    assert first.pins == {"a": 3, "b": 2, "c": None} and first.crash_loops == []
    assert cfg.models.policy_for("b").specific == [2] and "c" in cfg.models.disabled
    # a second start while "b" is on trial and "c" being activated: with N = 2 both are crash loops
    boot._done.clear()
    again = boot.prepare_boot(load_config(cfg_path), settings)
    assert again.crash_loops == ["b", "c"] and again.pins["b"] == 1 and again.pins["c"] is None
    saved = StateStore(settings.sync_dir).load().models["b"].pending
    assert saved is not None and saved.step == "rollback" and "crash loop" in (saved.reason or "")
    # SIGHUP: a freshly read config gets the same pins, without counting a start
    fresh = load_config(cfg_path)
    assert boot.repin(fresh, settings) == {"a": 3, "b": 1, "c": None}
    assert fresh.models.policy_for("a").specific == [3]
    # a registry section that cannot work is a config error, not a silent no-op
    bad = load_config(device_toml(tmp_path, repo, "http://127.0.0.1:9", [], token=None, device_id="nokeys"))
    with pytest.raises(ConfigError, match="public_keys"):
        SyncSettings.from_config(bad)


def test_trial_judgement() -> None:
    from edged.latency_buckets import LATENCY_BUCKETS_S
    from edged.sync.settings import SyncSettings
    from edged.sync.trial import Sample, baseline, judge

    cfg = SyncSettings(url="http://x", device_id="d", enrollment_token=None, public_keys=[], poll_interval_s=1,
                       labels={}, state_dir=Path("/nonexistent"), repository=Path("/nonexistent"))

    def lat(ms: float, n: int) -> tuple[int, ...]:
        counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        counts[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= ms / 1000)] = n
        return tuple(counts)

    old = Sample(ok=1000, errors=0, latency_counts=lat(1, 1000))
    assert judge(Sample(500, 0, lat(1, 500)), old, cfg, final=True) is None
    # errors: judged as soon as there are enough requests, against the old rate plus the allowance
    assert "error rate" in (judge(Sample(15, 5, lat(1, 15)), old, cfg, final=False) or "")
    assert judge(Sample(5, 5, lat(1, 5)), old, cfg, final=False) is None  # too few requests to judge
    noisy_old = Sample(ok=900, errors=100, latency_counts=lat(1, 900))
    assert judge(Sample(95, 5, lat(1, 95)), noisy_old, cfg, final=False) is None  # no worse than before
    # latency: only at the end, only over enough requests, above the floor and the ratio
    slow = Sample(500, 0, lat(50, 500))
    assert judge(slow, old, cfg, final=False) is None
    assert "p99 latency" in (judge(slow, old, cfg, final=True) or "")
    assert judge(Sample(50, 0, lat(50, 50)), old, cfg, final=True) is None
    assert judge(Sample(500, 0, lat(5, 500)), old, cfg, final=True) is None  # under the 10 ms floor
    # the part of the trial after the switch settled is what counts
    assert judge(slow, old, cfg, final=True, latency=Sample(400, 0, lat(1, 400))) is None
    # the previous version over the update's run-up, when it served enough then
    before, at_switch = Sample(100, 0, lat(1, 100)), Sample(400, 0, lat(1, 400))
    assert baseline(before, at_switch, cfg) == at_switch.since(before)
    assert baseline(at_switch, at_switch, cfg) == at_switch


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a small JSON body on a kept-alive HTTP/1.1 connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_close_ends_the_connections_every_thread_kept_open() -> None:
    """The agent's registry calls run on worker threads, each with its own kept-alive connection; close() at
    stop must end them all, or one left idle holds a TLS registry's stop for its whole grace."""
    from edged.sync.capped_http import RegistryHttp

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        client = RegistryHttp(f"http://127.0.0.1:{srv.server_address[1]}", timeout=10)
        socks: list[Any] = []

        def call() -> None:
            assert client.request("GET", "/api/v1/ping")[0] == 200
            socks.append(client._conn().sock)
        threads = [threading.Thread(target=call) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        call()  # and this thread's own
        assert len(socks) == 4 and all(s is not None and s.fileno() >= 0 for s in socks)
        client.close()
        assert all(s.fileno() == -1 for s in socks), "every thread's connection is closed"
        assert client.request("GET", "/api/v1/ping")[0] == 200  # a later call opens a new one
        client.close()
    finally:
        srv.shutdown()
        srv.server_close()
