"""A rollout across six real daemons (``edged run`` processes) and one registry process.

A good version goes through every step to 100 %; a broken one (its golden check fails)
halts in its first step, its canaries roll back by themselves (their reports carry their own
last log lines, shown by the CLI and the dashboard), and the devices outside the canary step
never download it; rolling the good rollout back by hand sends every daemon back to its
last-known-good version. A rollout scheduled a few seconds ahead starts by itself at its time.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.registry_helpers import (
    ADMIN_TOKEN,
    EdgedRun,
    Keys,
    RegistryServer,
    device_toml,
    free_port,
    make_version,
    wait_for,
)

MODEL = "digits"
N = 6
FLEET = {"fleet": "rollout-test"}


@dataclass
class World:
    tmp: Path
    keys: Keys
    server: RegistryServer
    client: Any
    daemons: dict[str, EdgedRun]
    repos: dict[str, Path]

    def events(self, device: str) -> list[Any]:
        return list(self.client.device(device, events=500).events)

    def serving(self) -> dict[str, list[int]]:
        return {d: p.versions(MODEL) for d, p in self.daemons.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("rollout-daemons")
    keys = Keys.make(tmp)
    server = RegistryServer(tmp, [keys.public], extra_args=["--rollout-tick", "0.2s"]).start()
    client = server.client()
    pub = tmp / "pub"
    make_version(pub / "1", salt="v1")
    client.push_folder(make_version(pub / "2", salt="v2"), MODEL, 2)
    client.push_folder(make_version(pub / "3", salt="v3", golden_fail=True), MODEL, 3)
    token = client.enrollment_token(uses=N, labels=FLEET).token  # labels are the operator's
    daemons, repos = {}, {}
    for i in range(N):
        dev, home = f"dev-{i}", tmp / f"dev-{i}"
        repo = home / "repo"
        shutil.copytree(pub / "1", repo / MODEL / "1")  # every device serves version 1 before the rollouts
        port = free_port()
        cfg = device_toml(home, repo, server.url, [keys.public], token=token, device_id=dev, http_port=port,
                          poll_s=0.2)
        cfg.write_text(cfg.read_text() + "trial_s = 0.5\nretry_max_s = 2.0\nfacts_interval_s = 5.0\n")
        daemons[dev] = EdgedRun(cfg, port, home / "daemon.log")
        repos[dev] = repo
    try:
        for d in daemons.values():
            d.start()
        for d in daemons.values():
            d.wait_http(90)
        wait_for(lambda: len(client.devices(FLEET)) == N, 60, 0.2, "every daemon enrolled")
        yield World(tmp, keys, server, client, daemons, repos)
    finally:
        for d in daemons.values():
            d.stop()
        client.close()
        server.stop()


def rollout(w: World, version: int, steps: list[StepSpec], gates: Gates) -> Any:
    spec = RolloutCreate(model=MODEL, release=0, steps=steps, gates=gates, target=RolloutTarget(labels=FLEET))
    return w.client.release_with_rollout(w.keys.load(), MODEL, version, spec, expires_in_s=3600)


def committed(w: World, release: int) -> set[str]:
    return {d.device_id for d in w.client.devices(FLEET)
            if any(m.model == MODEL and m.release == release and m.state == "committed" for m in d.models)}


def test_rollouts_across_real_daemons(world: World) -> None:
    w = world
    assert all(v == [1] for v in w.serving().values()), w.serving()
    # -- a good version: every step, then 100 %
    good = rollout(w, 2, [StepSpec(group=RolloutTarget(devices=["dev-0"]), soak_s=0.5),
                          StepSpec(percent=50, soak_s=0.5), StepSpec(percent=100)],
                   Gates(max_failure_rate=0.0, min_reporting=1))
    seen_steps: list[tuple[int, int]] = []  # (step index, devices committed when it was first seen)

    def done() -> bool:
        st = w.client.rollout(good.id)
        if not seen_steps or seen_steps[-1][0] != st.rollout.step:
            seen_steps.append((st.rollout.step, st.totals["committed"]))
        assert st.rollout.state in ("running", "completed"), st.rollout.reason
        return st.rollout.state == "completed" and st.totals["committed"] == N

    wait_for(done, 120, 0.1, "the good release committed on every daemon")
    steps = [s for s, _ in seen_steps]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 3, seen_steps
    assert dict(seen_steps).get(1, 1) >= 1  # the canary had committed before the next step began
    assert committed(w, good.release) == set(w.daemons)
    assert all(v == [2] for v in w.serving().values()), w.serving()
    st = w.client.rollout(good.id)
    assert next(s.members for s in st.steps) == 1 and sum(s.members for s in st.steps) == N

    # -- a broken version: halted in its first step, canaries roll back by themselves
    bad = rollout(w, 3, [StepSpec(percent=20, min_devices=2, soak_s=0.5), StepSpec(percent=100)],
                  Gates(max_failure_rate=0.1, min_reporting=2))
    assert bad.members == 2
    wait_for(lambda: w.client.rollout(bad.id).rollout.state == "halted", 60, 0.1, "the broken rollout to halt")
    st = w.client.rollout(bad.id)
    assert st.rollout.step == 0 and "failure_rate" in (st.rollout.reason or "")
    assert st.totals["rolled_back"] == 2 and st.steps[1].members == 0
    canaries = {d for d in w.daemons if any(e.release == bad.release for e in w.events(d))}
    assert len(canaries) == 2
    time.sleep(2.0)  # sleep-ok: ten more polls of every daemon: nobody else may touch the release
    for d in w.daemons:
        mine = [e for e in w.events(d) if e.release == bad.release]
        if d in canaries:
            outcome = [e for e in mine if e.step == "rolled-back"]
            assert outcome and "prepare failed" in (outcome[0].reason or ""), mine
            # the daemon's own last log lines came with it: the golden check that failed, on each engine
            logs = outcome[0].logs
            assert any("golden check failed" in line and "version=3" in line for line in logs), logs
            assert 0 < len(logs) <= 50 and all(len(line) <= 256 for line in logs)
        else:
            assert mine == [], f"{d} reported {[(e.step, e.reason) for e in mine]} for the halted release"
            assert not (w.repos[d] / MODEL / "3").exists()
            assert not any((w.repos[d] / ".staging").glob(f"{MODEL}/3-*"))
    assert all(v == [2] for v in w.serving().values()), w.serving()
    canary = sorted(canaries)[0]
    text = w.server.cli("device", canary).stdout
    assert "log line(s):" in text and "golden check failed" in text, text
    with httpx.Client(base_url=w.server.url, timeout=30) as h:
        assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
        page = h.get(f"/ui/devices/{canary}").text
    assert 'class="device-log"' in page and "golden check failed for output &#39;probabilities&#39;" in page

    # -- rolling the good release back by hand: every daemon returns to its last-known-good (version 1)
    w.client.rollout_action(good.id, "rollback", "operator test")
    wait_for(lambda: all(v == [1] for v in w.serving().values()), 60, 0.1, "every daemon back on version 1")
    for d in w.daemons:
        back = [e for e in w.events(d) if e.release == good.release and e.step == "rolled-back"]
        assert back and "last-known-good" in (back[-1].reason or "") and back[-1].detail.get("serving") == 1
    for d in w.daemons.values():
        assert d.alive()


def test_a_scheduled_rollout_starts_by_itself_at_its_time(world: World) -> None:
    """Scheduled 6 s ahead: no daemon hears of the release before then; the registry's own evaluator loop (no
    evaluate call) starts it at its time, and the daemons update. The "not yet" checks run 2 s before the
    start time, however long the release took to create on a loaded machine."""
    w = world
    start_at = time.time() + 6.0
    spec = RolloutCreate(model=MODEL, release=0, steps=[StepSpec(percent=100)], target=RolloutTarget(labels=FLEET),
                         gates=Gates(max_failure_rate=0.0, min_reporting=1), start_at=start_at)
    ro = w.client.release_with_rollout(w.keys.load(), MODEL, 2, spec, expires_in_s=3600)
    assert (ro.state, ro.members) == ("scheduled", 0)
    time.sleep(max(0.0, start_at - 2.0 - time.time()))  # sleep-ok: nothing may happen before the start time
    assert w.client.rollout(ro.id).rollout.state == "scheduled"
    assert all(e.release != ro.release for d in w.daemons for e in w.events(d))
    assert all(v == [1] for v in w.serving().values()), w.serving()
    wait_for(lambda: w.client.rollout(ro.id).rollout.state != "scheduled", 10, 0.05, "the scheduled start")
    started = time.time()
    assert started >= (ro.start_at or 0) and w.client.rollout(ro.id).rollout.state in ("running", "completed")
    wait_for(lambda: on_release(w, ro.release, 2), 60, 0.1, "version 2 on every daemon after the scheduled start")
    first = min(e.received_at for d in w.daemons for e in w.events(d) if e.release == ro.release)
    assert first >= (ro.start_at or 0)


def on_release(w: World, release: int, version: int) -> bool:
    return committed(w, release) == set(w.daemons) and all(v == [version] for v in w.serving().values())


# ~25 s; the fast slice: test_rollout.py::test_fleet_rollback_to_previous_twice_and_to_a_named_release
@pytest.mark.slow
def test_fleet_rollbacks_across_real_daemons(world: World) -> None:
    """Two "previous" rollbacks in a row, the second while the first is still being applied, then a rollback
    to a named release: every daemon ends on the same intended release, re-downloading pruned versions."""
    w = world
    key = w.keys.load()
    pub = w.tmp / "pub"
    released = {}
    for v in (4, 5, 6):
        w.client.push_folder(make_version(pub / str(v), salt=f"v{v}"), MODEL, v)
        ro = rollout(w, v, [StepSpec(percent=100)], Gates(max_failure_rate=0.0, min_reporting=1))
        wait_for(lambda ro=ro, v=v: on_release(w, ro.release, v), 60, 0.1, f"version {v} on every daemon")
        released[v] = ro.release
    assert not any((repo / MODEL / "4").exists() for repo in w.repos.values())  # pruned: neither current nor kept
    t0 = time.monotonic()
    first = w.client.rollback(key, MODEL, reason="test: back one", expires_in_s=3600)
    second = w.client.rollback(key, MODEL, reason="test: back two", expires_in_s=3600)
    assert (first.version, first.restores) == (5, released[5])
    assert (second.version, second.restores) == (4, released[4]) and second.release > first.release
    wait_for(lambda: on_release(w, second.release, 4), 60, 0.1, "every daemon on version 4 after two rollbacks")
    two_rollbacks_s = time.monotonic() - t0
    t0 = time.monotonic()
    named = w.client.rollback(key, MODEL, str(released[6]), reason="test: named", expires_in_s=3600)
    assert named.version == 6
    wait_for(lambda: on_release(w, named.release, 6), 60, 0.1, "every daemon on version 6, named")
    named_s = time.monotonic() - t0
    print(f"fleet rollback convergence, {N} daemons: two in a row {two_rollbacks_s:.1f} s, named {named_s:.1f} s")
    for d in w.daemons:
        failed = [e for e in w.events(d) if e.release in (first.release, second.release, named.release)
                  and e.step == "failed"]
        assert failed == [], f"{d}: {[(e.release, e.reason) for e in failed]}"
    for d in w.daemons.values():
        assert d.alive()


# ~30 s; the fast slice: test_rollout.py::test_quality_gate_compares_evaluation_scores_with_last_known_good
@pytest.mark.slow
def test_quality_gate_halts_wrong_but_self_consistent_answers(world: World) -> None:
    """Random weights whose golden file was regenerated from them pass the golden check and any trial; the
    devices score them on the release's labelled evaluation set at trial start, against the version they
    replace, and the quality gate halts the rollout in its first step. A good version passes the gate."""
    w = world
    pub = w.tmp / "pub"
    w.client.push_folder(make_version(pub / "7", salt="v7", evaluation=True), MODEL, 7)
    w.client.push_folder(make_version(pub / "8", salt="v8", evaluation=True, random_weights=True), MODEL, 8)
    gates = Gates(max_failure_rate=0.1, min_reporting=2, max_quality_drop=0.02)
    good = rollout(w, 7, [StepSpec(percent=34, min_devices=2), StepSpec(percent=100)], gates)
    wait_for(lambda: on_release(w, good.release, 7), 90, 0.1, "the good version with an evaluation set everywhere")

    def completed() -> bool:  # the registry moves the rollout on at its next tick after the last commit
        state = w.client.rollout(good.id).rollout.state
        assert state in ("running", "completed"), state
        return state == "completed"
    wait_for(completed, 30, 0.1, "the good rollout to complete")
    st = w.client.rollout(good.id)
    q = next(g for g in st.gates if g.gate == "quality_drop")
    assert q.judged and q.ok and q.value is not None and q.value <= 0.02, q
    for d in w.daemons:  # no traffic in trial: the commit says it rests on the evaluation set alone
        done = [e for e in w.events(d) if e.release == good.release and e.step == "committed"]
        assert done and done[-1].detail.get("judged") == "evaluation-set", done
    t0 = time.monotonic()
    bad = rollout(w, 8, [StepSpec(percent=34, min_devices=2), StepSpec(percent=100)], gates)
    wait_for(lambda: w.client.rollout(bad.id).rollout.state == "halted", 60, 0.1, "the quality gate to halt")
    halted_s = time.monotonic() - t0
    st = w.client.rollout(bad.id)
    assert st.rollout.step == 0 and "quality_drop" in (st.rollout.reason or ""), st.rollout.reason
    q = next(g for g in st.gates if g.gate == "quality_drop")
    assert q.value is not None and q.value > 0.5, q  # top-1 accuracy fell from ~0.97 to ~0.1
    wait_for(lambda: all(v == [7] for v in w.serving().values()), 60, 0.1, "every daemon back on version 7")
    print(f"quality gate: good version {next(g for g in w.client.rollout(good.id).gates if g.gate == 'quality_drop')}"
          f"\nbad version halted {halted_s:.1f} s after its rollout began: {q}")
    for d in w.daemons.values():
        assert d.alive()
