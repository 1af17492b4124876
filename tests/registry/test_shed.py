"""Load shedding: a busy registry refuses device writes with 503 + Retry-After, never polls; devices come back.

The registry runs in this process (uvicorn on a thread) so a test can hold its load signal
"behind" the way a late event loop does (``note_lag``), instead of racing a real overload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from edged.protocol.fleet.messages import API_PREFIX
from edged.protocol.fleet.release import TargetSelector
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.shed import LEVEL_MAX, LoadSignal
from tests.registry_helpers import ADMIN_TOKEN, InProcessDevice, Keys, device_toml, free_port, make_version, wait_for


@dataclass
class Registry:
    url: str
    signal: LoadSignal
    client: Any
    keys: Keys


class Busy:
    """Keeps the registry's load signal at its top (as a loop late at every tick would) until stopped."""

    def __init__(self, signal: LoadSignal) -> None:
        self.signal = signal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.signal.note_lag(self.signal.max_lag_s * 10)
            self._stop.wait(0.05)

    def __enter__(self) -> Busy:
        self._thread.start()
        wait_for(lambda: self.signal.level >= LEVEL_MAX, 5, 0.01, "the load signal at its top level")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        wait_for(lambda: not self.signal.behind(), 5, 0.05, "the load signal to clear")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    import uvicorn

    from edged.registry.admin_client import RegistryClient
    from edged.registry.api import create_app
    from edged.registry.settings import RegistrySettings

    tmp = tmp_path_factory.mktemp("shed")
    keys = Keys.make(tmp)
    (tmp / "admin.token").write_text(ADMIN_TOKEN)
    settings = RegistrySettings(data_dir=tmp / "registry", admin_token_file=tmp / "admin.token",
                                public_keys=[keys.public], shed_retry_after_s=1, rollout_tick_s=0.2)
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: server.started, 30, 0.05, "the in-process registry")
    client = RegistryClient(url, ADMIN_TOKEN)
    yield Registry(url, app.state.load_signal, client, keys)
    client.close()
    server.should_exit = True
    thread.join(30)


def test_a_busy_registry_sheds_device_writes_but_answers_polls_and_operators(registry: Registry,
                                                                              tmp_path: Path) -> None:
    info = registry.client.push_folder(make_version(tmp_path / "v1", salt="shed-http"), "shed-http", 1)
    registry.client.release(registry.keys.load(), "shed-http", 1, expires_in_s=3600,
                            selector=TargetSelector(devices=["shed-http-dev"]))
    token = registry.client.enrollment_token().token
    with httpx.Client(base_url=registry.url, timeout=30) as http:
        cred = http.post(f"{API_PREFIX}/enroll", json={"token": token, "device_id": "shed-http-dev"}).json()
        auth = {"Authorization": f"Bearer {cred['credential']}"}
        event = {"seq": 1, "model": "shed-http", "step": "downloading", "version": 1, "release": 1,
                 "detail": {}, "at": time.time()}
        telemetry = {"buffer_id": "b", "items": [{"device": "shed-http-dev", "seq": 1, "run": "r", "t": time.time(),
                                                  "window_s": 10.0, "uptime_s": 1.0, "models": []}]}
        writes = [("POST", f"{API_PREFIX}/device/reports", {"events": [event]}),
                  ("PUT", f"{API_PREFIX}/device/facts", {"facts": {"profile": "p"}, "serving": []}),
                  ("POST", INGEST_PATH, telemetry),
                  ("GET", f"{API_PREFIX}/blobs/{info.files[0].sha256}", None)]
        shed_before = registry.signal.shed
        tries, shed = 40, dict.fromkeys(range(len(writes)), 0)
        with Busy(registry.signal):
            for _ in range(tries):
                for i, (method, path, body) in enumerate(writes):
                    r = http.request(method, path, headers={**auth, "Content-Type": "application/json"},
                                     content=orjson.dumps(body) if body else None)
                    if r.status_code == 503:
                        shed[i] += 1
                        assert r.headers["retry-after"] == "5"  # 1 s at the lowest level, 5x at the top
                        assert r.json()["error"]["code"] == "overloaded"
                    else:
                        assert r.status_code in (200, 307), (path, r.status_code, r.text)
            # the control plane still answers: the device's poll (a full answer, then 304), and operators
            poll = http.get(f"{API_PREFIX}/device/desired-state", headers=auth)
            assert poll.status_code == 200 and [m["model"] for m in poll.json()["models"]] == ["shed-http"]
            again = http.get(f"{API_PREFIX}/device/desired-state",
                             headers={**auth, "If-None-Match": poll.headers["etag"]})
            assert again.status_code == 304
            assert [m.name for m in registry.client.models()] == ["shed-http"]
            # the connection shed requests came on stays usable (their bodies were read and dropped)
            assert http.get("/healthz").status_code == 200
        # near the top level telemetry always waits (weight 2); facts, reports and blob requests mostly
        # (at the top: all, 90 %, 70 %; the level dips between the test's nudges and the loop's own timely
        # ticks, so the bounds are wide), and some blob requests get through: updates still progress
        assert shed[2] == tries
        assert shed[1] >= 0.7 * tries and shed[0] >= 0.5 * tries and 0.3 * tries <= shed[3] < tries, shed
        assert registry.signal.shed - shed_before == sum(shed.values())
        # once the loop keeps up every write is taken; the reports that got through before were stored once
        for method, path, body in writes:
            r = http.request(method, path, headers={**auth, "Content-Type": "application/json"},
                             content=orjson.dumps(body) if body else None)
            assert r.status_code in (200, 307), (path, r.status_code, r.text)
        assert [e.step for e in registry.client.device("shed-http-dev", events=10).events] == ["downloading"]


