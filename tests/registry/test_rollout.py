"""Fleet rollouts against a real registry process (SQLite and PostgreSQL), devices driven over its HTTP API.

Evaluations are triggered with ``POST /rollouts/evaluate`` (the server's own tick is set to
an hour) so every step of a rollout is deterministic. The real daemons following a rollout
are in ``test_rollout_daemons.py``; the poll path's query count in ``test_rollout_scale.py``.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from edged.errors import ConfigError
from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.step_syntax import duration_s, parse_steps, start_time
from edged.registry.targets import Membership, Ramp, RolloutTarget, percent_cutoff, rank
from tests.http_client import web
from tests.registry.conftest import Env, registry_env
from tests.registry_helpers import ADMIN_TOKEN, make_version, wait_for, write_evaluation_set
from tests.rollout_helpers import ApiDevice, send_as_a_device

_n = itertools.count(1)


# ---- targets and stable hashing (no server) -------------------------------------------------------
def test_targets_match_labels_facts_profiles_and_globs() -> None:
    t = RolloutTarget(labels={"site": "a"}, facts={"jetson.module": "*Orin Nano*"}, profiles=["jetson-*"])
    facts = {"profile": "jetson-orin-nano", "jetson.module": "NVIDIA Jetson Orin Nano 8GB", "jetson.present": True}
    assert t.matches("d1", {"site": "a"}, facts)
    assert not t.matches("d1", {"site": "b"}, facts)
    assert not t.matches("d1", {"site": "a"}, {**facts, "profile": "x86-64-cpu"})
    assert not t.matches("d1", {"site": "a"}, {"profile": "jetson-orin-nano"})  # the fact is missing
    assert RolloutTarget(facts={"jetson.present": "true"}).matches("d", {}, facts)
    assert RolloutTarget(devices=["d2"]).matches("d2", {}, {}) and not RolloutTarget(devices=["d2"]).matches("d1", {},
                                                                                                            {})
    assert RolloutTarget().matches("anything", {}, {})


def test_steps_pick_members_stably_and_only_grow() -> None:
    ids = [f"dev-{i}" for i in range(1000)]
    assert [rank("m", d) for d in ids] == [rank("m", d) for d in ids]
    assert rank("m", "dev-1") != rank("other-salt", "dev-1")
    ranks = [rank("m", d) for d in ids]
    assert sum(r <= percent_cutoff(ranks, 1, 1) for r in ranks) == 10
    assert sum(r <= percent_cutoff(ranks, 1, 25) for r in ranks) == 25  # the step's minimum device count
    assert percent_cutoff(ranks, 100, 1) == 1.0
    steps: list[dict[str, Any]] = [{"percent": 1}, {"group": {"labels": {"ring": "lab"}}}, {"percent": 10},
                                   {"percent": 100}]
    cutoffs = [percent_cutoff(ranks, 1, 1), None, percent_cutoff(ranks, 10, 1), 1.0]
    labels = {d: ({"ring": "lab"} if i % 97 == 0 else {}) for i, d in enumerate(ids)}
    before: set[str] = set()
    for k in range(len(steps)):
        m = Membership.of(RolloutTarget(), "m", steps, cutoffs, k)
        now = {d for d in ids if m.member(d, labels[d], {})}
        assert before <= now, f"a device left the rollout at step {k}"
        before = now
    assert len(before) == 1000
    # a device enrolling later falls in or out by its own rank, the same on every evaluation
    late = Membership.of(RolloutTarget(), "m", steps, cutoffs, 0)
    assert late.member("late-device", {}, {}) == (rank("m", "late-device") <= cutoffs[0])


def test_rollout_request_validation() -> None:
    with pytest.raises(ValueError, match="either release"):
        RolloutCreate(model="m", steps=[StepSpec(percent=10)])
    with pytest.raises(ValueError, match="must not shrink"):
        RolloutCreate(model="m", release=1, steps=[StepSpec(percent=50), StepSpec(percent=10)])
    with pytest.raises(ValueError, match="either percent or group"):
        StepSpec()


def test_a_ramp_admits_in_rank_order_at_its_pace_and_holds() -> None:
    ids = [f"dev-{i}" for i in range(2000)]
    steps: list[dict[str, Any]] = [{"percent": 10}, {"percent": 100}]
    cutoffs = [percent_cutoff([rank("m", d) for d in ids], 10, 1), 1.0]
    # 600 devices a minute out of 2,000 targeted: 0.005 of the rank range a second, from the 10 % step's cutoff
    ramp = Ramp(cutoffs[0], 1000.0, 600 / 60 / len(ids), 600 / 60 / len(ids), 1.0)
    before = Membership.of(RolloutTarget(), "m", steps, cutoffs, 0)
    counts = []
    for t in (1000.0, 1030.0, 1060.0, 1120.0, 2000.0):
        m = Membership.of(RolloutTarget(), "m", steps, cutoffs, 1, ramp=ramp)
        cut = m.current_cutoff(t)
        members = {d for d in ids if rank("m", d) <= cut}
        assert {d for d in ids if before.member(d, {}, {})} <= members  # nobody of an earlier step waits
        counts.append(len(members))
    assert counts[0] == pytest.approx(200, abs=1) and counts[-1] == 2000
    assert counts[1] - counts[0] == pytest.approx(300, rel=0.2)  # 30 s at 10 a second (ranks are even)
    assert counts[2] - counts[1] == pytest.approx(300, rel=0.2)
    finish = ramp.finish_at(1000.0)
    assert finish == pytest.approx(1000.0 + 1800 / 10, rel=0.02)  # 1,800 devices at 10 a second
    assert ramp.done(finish) and not ramp.done(finish - 5)
    held = ramp.held(1030.0)  # held: the cutoff stands still, and goes on from there when resumed
    assert held.cutoff(1500.0) == pytest.approx(ramp.cutoff(1030.0)) and held.finish_at(1500.0) is None
    resumed = held.resumed(1500.0)
    assert resumed.cutoff(1530.0) == pytest.approx(ramp.cutoff(1060.0))
    assert Ramp.load(resumed.dump()) == resumed and Ramp.load(None) is None


# ---- a registry with devices ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from registry_env(request, tmp_path_factory, "rollout", extra_args=["--rollout-tick", "1h"])


@dataclass
class Fleet:
    env: Env
    model: str
    client: Any
    devices: dict[str, ApiDevice]
    r1: int

    def rollout(self, version: int, steps: list[StepSpec], gates: Gates | None = None,
                target: RolloutTarget | None = None, *, admit_per_minute: float | None = None,
                start_at: float | None = None) -> Any:
        # the server is shared by the tests: a rollout targets this fleet's devices only
        mine = RolloutTarget(labels={"fleet": self.model})
        target = mine if target is None else target.model_copy(update={"labels": {**target.labels, **mine.labels}})
        spec = RolloutCreate(model=self.model, release=0, steps=steps, gates=gates or Gates(min_reporting=1),
                             target=target, admit_per_minute=admit_per_minute, start_at=start_at)
        return self.client.release_with_rollout(self.env.keys.load(), self.model, version, spec, expires_in_s=3600)

    def evaluate(self) -> dict[str, str]:
        out: dict[str, str] = self.client.evaluate_rollouts()
        return out

    def releases(self) -> dict[str, int | None]:
        return {d: dev.release(self.model) for d, dev in self.devices.items()}

    def on(self, release: int) -> set[str]:
        return {d for d, r in self.releases().items() if r == release}

    def blob(self, version: int) -> str:
        return str(next(f.sha256 for f in self.client.version(self.model, version).files if f.path == "labels.txt"))


def make_fleet(env: Env, layout: dict[str, tuple[dict[str, str], dict[str, Any]]], versions: int = 2) -> Fleet:
    """Push ``versions`` versions, release version 1 to everyone, enroll the devices of ``layout``."""
    model = f"m{next(_n)}"
    client = env.server.client()
    for v in range(1, versions + 1):
        client.push_folder(make_version(env.tmp / "pub" / model / str(v), salt=f"{model}-{v}"), model, v)
    r1 = client.release(env.keys.load(), model, 1, expires_in_s=3600).release
    devices = {}
    for name, (labels, facts) in layout.items():
        # labels are operator-owned: the enrollment token carries them, the device may only repeat them
        token = client.enrollment_token(labels={**labels, "fleet": model}).token
        devices[f"{model}-{name}"] = ApiDevice.enroll(env.url, token, f"{model}-{name}", {**labels, "fleet": model},
                                                      facts)
    return Fleet(env, model, client, devices, r1)


def plain(n: int) -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
    return {f"d{i}": ({}, {"profile": "x86-64-cpu"}) for i in range(n)}


def test_targeted_steps_progress_and_complete(env: Env) -> None:
    layout = {f"a{i}": ({"site": "a"}, {"profile": "jetson-orin-nano" if i % 2 == 0 else "x86-64-cpu"})
              for i in range(10)}
    layout.update({f"b{i}": ({"site": "b"}, {"profile": "jetson-orin-nano"}) for i in range(4)})
    f = make_fleet(env, layout)
    m = f.model
    targeted = {f"{m}-a{i}" for i in range(0, 10, 2)}
    first = f"{m}-a4"
    etags = {d: dev.poll().headers["etag"] for d, dev in f.devices.items()}
    ro = f.rollout(2, [StepSpec(group=RolloutTarget(devices=[first])), StepSpec(percent=40), StepSpec(percent=100)],
                   target=RolloutTarget(labels={"site": "a"}, profiles=["jetson-*"]))
    r2 = ro.release
    assert (ro.state, ro.step, ro.members) == ("running", 0, 1)
    assert f.on(r2) == {first}
    assert f.on(f.r1) == set(f.devices) - {first}
    # devices outside the step may not fetch the new files; the member may
    sha = f.blob(2)
    assert f.devices[first].blob(sha) == 200
    assert {f.devices[d].blob(sha) for d in f.devices if d != first} == {403}
    # unchanged decisions answer 304 to the old ETag; the member's changed
    for d, dev in f.devices.items():
        assert dev.poll(etags[d]).status_code == (200 if d == first else 304)
    assert f.evaluate() == {}  # nobody committed yet: the step is not ready
    f.devices[first].report(m, "downloading", r2, 2)
    st = f.client.rollout(ro.id)
    assert st.steps[0].counts["updating"] == 1 and st.targeted == 5
    f.devices[first].report(m, "committed", r2, 2)
    assert f.evaluate() == {str(ro.id): "step 2"}
    step2 = f.on(r2)
    assert first in step2 and step2 <= targeted and len(step2) >= 2
    for d in step2 - {first}:
        f.devices[d].report(m, "committed", r2, 2)
    assert f.evaluate() == {str(ro.id): "step 3"}
    assert f.on(r2) == targeted
    st = f.client.rollout(ro.id)
    assert [s.status for s in st.steps] == ["done", "done", "current"]
    assert st.steps[2].counts["pending"] == len(targeted - step2)
    for d in targeted - step2:
        f.devices[d].report(m, "committed", r2, 2)
    assert f.evaluate() == {str(ro.id): "completed"}
    st = f.client.rollout(ro.id)
    assert st.rollout.state == "completed" and st.totals["committed"] == 5
    assert f.on(f.r1) == set(f.devices) - targeted
    # a completed rollout still covers its whole target, also devices that enroll later
    token = f.client.enrollment_token(labels={"site": "a", "fleet": m}).token
    late = ApiDevice.enroll(env.url, token, f"{m}-late", {"site": "a", "fleet": m}, {"profile": "jetson-xavier"})
    assert late.release(m) == r2
    f.client.close()


def test_failure_gate_halts_and_members_return_to_last_known_good(env: Env) -> None:
    f = make_fleet(env, plain(6))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=50), StepSpec(percent=100)],
                   gates=Gates(max_failure_rate=0.2, min_reporting=2))
    members = f.on(ro.release)
    assert len(members) == 3
    a, b, c = sorted(members)
    f.devices[a].report(m, "rolled-back", ro.release, 2, "trial failed: error rate 20%")
    assert f.evaluate() == {}  # one finished device is below the minimum of two
    f.devices[b].report(m, "committed", ro.release, 2)
    assert f.evaluate() == {str(ro.id): "halted"}
    st = f.client.rollout(ro.id)
    assert st.rollout.state == "halted" and "failure_rate" in (st.rollout.reason or "")
    assert next(g for g in st.gates if g.gate == "failure_rate").ok is False
    # members (b committed it, c never started) are told to revert; the lower release is offered again
    for d in members:
        assert f.devices[d].reverts(m) == [ro.release]
        assert f.devices[d].release(m) == f.r1
    for d in set(f.devices) - members:
        assert f.devices[d].reverts(m) == [] and f.devices[d].release(m) == f.r1
    assert f.devices[c].blob(f.blob(2)) == 403
    with pytest.raises(Exception, match="halted"):
        f.client.rollout_action(ro.id, "resume")
    out = f.env.server.cli("rollout", "status", str(ro.id)).stdout
    assert "halted" in out and "ROLLED BACK" in out and "failure_rate" in out
    f.client.close()


def test_operator_pause_resume_abort_and_rollback(env: Env) -> None:
    f = make_fleet(env, plain(6), versions=3)
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=34), StepSpec(percent=100)])
    step1 = f.on(ro.release)
    with pytest.raises(Exception, match="running"):
        f.rollout(3, [StepSpec(percent=100)])  # one active rollout per model
    assert f.client.rollout_action(ro.id, "pause", "looking at a dashboard").state == "paused"
    for d in step1:
        f.devices[d].report(m, "committed", ro.release, 2)
    assert f.evaluate() == {}  # paused: no step is taken
    assert f.on(ro.release) == step1  # but the members keep it
    assert f.client.rollout_action(ro.id, "resume").state == "running"
    assert f.evaluate() == {str(ro.id): "step 2"}
    assert f.on(ro.release) == set(f.devices)
    # abort: devices that activated it keep it, the others never start it
    started = sorted(set(f.devices) - step1)[0]
    f.devices[started].report(m, "active-trial", ro.release, 2)
    assert f.client.rollout_action(ro.id, "abort").state == "aborted"
    assert f.on(ro.release) == step1 | {started}
    assert f.on(f.r1) == set(f.devices) - step1 - {started}
    # roll back by hand: every member returns to its last-known-good
    assert f.client.rollout_action(ro.id, "rollback", "customer complaint").state == "rolled-back"
    assert all(dev.reverts(m) == [ro.release] for dev in f.devices.values())
    assert f.on(f.r1) == set(f.devices)
    with pytest.raises(Exception, match="rolled-back"):
        f.client.rollout_action(ro.id, "pause")
    # the model is free for the next rollout, whose members still remember to stay off release 2
    ro3 = f.rollout(3, [StepSpec(percent=100)])
    assert f.on(ro3.release) == set(f.devices)
    # release 3 is above it: nothing to revert, except for a device whose last report says it is still on
    # trial with release 2 (it stops that trial now rather than commit it before taking release 3)
    assert f.devices[started].reverts(m) == [ro.release]
    assert all(dev.reverts(m) == [] for d, dev in f.devices.items() if d != started)
    f.client.close()


def test_a_paced_step_lets_its_devices_in_over_time_and_is_ready_only_when_all_are_in(env: Env) -> None:
    f = make_fleet(env, plain(40), versions=3)
    m = f.model
    # two devices a second: four at once, the other 36 over 18 s
    ro = f.rollout(2, [StepSpec(percent=100)], admit_per_minute=120)
    assert ro.admit_per_minute == 120 and ro.admission is not None and not ro.admission.held
    deadline = time.monotonic() + 20
    while not f.on(ro.release) and time.monotonic() < deadline:
        time.sleep(0.2)
    st = f.client.rollout(ro.id)
    assert sum(st.totals.values()) + st.not_admitted == 40 and st.not_admitted > 20
    now_on = f.releases()
    admitted = {d for d, r in now_on.items() if r == ro.release}
    assert 0 < len(admitted) < 40 and set(now_on.values()) == {ro.release, f.r1}
    sha = f.blob(2)  # a device not let in yet may not fetch the new files
    codes = {d: f.devices[d].blob(sha) for d in set(f.devices) - admitted}
    assert 403 in codes.values() and {d for d, c in codes.items() if c != 403} <= f.on(ro.release)
    for d in admitted:
        f.devices[d].report(m, "committed", ro.release, 2)
    assert f.evaluate() == {}  # every member so far committed, but the step is still letting devices in
    out = env.server.cli("rollout", "status", str(ro.id)).stdout
    assert "admitting at 120/min" in out and "waiting" in out
    # pausing holds admission: nobody else is let in until it resumes
    assert f.client.rollout_action(ro.id, "pause").state == "paused"
    held = f.client.rollout(ro.id)
    assert held.rollout.admission is not None and held.rollout.admission.held
    assert held.rollout.admission.reason == "rollout paused"
    frozen = f.on(ro.release)
    time.sleep(1.25)  # sleep-ok: more than two admissions' worth of time, in which nobody may be let in
    assert f.on(ro.release) == frozen
    assert f.client.rollout_action(ro.id, "abort").state == "aborted"
    # a rollout at its own, faster pace: everyone in within seconds, then ready and complete
    ro3 = f.rollout(3, [StepSpec(percent=100)], admit_per_minute=600)
    assert ro3.admission is not None and len(f.on(ro3.release)) < 40
    deadline = time.monotonic() + 30
    while len(f.on(ro3.release)) < 40 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f.on(ro3.release) == set(f.devices)
    # membership is by hash: every device may be in a moment before the ramp reaches its end
    wait_for(lambda: f.client.rollout(ro3.id).rollout.admission is None, 10, 0.1, "the admission ramp ended")
    for dev in f.devices.values():
        dev.report(m, "committed", ro3.release, 3)
    assert f.evaluate() == {str(ro3.id): "completed"}
    assert f.client.rollout(ro3.id).rollout.admission is None
    f.client.close()


def test_telemetry_gates_compare_with_the_previous_version(env: Env) -> None:
    f = make_fleet(env, plain(4))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=50), StepSpec(percent=100)],
                   gates=Gates(max_failure_rate=None, max_p99_ratio=2.0, min_requests=100, min_reporting=1))
    members = sorted(f.on(ro.release))
    others = sorted(set(f.devices) - set(members))
    f.devices[others[0]].telemetry(m, 1, ok=500, latency_s=0.004)
    f.devices[members[0]].telemetry(m, 2, ok=50, latency_s=0.2)
    assert f.evaluate() == {}  # 50 requests of the new version: not judged yet
    st = f.client.rollout(ro.id)
    assert next(g for g in st.gates if g.gate == "p99_ratio").judged is False
    f.devices[members[0]].telemetry(m, 2, ok=500, latency_s=0.2)
    assert f.evaluate() == {str(ro.id): "halted"}
    reason = f.client.rollout(ro.id).rollout.reason or ""
    assert "p99_ratio" in reason
    # the error-rate gate, on another model
    g = make_fleet(env, plain(4))
    ro = g.rollout(2, [StepSpec(percent=50), StepSpec(percent=100)],
                   gates=Gates(max_failure_rate=None, max_error_rate=0.05, min_requests=100, min_reporting=1))
    member = sorted(g.on(ro.release))[0]
    other = sorted(set(g.devices) - g.on(ro.release))[0]
    g.devices[other].telemetry(g.model, 1, ok=1000, errors=2)
    g.devices[member].telemetry(g.model, 2, ok=450, errors=50)
    assert g.evaluate() == {str(ro.id): "halted"}
    assert "error_rate" in (g.client.rollout(ro.id).rollout.reason or "")
    f.client.close()
    g.client.close()


def test_cli_create_status_and_controls(env: Env) -> None:
    f = make_fleet(env, plain(5))
    m = f.model
    srv = env.server
    folder = env.tmp / "pub" / m / "2"
    out = srv.cli("rollout", "create", m, "2", "--key", str(env.keys.path), "--steps",
                  f"devices:{m}-d0/soak=0,60%/min=2,100%", "--soak", "5m", "--min-reporting", "1",
                  "--target-label", f"fleet={m}",
                  "--max-p99-ratio", "1.5", "--target-profile", "x86-*", "--notes", "cli test", "--json").stdout
    info = json.loads(out)
    assert info["steps"][0]["group"]["devices"] == [f"{m}-d0"] and info["steps"][0]["soak_s"] == 0
    assert info["steps"][1] == {"percent": 60.0, "group": None, "min_devices": 2, "soak_s": 300.0,
                                "max_failure_rate": None, "min_reporting": None}
    assert info["gates"]["max_p99_ratio"] == 1.5 and info["target"]["profiles"] == ["x86-*"]
    assert f.on(info["release"]) == {f"{m}-d0"}
    text = srv.cli("rollout", "status", "--model", m).stdout
    for heading in ("STEP", "SELECT", "PENDING", "UPDATING", "IN TRIAL", "COMMITTED", "ROLLED BACK", "FAILED"):
        assert heading in text
    assert f"rollout {info['id']}" in text and "running" in text
    assert "paused" in srv.cli("rollout", "pause", str(info["id"]), "--reason", "lunch").stdout
    listed = json.loads(srv.cli("rollout", "list", "--model", m, "--json").stdout)
    assert [r["state"] for r in listed] == ["paused"]
    assert "running" in srv.cli("rollout", "resume", str(info["id"])).stdout
    assert "aborted" in srv.cli("rollout", "abort", str(info["id"])).stdout
    bad = srv.cli("rollout", "resume", str(info["id"]), check=False)
    assert bad.returncode == 1 and "aborted" in bad.stderr
    assert "rolled-back" in srv.cli("rollout", "rollback", str(info["id"])).stdout
    # roll out an existing release (here: one made without a rollout, so already live)
    assert folder.is_dir()
    r = srv.cli("rollout", "create", m, "--release", str(f.r1), "--steps", "100%", "--target-label", f"fleet={m}",
                "--json")
    assert json.loads(r.stdout)["release"] == f.r1
    f.client.close()


def _complete(f: Fleet, version: int) -> int:
    """Roll ``version`` out to the whole fleet (one 100 % step) with every device committing it."""
    ro = f.rollout(version, [StepSpec(percent=100)])
    for dev in f.devices.values():
        dev.report(f.model, "committed", ro.release, version)
    assert f.evaluate() == {str(ro.id): "completed"}
    return int(ro.release)


def test_fleet_rollback_to_previous_twice_and_to_a_named_release(env: Env) -> None:
    f = make_fleet(env, plain(4), versions=3)
    m, key = f.model, env.keys.load()
    r2 = _complete(f, 2)
    r3 = _complete(f, 3)
    plan = f.client.rollback_plan(m)
    assert (plan.current_release, plan.to_release, plan.version, plan.next_release) == (r3, r2, 2, r3 + 1)
    # "previous" once: version 2 comes back as a new, higher release, so no device refuses it as older
    back = f.client.rollback(key, m, reason="bad answers", expires_in_s=3600)
    assert (back.release, back.version, back.restores, back.stopped_rollouts) == (r3 + 1, 2, r2, [])
    assert f.on(back.release) == set(f.devices) and all(d.reverts(m) == [] for d in f.devices.values())
    # "previous" again walks back past what the rollback restored (version 1), not back up to version 3
    again = f.client.rollback(key, m, expires_in_s=3600)
    assert (again.version, again.restores) == (1, f.r1) and f.on(again.release) == set(f.devices)
    # a rollback during a rollout: it is rolled back, its device on trial stops now, everyone gets the target
    ro = f.rollout(2, [StepSpec(percent=50), StepSpec(percent=100)])
    members = sorted(f.on(ro.release))
    f.devices[members[0]].report(m, "active-trial", ro.release, 2)
    out = json.loads(env.server.cli("rollback", m, "--to", str(r3), "--key", str(env.keys.path), "--json").stdout)
    assert out["version"] == 3 and out["restores"] == r3 and out["stopped_rollouts"] == [ro.id]
    assert f.client.rollout(ro.id).rollout.state == "rolled-back"
    assert f.on(out["release"]) == set(f.devices)
    assert f.devices[members[0]].reverts(m) == [ro.release]  # on trial with it: stop now
    assert all(f.devices[d].reverts(m) == [] for d in set(f.devices) - {members[0]})
    last = f.client.releases(m)[-1]
    assert last.restores == r3 and (last.notes or "").startswith(f"rollback to release {r3}")
    # refusals: nothing to go back to, the current release itself, a revoked one
    with pytest.raises(Exception, match="already the current release"):
        f.client.rollback_plan(m, str(out["release"]))
    f.client.revoke(m, r2)
    with pytest.raises(Exception, match="revoked"):
        f.client.rollback_plan(m, str(r2))
    dry = env.server.cli("rollback", m, "--to", "1", "--dry-run").stdout
    assert f"-> release {f.r1} (version 1)" in dry
    f.client.close()


def test_quality_gate_compares_evaluation_scores_with_last_known_good(env: Env) -> None:
    f = make_fleet(env, plain(6), versions=3)
    m = f.model
    gates = Gates(max_quality_drop=0.02, min_quality=0.5, min_reporting=2)
    # a version without an evaluation set cannot carry a quality gate: refused before any device sees it
    with pytest.raises(Exception, match=r"no \[evaluation\] set"):
        f.rollout(2, [StepSpec(percent=50), StepSpec(percent=100)], gates=gates)
    for v in (4, 5):
        folder = make_version(env.tmp / "pub" / m / str(v), salt=f"{m}-{v}")
        with (folder / "model.toml").open("a") as out:
            out.write(write_evaluation_set(folder, samples=20))
        f.client.push_folder(folder, m, v)
    # good: scores within the allowed drop; the step waits for enough scores before it is ready
    ro = f.rollout(4, [StepSpec(percent=50), StepSpec(percent=100)], gates=gates)
    members = sorted(f.on(ro.release))
    assert len(members) == 3
    for d in members[:1]:
        f.devices[d].report(m, "active-trial", ro.release, 4,
                            quality={"samples": 20, "score": 0.95, "baseline_version": 1, "baseline_score": 0.96})
        f.devices[d].report(m, "committed", ro.release, 4)
    assert f.evaluate() == {}  # one score of the two needed: not judged, so not ready
    # a device outside the rollout sends a score for the release too: it does not count
    outsider = sorted(set(f.devices) - set(members))[0]
    f.devices[outsider].report(m, "active-trial", ro.release, 4,
                               quality={"samples": 20, "score": 0.96, "baseline_version": 1, "baseline_score": 0.96})
    assert f.evaluate() == {}
    reading = next(g for g in f.client.rollout(ro.id).gates if g.gate == "quality_drop")
    assert reading.judged is False
    f.devices[members[1]].report(m, "active-trial", ro.release, 4,
                                 quality={"samples": 20, "score": 0.97, "baseline_version": 1, "baseline_score": 0.96})
    f.devices[members[1]].report(m, "committed", ro.release, 4)
    assert f.evaluate() == {str(ro.id): "step 2"}
    st = f.client.rollout(ro.id)
    reading = next(g for g in st.gates if g.gate == "quality_drop")
    assert reading.judged and reading.ok and abs((reading.value or 0) - 0.0) < 1e-9
    assert f.client.rollout_action(ro.id, "abort").state == "aborted"
    # bad: right answers fell from 0.96 to 0.1 on the same samples: halted, members told to revert
    bad = f.rollout(5, [StepSpec(percent=50), StepSpec(percent=100)], gates=gates)
    members = sorted(f.on(bad.release))
    for d in members[:2]:
        f.devices[d].report(m, "active-trial", bad.release, 5,
                            quality={"samples": 20, "score": 0.1, "baseline_version": 4, "baseline_score": 0.96})
    for d in sorted(set(f.devices) - set(members)):  # outsiders claiming perfect scores dilute nothing
        f.devices[d].report(m, "active-trial", bad.release, 5,
                            quality={"samples": 20, "score": 1.0, "baseline_version": 4, "baseline_score": 0.96})
    assert f.evaluate() == {str(bad.id): "halted"}
    st = f.client.rollout(bad.id)
    assert st.rollout.step == 0 and "quality_drop" in (st.rollout.reason or "")
    assert "min_quality" in (st.rollout.reason or "")
    assert all(f.devices[d].reverts(m) == [bad.release] for d in members)
    text = env.server.cli("rollout", "status", str(bad.id)).stdout
    assert "gate quality_drop: 0.86 (limit 0.02) CROSSED" in text
    f.client.close()


# ---- per-step thresholds, scheduled starts, the actions each state offers (issue 40) ---------------
def test_step_options_carry_thresholds_and_start_times_read_as_dates() -> None:
    steps = parse_steps("label:ring=canary/failure=0/reporting=2, 10%/failure=5%, 100%", soak_s=60, min_devices=1,
                        duration=duration_s)
    assert (steps[0].max_failure_rate, steps[0].min_reporting) == (0.0, 2)
    assert (steps[1].max_failure_rate, steps[1].min_reporting) == (0.05, None)
    assert steps[2].max_failure_rate is None
    assert steps[0].describe() == "ring=canary (failure rate <= 0%, min 2 reporting)"
    judged = steps[0].judged_by(Gates(max_failure_rate=0.2, min_reporting=5, max_p99_ratio=1.5))
    assert (judged.max_failure_rate, judged.min_reporting, judged.max_p99_ratio) == (0.0, 2, 1.5)
    for bad in ("10%/failure=2", "10%/failure=x", "10%/reporting=0"):
        with pytest.raises(ConfigError):
            parse_steps(bad, soak_s=0, min_devices=1, duration=duration_s)
    assert start_time("+2h", now=1000.0) == 1000.0 + 7200
    assert start_time("2026-12-24T18:00Z") == start_time("2026-12-24T18:00") == start_time("2026-12-24T19:00+01:00")
    assert start_time("") is None and start_time("now") is None
    with pytest.raises(ConfigError, match="ISO-8601"):
        start_time("tomorrow")


def test_a_step_with_its_own_thresholds_is_judged_by_them(env: Env) -> None:
    f = make_fleet(env, plain(6))
    m = f.model
    # the rollout allows half its devices to fail and judges after one; its canary step allows none after two
    ro = f.rollout(2, [StepSpec(percent=34, min_devices=2, max_failure_rate=0.0, min_reporting=2),
                       StepSpec(percent=100)], gates=Gates(max_failure_rate=0.5, min_reporting=1))
    a, b = sorted(f.on(ro.release))[:2]
    f.devices[a].report(m, "rolled-back", ro.release, 2, "trial failed")
    assert f.evaluate() == {}  # the step's own minimum: two must finish (the rollout's one would judge 1/1 > 0.5)
    rate = next(g for g in f.client.rollout(ro.id).gates if g.gate == "failure_rate")
    assert (rate.limit, rate.judged) == (0.0, False) and "step 1's own limit" in rate.detail
    f.devices[b].report(m, "committed", ro.release, 2)
    assert f.evaluate() == {str(ro.id): "halted"}  # 1 of 2 = 0.5: within the rollout's gate, over the step's
    st = f.client.rollout(ro.id)
    assert "failure_rate 0.5 > 0" in (st.rollout.reason or "")
    frozen = [g.model_dump() for g in st.gates]
    assert next(g for g in st.gates if g.gate == "failure_rate").ok is False
    f.devices[b].report(m, "rolled-back", ro.release, 2, "returned to last-known-good")  # the fleet moves on
    assert [g.model_dump() for g in f.client.rollout(ro.id).gates] == frozen
    text = env.server.cli("rollout", "status", str(ro.id)).stdout
    assert "failure rate <= 0%, min 2 reporting" in text and "gate failure_rate: 0.5 (limit 0) CROSSED" in text
    # the CLI takes the same vocabulary
    out = json.loads(env.server.cli("rollout", "create", m, "--release", str(f.r1), "--steps",
                                    "34%/failure=5%/reporting=2,100%", "--target-label", f"fleet={m}",
                                    "--json").stdout)
    assert (out["steps"][0]["max_failure_rate"], out["steps"][0]["min_reporting"]) == (0.05, 2)
    f.client.close()


def test_a_scheduled_rollout_admits_nobody_before_its_time(env: Env) -> None:
    f = make_fleet(env, plain(3), versions=3)
    m = f.model
    # an hour ahead: what it shows, what it refuses (only abort is possible)
    ahead = f.rollout(3, [StepSpec(percent=100)], start_at=time.time() + 3600)
    assert (ahead.state, ahead.members) == ("scheduled", 0) and ahead.start_at is not None
    with pytest.raises(Exception, match="scheduled"):
        f.rollout(2, [StepSpec(percent=100)])  # one unfinished rollout per model, a scheduled one too
    st = f.client.rollout(ahead.id)
    assert [s.status for s in st.steps] == ["waiting"] and st.totals["pending"] == 0
    for action in ("pause", "resume", "rollback"):
        with pytest.raises(Exception, match="scheduled"):
            f.client.rollout_action(ahead.id, action)
    text = env.server.cli("rollout", "status", str(ahead.id)).stdout
    assert re.search(r"scheduled: starts \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(in (59m|60m)\)", text), text
    listed = env.server.cli("rollout", "list", "--model", m).stdout
    assert "scheduled  starts " in listed and str(int(ahead.start_at)) not in listed
    assert f.client.rollout_action(ahead.id, "abort").state == "aborted"
    # 2 s ahead: nobody is offered it or may fetch its files until then; the first evaluation after starts it
    ro = f.rollout(2, [StepSpec(percent=100)], start_at=time.time() + 2.0)
    assert ro.state == "scheduled"
    assert f.on(ro.release) == set() and f.on(f.r1) == set(f.devices)
    assert {dev.blob(f.blob(2)) for dev in f.devices.values()} == {403}
    states = {r.release: r.state for r in f.client.releases(m)}
    assert (states[ro.release], states[f.r1]) == ("scheduled", "valid")  # it supersedes nothing yet
    if time.time() < (ro.start_at or 0):
        assert str(ro.id) not in f.evaluate()
    wait_for(lambda: time.time() >= (ro.start_at or 0), 10, 0.1, "the start time")
    assert f.evaluate().get(str(ro.id)) == "started"
    assert f.on(ro.release) == set(f.devices)
    assert f.client.rollout(ro.id).rollout.state == "running"
    assert f.client.rollout_action(ro.id, "abort").state == "aborted"
    assert f.client.rollout(ahead.id).rollout.state == "aborted"  # the aborted scheduled one never started
    # a fleet rollback stops a scheduled rollout too: aborted (it has no member to send back)
    later = f.rollout(3, [StepSpec(percent=100)], start_at=time.time() + 3600)
    back = f.client.rollback(env.keys.load(), m, str(f.r1), reason="not now", expires_in_s=3600)
    assert back.stopped_rollouts == [later.id] and f.client.rollout(later.id).rollout.state == "aborted"
    assert all(dev.reverts(m) == [] for dev in f.devices.values())
    f.client.close()


def _buttons(h: Any, url: str, rollout_id: int) -> set[str]:
    r = h.get(f"{url}/ui/rollouts/{rollout_id}")
    assert r.status_code == 200, r.text
    return set(re.findall(r'id="action-([a-z]+)"', r.text))


def test_every_action_offered_is_accepted_and_every_refused_one_is_not_offered(env: Env) -> None:
    f = make_fleet(env, plain(2))
    m = f.model
    actions = {"pause", "resume", "abort", "rollback"}

    def make(state: str) -> int:
        ro = f.rollout(2, [StepSpec(percent=100)], gates=Gates(min_reporting=1),
                       start_at=time.time() + 3600 if state == "scheduled" else None)
        rid = int(ro.id)
        if state in ("paused", "rolled-back", "aborted"):
            f.client.rollout_action(rid, {"paused": "pause", "rolled-back": "rollback", "aborted": "abort"}[state])
        elif state in ("halted", "completed"):
            for dev in f.devices.values():
                dev.report(m, "committed" if state == "completed" else "failed", ro.release, 2)
            assert f.evaluate().get(str(rid)) == state
        assert f.client.rollout(rid).rollout.state == state
        return rid

    def finish(rid: int) -> None:
        if f.client.rollout(rid).rollout.state in ("scheduled", "running", "paused"):
            f.client.rollout_action(rid, "abort")

    offered: dict[str, set[str]] = {}
    with httpx.Client(base_url=env.url, timeout=30, follow_redirects=False) as h:
        assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
        for state in ("scheduled", "running", "paused", "halted", "aborted", "rolled-back", "completed"):
            rid = make(state)
            shown = offered[state] = _buttons(h, env.url, rid)
            for action in sorted(actions - shown):  # refused by the API, and the state stays
                r = web().post(f"{env.url}/api/v1/rollouts/{rid}/{action}", headers=env.admin(), json={})
                assert r.status_code == 409, (state, action, r.text)
            assert f.client.rollout(rid).rollout.state == state
            for i, action in enumerate(sorted(shown)):  # each offered one is accepted (a fresh rollout each)
                target = rid if i == 0 else make(state)
                r = web().post(f"{env.url}/api/v1/rollouts/{target}/{action}", headers=env.admin(), json={})
                assert r.status_code == 200, (state, action, r.text)
                finish(target)
            finish(rid)
    assert offered == {"scheduled": {"abort"}, "running": {"pause", "abort", "rollback"},
                       "paused": {"resume", "abort", "rollback"}, "halted": set(), "aborted": {"rollback"},
                       "rolled-back": set(), "completed": {"rollback"}}
    f.client.close()


def test_a_failed_reports_log_lines_are_bounded_stored_and_shown_escaped(env: Env) -> None:
    f = make_fleet(env, plain(1))
    m, (dev_id, dev) = f.model, next(iter(f.devices.items()))
    for logs, status in ((["ok"] * 51, 413), (["x" * 257], 413), (["é" * 200] * 41, 413),  # 51 lines; 257 chars;
                         (["bell \x07"], 422)):                                             # 16 KiB; a control char
        r = dev.report(m, "failed", f.r1, 1, "load failed", logs=logs, expect=status)
        assert "logs" in r.text
    lines = ["2026-12-06T05:00:00Z WARNING edged.core: <script>alert(1)</script> did not load", "é" * 256]
    dev.report(m, "failed", f.r1, 1, "prepare failed", logs=lines)
    r = send_as_a_device("POST", f"{env.url}/api/v1/device/reports", dev.auth, {"events": [  # free-form detail
        {"seq": dev.seq + 1, "model": m, "step": "failed", "release": f.r1, "detail": {"logs": ["forged"]},
         "at": time.time()}]})
    assert r.status_code == 200, r.text
    events = f.client.device(dev_id, events=10).events
    assert [e.logs for e in events[-2:]] == [lines, []] and "logs" not in events[-1].detail
    text = env.server.cli("device", dev_id).stdout
    assert "the device's last 2 log line(s):" in text and "| " + lines[0] in text
    with httpx.Client(base_url=env.url, timeout=30) as h:
        assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
        page = h.get(f"/ui/devices/{dev_id}").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; did not load" in page and "<script>alert" not in page
    f.client.close()
