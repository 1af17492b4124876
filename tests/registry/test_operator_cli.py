"""The operator's view tells the truth: ``edged-registry devices|device|status|telemetry|rollout status``.

A real registry (SQLite; PostgreSQL in the slow set) and the real CLI in a subprocess; devices speak the
real device API (enroll, facts, reports, telemetry uploads), so what the CLI prints comes
from what devices said.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from edged.latency_buckets import LATENCY_BUCKETS_S
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from tests.fresh import imported_by
from tests.http_client import web
from tests.polling import wait_until
from tests.registry.conftest import Env, registry_env
from tests.registry_helpers import make_version
from tests.rollout_helpers import send_as_a_device

LONG_REASON = ("trial failed: error rate 0.31 over 600 requests is above the 0.05 allowed; the last error was "
               "INVALID_ARGUMENT input 'pixels' expects shape [64] and got [63] from the camera pipeline at "
               "stage crop-and-resize; see the daemon's journal for the full trace (this text is long on purpose)")
ENGINE = "onnxruntime-cpu-fp32"
_seq = itertools.count(1)


# What is checked here is the CLI's reading and printing of what the API answers, the same whichever
# database stores it (tests/registry/test_registry.py and test_rollout.py hold the store on both): the
# PostgreSQL repeat runs with the slow set (python -m pytest -m slow).
@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from registry_env(request, tmp_path_factory, "opcli")


class Device:
    def __init__(self, env: Env, device_id: str) -> None:
        self.env, self.id = env, device_id
        with env.server.client() as c:
            token = c.enrollment_token().token
        r = web().post(f"{env.url}/api/v1/enroll", json={"token": token, "device_id": device_id,
                                                          "facts": {"profile": "x86-64-cpu"}})
        assert r.status_code == 200, r.text
        self.h = {"Authorization": f"Bearer {r.json()['credential']}"}
        self.seq = 0
        self.tseq = 0

    def report(self, model: str, step: str, version: int, release: int, *, reason: str | None = None,
               detail: dict[str, Any] | None = None) -> None:
        self.seq += 1
        r = send_as_a_device("POST", f"{self.env.url}/api/v1/device/reports", self.h, {"events": [
            {"seq": self.seq, "model": model, "step": step, "version": version, "release": release,
             "reason": reason, "detail": detail or {}, "at": time.time()}]})
        assert r.status_code == 200, r.text

    def serving(self, model: str, version: int, release: int) -> None:
        r = web().put(f"{self.env.url}/api/v1/device/facts", headers=self.h, json={
            "facts": {"profile": "x86-64-cpu", "n": next(_seq)},
            "serving": [{"model": model, "version": version, "release": release, "state": "committed"}]})
        assert r.status_code == 200, r.text

    def telemetry(self, model: str, version: int, ok: int, failed: int, slow_ms: float) -> None:
        """One 60 s window: ``ok`` requests at 2 ms but 5 % of them at ``slow_ms``, ``failed`` failures."""
        counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        fast = next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= 0.002)
        slow = next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= slow_ms / 1000)
        counts[slow] += ok // 20
        counts[fast] += ok - ok // 20
        self.tseq += 1
        r = send_as_a_device("POST", f"{self.env.url}{INGEST_PATH}", self.h, {"buffer_id": f"buf-{self.id}", "items": [
            {"device": self.id, "seq": self.tseq, "run": "run1", "t": time.time(), "window_s": 60.0,
             "uptime_s": 100.0, "profile": "x86-64-cpu",
             "models": [{"model": model, "version": version, "backend": ENGINE, "success": ok,
                         "failures": {"internal": failed} if failed else {},
                         "latency": {"counts": counts, "sum_s": ok * 0.002}}]}]})
        assert r.status_code == 200, r.text


def cli(env: Env, *args: str) -> str:
    return env.server.cli(*args).stdout


def test_devices_show_what_they_serve_their_desired_release_and_full_reasons(env: Env) -> None:
    model = f"serve-{env.backend}"
    with env.server.client() as c:
        for v in (1, 2):
            c.push_folder(make_version(env.tmp / "pub" / model / str(v), salt=f"{model}{v}"), model, v)
        r1 = c.release(env.keys.load(), model, 1, expires_in_s=3600).release
    a, b = Device(env, f"{model}-a"), Device(env, f"{model}-b")
    for d in (a, b):
        d.report(model, "committed", 1, r1)
        d.serving(model, 1, r1)
        d.telemetry(model, 1, 500, 0, 8)
    b.report(model, "failed", 1, r1, reason=LONG_REASON)
    with env.server.client() as c:
        r2 = c.release(env.keys.load(), model, 2, expires_in_s=3600).release  # offered to both, taken by neither

    out = cli(env, "devices")
    line = next(ln for ln in out.splitlines() if ln.startswith(f"{model}-a "))
    assert f"v1 (r{r1})" in line and ENGINE in line and f"v2 (r{r2})" in line and f"committed r{r1}" in line
    assert re.search(r"\b\d+s ago\b", line) and not re.search(r"\b1[0-9]{9}\b", out)  # relative, not an epoch
    # the whole reason, wrapped over lines, nothing cut
    words = " ".join(out.split())
    assert " ".join(LONG_REASON.split()) in words
    data = json.loads(cli(env, "devices", "--json"))
    mine = next(d for d in data if d["device_id"] == f"{model}-a")
    assert mine["serving"] == [{"model": model, "version": 1, "release": r1, "state": "committed", "engine": ENGINE,
                                "desired_release": r2, "desired_version": 2}]

    one = cli(env, "device", f"{model}-b")
    assert f"serving v1 (r{r1}) (committed), engine {ENGINE}" in one and f"desired v2 (r{r2})" in one
    assert " ".join(LONG_REASON.split()) in " ".join(one.split()) and "ago" in one
    assert json.loads(cli(env, "device", f"{model}-b", "--json"))["models"][0]["reason"] == LONG_REASON


def test_telemetry_command_prints_rates_errors_and_percentiles(env: Env) -> None:
    model = f"tele-{env.backend}"
    with env.server.client() as c:
        c.push_folder(make_version(env.tmp / "pub" / model / "1", salt=f"{model}1"), model, 1)
        c.push_folder(make_version(env.tmp / "pub" / model / "2", salt=f"{model}2"), model, 2)
    a, b = Device(env, f"{model}-a"), Device(env, f"{model}-b")
    a.telemetry(model, 1, 1000, 10, 40)
    b.telemetry(model, 1, 500, 40, 40)
    b.telemetry(model, 2, 200, 0, 90)

    out = cli(env, "telemetry", model, "--since", "10m")
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:] if ln.strip() and ln.split()[0] in ("1", "2",
                                                                                                         "all")}
    assert rows["1"][1:6] == ["2", "1550", rows["1"][3], "50", "3.23%"], out
    assert rows["2"][1:3] == ["1", "200"] and rows["2"][4:6] == ["0", "0.00%"]
    assert rows["all"][2] == "1750"
    assert float(rows["2"][8]) > float(rows["1"][8]) > float(rows["1"][6])  # p99 above p50; v2 slower
    assert ENGINE in out and "internal 50" in out

    js = json.loads(cli(env, "telemetry", model, "--device", f"{model}-a", "--json"))
    assert len(js) == 1 and js[0]["success"] == 1000 and js[0]["failures"] == 10 and js[0]["device_id"] == f"{model}-a"
    assert js[0]["rate_per_s"] == pytest.approx(1010 / 60, rel=0.05)
    js = json.loads(cli(env, "telemetry", model, "--version", "2", "--json"))
    assert [x["version"] for x in js] == [2] and js[0]["p99_s"] is not None
    assert "no telemetry" in cli(env, "telemetry", model, "--device", "nobody")

    # The operator's command reads the answer with the contract's models, not the registry server's: FastAPI
    # and SQLAlchemy cost about half a second of imports on every call.
    code = (f"import contextlib, io, json, os; os.environ.update({env.server.cli_env()!r})\n"
            "from edged.registry.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"    assert main(['telemetry', {model!r}, '--json']) == 0\n"
            "assert json.loads(out.getvalue())[0]['samples'] > 0, out.getvalue()")
    assert imported_by(code, ["fastapi", "sqlalchemy", "edged.registry.telemetry_ingest"]) == []


def test_rolled_back_rollout_shows_members_as_they_ended_and_status_tells_the_truth(env: Env) -> None:
    model = f"roll-{env.backend}"
    with env.server.client() as c:
        for v in (1, 2):
            c.push_folder(make_version(env.tmp / "pub" / model / str(v), salt=f"{model}{v}"), model, v)
        r1 = c.release(env.keys.load(), model, 1, expires_in_s=3600).release
        devs = [Device(env, f"{model}-{i}") for i in range(3)]
        for d in devs:
            d.report(model, "committed", 1, r1)
        ro = c.release_with_rollout(env.keys.load(), model, 2, RolloutCreate(
            model=model, release=0, target={"devices": [d.id for d in devs]},
            steps=[StepSpec(percent=100, soak_s=3600)],
            gates=Gates(max_failure_rate=None, min_reporting=1)), expires_in_s=3600)
    r2 = ro.release
    trial = {"requests": 600, "errors": 1, "p99_ms": 7.5}
    for d in devs[:2]:
        d.report(model, "downloading", 2, r2)
        d.report(model, "active-trial", 2, r2)
        d.report(model, "committed", 2, r2, detail=trial)
    cli(env, "rollout", "rollback", str(ro.id), "--reason", "operator test")
    # the devices go back to their last-known-good and say so; then report release 1 again
    for d in devs[:2]:
        d.report(model, "rolled-back", 2, r2, reason="the registry asked to return to the last-known-good: operator "
                                                   "test", detail={"serving": 1, "from": "committed"})
        d.report(model, "committed", 1, r1, detail={"note": "this version was already serving"})

    st = json.loads(cli(env, "rollout", "status", str(ro.id), "--members", "--json"))
    assert st["totals"]["pending"] == 0
    assert st["totals"]["rolled_back"] == 2 and st["totals"]["not_started"] == 1
    members = {m["device_id"]: m for m in st["members"]}
    assert members[f"{model}-2"]["progress"] == "not_started"
    assert members[f"{model}-0"]["progress"] == "rolled_back" and "operator test" in members[f"{model}-0"]["reason"]
    text = cli(env, "rollout", "status", str(ro.id), "--members")
    assert "NOT STARTED" in text and "ROLLED BACK" in text and "PENDING" in text  # the column exists, at 0
    total = next(ln for ln in text.splitlines() if " total " in f" {ln} ")
    assert total.split()[1:3] == ["3", "0"]  # devices, pending
    assert f"{model}-0" in text and "rolled back" in text

    status = cli(env, "status", model)
    line2 = next(ln for ln in status.splitlines() if f"release {r2} " in ln)
    assert "no reports" not in line2 and "2 device(s) committed it earlier" in line2
    line1 = next(ln for ln in status.splitlines() if f"release {r1} " in ln)
    assert "committed 3" in line1


def test_pausing_a_rollout_stops_its_soak_clock(env: Env) -> None:
    model = f"pause-{env.backend}"
    with env.server.client() as c:
        for v in (1, 2):
            c.push_folder(make_version(env.tmp / "pub" / model / str(v), salt=f"{model}{v}"), model, v)
        c.release(env.keys.load(), model, 1, expires_in_s=3600)
        d = Device(env, f"{model}-0")
        ro = c.release_with_rollout(env.keys.load(), model, 2, RolloutCreate(
            model=model, release=0, target={"devices": [d.id]}, steps=[StepSpec(percent=100, soak_s=3)],
            gates=Gates(min_reporting=1)), expires_in_s=3600)
        d.report(model, "committed", 2, ro.release)
        c.evaluate_rollouts()
        ready = c.rollout(ro.id)
        assert ready.rollout.step_ready_at is not None and ready.soak_left_s is not None
        c.rollout_action(ro.id, "pause")
        time.sleep(3.5)  # sleep-ok: longer than the whole soak, which must not run on while paused
        paused = c.rollout(ro.id)
        assert paused.soak_left_s == pytest.approx(ready.soak_left_s, abs=1.0)  # frozen while paused
        assert f"paused, {paused.soak_left_s:.0f}s of soak left" in cli(env, "rollout", "status", str(ro.id))
        c.rollout_action(ro.id, "resume")
        c.evaluate_rollouts()
        after = c.rollout(ro.id)
        assert after.rollout.state == "running" and after.soak_left_s is not None and after.soak_left_s > 1.5

        def completed() -> bool:
            c.evaluate_rollouts()
            return c.rollout(ro.id).rollout.state == "completed"

        wait_until(completed, after.soak_left_s + 30, 0.2, "the resumed soak to complete the rollout")