def test_a_device_updating_through_a_busy_spell_loses_nothing_and_reports_no_failure(registry: Registry,
                                                                                     tmp_path: Path) -> None:
    model, device_id = "shed-dev", "shed-dev-1"

    def release(version: int) -> int:
        registry.client.push_folder(make_version(tmp_path / "pub" / str(version), salt=f"shed-{version}"), model,
                                    version)
        return int(registry.client.release(registry.keys.load(), model, version, expires_in_s=3600,
                                           selector=TargetSelector(devices=[device_id])).release)

    def committed(dev: InProcessDevice, r: int) -> bool:
        ms = dev.state().models.get(model)
        return bool(ms and ms.pending is None and ms.current and ms.current.release == r)

    r1 = release(1)
    (tmp_path / "repo").mkdir()
    cfg = device_toml(tmp_path, tmp_path / "repo", registry.url, [registry.keys.public],
                      token=registry.client.enrollment_token().token, device_id=device_id, poll_s=0.1)
    dev = InProcessDevice(cfg, trial_s=0.3).start()
    try:
        wait_for(lambda: committed(dev, r1), 30, 0.05, "release 1 committed")
        wait_for(lambda: any(e.step == "committed" for e in registry.client.device(device_id, events=50).events),
                 30, 0.1, "release 1's reports")
        shed_before = registry.signal.shed
        with Busy(registry.signal):
            r2 = release(2)  # an operator's release goes through while devices are shed
            time.sleep(2.5)  # sleep-ok: polls see it; its download and reports are refused meanwhile
            assert not committed(dev, r2)
            assert registry.signal.shed > shed_before
        wait_for(lambda: committed(dev, r2), 60, 0.05, "release 2 committed after the busy spell")
        wait_for(lambda: any(e.step == "committed" and e.release == r2
                             for e in registry.client.device(device_id, events=50).events), 30, 0.1,
                 "release 2's reports")
        events = list(registry.client.device(device_id, events=50).events)
        seqs = [e.seq for e in events]  # a fresh state numbers from the wall clock (edged/sync/state.py)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a report was lost"
        assert not [e for e in events if e.step in ("failed", "rolled-back")], [(e.step, e.reason) for e in events]
        steps = [e.step for e in events if e.release == r2]
        assert steps[-4:] == ["verifying", "prepared", "active-trial", "committed"]
        assert set(steps[:-4]) == {"downloading"}  # one per attempt at the download
        info = registry.client.device(device_id)
        assert [(m.model, m.state, m.version) for m in info.models] == [(model, "committed", 2)]
    finally:
        dev.stop()


def test_the_shedding_level_follows_the_loop_and_sheds_by_weight() -> None:
    backlog = [0]
    s = LoadSignal(max_lag_s=0.25, backlog=lambda: backlog[0], max_backlog=100)
    assert not s.behind() and not s.refuse(2.0)
    s.note_lag(0.3)  # one late tick: a share of the lightest kinds only
    assert s.level == pytest.approx(0.25) and s.behind()
    shed = {w: sum(s.refuse(w) for _ in range(4000)) / 4000 for w in (0.5, 1.0, 2.0)}
    assert shed[0.5] == pytest.approx(0.125, abs=0.03) and shed[1.0] == pytest.approx(0.25, abs=0.03)
    assert shed[2.0] == pytest.approx(0.5, abs=0.03)
    for _ in range(20):  # a lasting overload: everything on the list is shed
        s.note_lag(1.0)
    assert s.level == LEVEL_MAX and all(s.refuse(0.5) for _ in range(1000))
    for _ in range(39):  # a loop that keeps up brings it down, gradually
        s.note_lag(0.01)
    assert 0 < s.level < 0.1
    s.note_lag(0.01)
    assert s.level == 0 and not s.behind()
    backlog[0] = 101  # the report writer is behind: every write waits whatever the loop says
    assert s.behind() and s.refuse(0.5)


def test_a_busy_registry_holds_a_rollouts_admission_and_goes_on_after(registry: Registry, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.registry import evaluator
    from edged.registry.rollout_wire import RolloutCreate, StepSpec
    from edged.registry.targets import RolloutTarget
    from tests.rollout_helpers import ApiDevice

    monkeypatch.setattr(evaluator, "HOLD_MIN_S", 0.5)
    model = "shed-admit"
    for v in (1, 2):
        registry.client.push_folder(make_version(tmp_path / str(v), salt=f"{model}-{v}"), model, v)
    r1 = registry.client.release(registry.keys.load(), model, 1, expires_in_s=3600).release
    devices = [ApiDevice.enroll(registry.url, registry.client.enrollment_token(labels={"fleet": model}).token,
                                f"{model}-{i}", {"fleet": model}) for i in range(30)]

    def on(release: int) -> set[str]:
        return {d.id for d in devices if d.release(model) == release}

    spec = RolloutCreate(model=model, release=0, steps=[StepSpec(percent=100)],
                         target=RolloutTarget(labels={"fleet": model}), admit_per_minute=300)
    ro = registry.client.release_with_rollout(registry.keys.load(), model, 2, spec, expires_in_s=3600)
    with Busy(registry.signal):
        wait_for(lambda: (a := registry.client.rollout(ro.id).rollout.admission) is not None and a.held, 5, 0.05,
                 "admission held while the registry is behind")
        admission = registry.client.rollout(ro.id).rollout.admission
        assert admission is not None and admission.reason and "behind" in admission.reason
        frozen = on(ro.release)
        time.sleep(1.0)  # sleep-ok: five devices a second would have come in meanwhile
        assert on(ro.release) == frozen and len(frozen) < len(devices)
        assert on(r1) == {d.id for d in devices} - frozen
    wait_for(lambda: len(on(ro.release)) == len(devices), 60, 0.2, "every device let in once the registry keeps up")
    # every device of this fleet may be in before the ramp reaches its end (membership is by hash); then it ends
    wait_for(lambda: registry.client.rollout(ro.id).rollout.admission is None, 60, 0.2, "the admission ramp ended")
