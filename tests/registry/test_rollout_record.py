"""A finished rollout's record and the actions its page offers (issue 40, items 4 and 5), against a real registry
process with devices driven over its HTTP API, evaluations triggered by hand (as in ``test_rollout.py``)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from edged.registry.rollout_wire import Gates, StepSpec
from tests.registry.conftest import Env, registry_env
from tests.registry.test_rollout import make_fleet, plain
from tests.registry_helpers import ADMIN_TOKEN

ONLINE_S = 1.5  # a device that has not called for this long is offline on the pages


@pytest.fixture(scope="module", params=["sqlite"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    conf = tmp_path_factory.mktemp("record-conf") / "registry.toml"
    conf.write_text(f"[registry]\ndashboard_online_s = {ONLINE_S}\nlast_seen_flush_s = 0.3\n")
    yield from registry_env(request, tmp_path_factory, "record",
                            extra_args=["--config", str(conf), "--rollout-tick", "1h"])


def gates(st: Any) -> list[dict[str, Any]]:
    return [g.model_dump() for g in st.gates]


def signed_in(env: Env) -> httpx.Client:
    h = httpx.Client(base_url=env.url, timeout=30, follow_redirects=False)
    assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
    return h


def offered(page: str) -> set[str]:
    return {a for a in ("pause", "resume", "abort", "rollback") if f'id="action-{a}"' in page}


def test_a_completed_rollouts_gates_do_not_change_after_the_fact(env: Env) -> None:
    f = make_fleet(env, plain(2))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=100)], Gates(max_failure_rate=0.1, min_reporting=2))
    for dev in f.devices.values():
        dev.report(m, "committed", ro.release, 2)
    assert f.evaluate() == {str(ro.id): "completed"}
    at_end = f.client.rollout(ro.id)
    assert all(g["ok"] for g in gates(at_end)), gates(at_end)
    # Later the fleet moves on: the operator rolls back to release 1 and every device reports it left release 2.
    for dev in f.devices.values():
        dev.report(m, "rolled-back", ro.release, 1, reason="operator rollback to release 1")
    later = f.client.rollout(ro.id)
    assert gates(later) == gates(at_end), "the finished rollout's gate table changed after it completed"
    h = signed_in(env)
    page = h.get(f"/ui/rollouts/{ro.id}").text
    assert "CROSSED" not in page
    assert offered(page) == {"rollback"}, "a completed rollout can only be rolled back"
    assert [s.status for s in later.steps] == ["done"]
    h.close()


def test_a_halted_rollout_keeps_its_crossed_gate_offers_only_what_it_accepts_and_reads_halted(env: Env) -> None:
    f = make_fleet(env, plain(2))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=100, min_devices=2), StepSpec(percent=100)],
                   Gates(max_failure_rate=0.1, min_reporting=2))
    devs = list(f.devices.values())
    devs[0].report(m, "failed", ro.release, 2, reason="prepare failed: golden check")
    devs[1].report(m, "committed", ro.release, 2)
    assert f.evaluate() == {str(ro.id): "halted"}
    st = f.client.rollout(ro.id)
    crossed = [g for g in gates(st) if not g["ok"]]
    assert [g["gate"] for g in crossed] == ["failure_rate"] and "failure_rate" in (st.rollout.reason or "")
    assert [s.status for s in st.steps] == ["halted", "not-reached"]
    # Afterwards the failed device reports the release committed after all (a retry): the record stays.
    devs[0].report(m, "committed", ro.release, 2)
    assert gates(f.client.rollout(ro.id)) == gates(st)

    h = signed_in(env)
    page = h.get(f"/ui/rollouts/{ro.id}").text
    assert "CROSSED" in page and 'class="step-halted"' in page and ">current<" not in page
    # nothing: its members are already told to go back; a rollback would only overwrite why it halted
    assert offered(page) == set() and "None: a halted rollout takes no action." in page
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    # Resume cannot be walked through a confirmation: refused at once, on a page titled for what happened.
    r = h.post(f"/ui/rollouts/{ro.id}/resume", data={"csrf": csrf})
    assert r.status_code == 409 and "Not possible now" in r.text and "Confirm" not in r.text, r.text
    assert "<title>Not done" not in r.text
    missing = h.get("/ui/rollouts/999999")
    assert missing.status_code == 404 and "Not found" in missing.text and "Not done" not in missing.text
    h.close()


def test_every_release_listing_says_what_became_of_it_with_dates(env: Env) -> None:
    f = make_fleet(env, plain(2), versions=3)
    m = f.model
    good = f.rollout(2, [StepSpec(percent=100)], Gates(max_failure_rate=0.1, min_reporting=2))
    for dev in f.devices.values():
        dev.report(m, "committed", good.release, 2)
    assert f.evaluate() == {str(good.id): "completed"}
    bad = f.rollout(3, [StepSpec(percent=100)], Gates(max_failure_rate=0.1, min_reporting=1))
    next(iter(f.devices.values())).report(m, "failed", bad.release, 3, reason="prepare failed")
    assert f.evaluate() == {str(bad.id): "halted"}
    back = f.client.rollback(env.keys.load(), m, str(f.r1), reason="v3 misreads sevens", expires_in_s=3600)
    # The device follows the rollback: its history says why, though it only knows an earlier version came back.
    dev_id, dev = next(iter(f.devices.items()))
    dev.report(m, "committed", back.release, 1)
    ev = next(e for e in f.client.device(dev_id).events if e.release == back.release)
    assert ev.reason == f"rollback to release {f.r1}: v3 misreads sevens", ev
    assert "v3 misreads sevens" in env.server.cli("device", dev_id, "--events", "10").stdout
    h = signed_in(env)
    history = h.get(f"/ui/devices/{dev_id}").text.split('id="history"', 1)[1]
    h.close()
    assert "v3 misreads sevens" in history
    want = {f.r1: "superseded", good.release: "superseded", bad.release: "halted",
            back.release: f"valid, restores r{f.r1}"}
    assert {r.release: r.state for r in f.client.releases(m)} == want
    assert {r.release: r.state for r in f.client.status(m).models[0].releases} == want
    listing = env.server.cli("releases", m).stdout
    for number, state in want.items():
        line = next(x for x in listing.splitlines() if x.split()[0] == str(number))
        assert state in line and " 20" in line, line  # the expiry as a date, not seconds since 1970
    status = env.server.cli("status", m).stdout
    assert f"release {bad.release} (version 3, halted)" in status, status
    h = signed_in(env)
    page = h.get("/ui/models").text.split(f'data-model="{m}"', 1)[1].split("</section>", 1)[0]
    h.close()
    for number, state in want.items():
        row = page.split(f'data-release="{number}"', 1)[1].split("</tr>", 1)[0]
        assert f'class="release-state">{state}' in row, row


def test_cli_output_to_a_closed_pipe_ends_quietly_and_no_latency_is_shown_without_requests(env: Env) -> None:
    import os
    import subprocess
    import sys
    import time

    from tests.rollout_helpers import send_as_a_device

    f = make_fleet(env, plain(1))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=100)], Gates(min_reporting=1))
    dev = next(iter(f.devices.values()))
    # A device that committed without a single request in its trial (an older edged sent p99_ms 0.0 then).
    r = send_as_a_device("POST", f"{env.url}/api/v1/device/reports", dev.auth, {"events": [
        {"seq": 1, "model": m, "step": "committed", "version": 2, "release": ro.release, "at": time.time(),
         "detail": {"requests": 0, "errors": 0, "p99_ms": 0.0}}]})
    assert r.status_code == 200, r.text
    out = env.server.cli("rollout", "status", str(ro.id), "--members").stdout
    line = next(x for x in out.splitlines() if x.startswith(dev.id))
    assert line.split()[-3:] == ["0", "0", "-"], line  # requests, errors, p99: none measured

    # `edged-registry devices --json | head`: the reader closed the pipe before the command wrote.
    read_end, write_end = os.pipe()
    os.close(read_end)
    env_vars = {**os.environ, "EDGED_REGISTRY_URL": env.url, "EDGED_REGISTRY_TOKEN": ADMIN_TOKEN}
    done = subprocess.run([sys.executable, "-m", "edged.registry", "devices", "--json"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, env=env_vars, timeout=120)
    os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141


def test_offline_members_of_a_paused_rollout_are_flagged_on_its_page(env: Env) -> None:
    import time

    f = make_fleet(env, plain(2))
    m = f.model
    ro = f.rollout(2, [StepSpec(percent=100)], Gates(min_reporting=2))
    (gone_id, gone), (here_id, here) = list(f.devices.items())
    gone.report(m, "downloading", ro.release, 2)  # then it loses power
    f.client.rollout_action(ro.id, "pause", "network maintenance")
    time.sleep(ONLINE_S + 1.0)  # sleep-ok: the silent member's last call falls out of the online window
    here.poll()  # the other member keeps calling
    h = signed_in(env)
    from tests.registry_helpers import wait_for

    def flagged() -> str | None:
        page = h.get(f"/ui/rollouts/{ro.id}").text
        return page if 'id="offline-members"' in page and here_id not in page.split("offline-members", 1)[1] \
            else None

    page = wait_for(flagged, 20, 0.3, "the offline member flagged")
    h.close()
    flag = page.split('id="offline-members"', 1)[1].split("</ul>", 1)[0]
    assert "1 member(s) offline" in flag and gone_id in flag and "updating" in flag, flag


def test_charts_break_their_lines_across_periods_without_data() -> None:
    from edged.registry.web.views import _chart

    # a sample every 10 s, then nothing for five minutes (the version was not loaded), then samples again
    rows = [(float(t), "v1", 1.0) for t in (0, 10, 20, 30)] + [(float(t), "v1", 2.0) for t in (330, 340, 350)]
    ch = _chart("c", "requests", "req/s", rows)
    values = ch.series["v1"]
    assert None in values and values.index(None) == 4, (ch.x, values)  # one break, inside the gap
    assert 30 < ch.x[4] < 330 and ch.points() == 7
    steady = _chart("c", "requests", "req/s", [(float(t), "v1", 1.0) for t in range(0, 100, 10)])
    assert None not in steady.series["v1"]


def test_the_fleet_page_finds_devices_by_id_prefix(env: Env) -> None:
    import re

    f = make_fleet(env, {**plain(2), "cam-1": ({}, {}), "cam-2": ({}, {})})
    h = signed_in(env)

    def listed(query: dict[str, str]) -> set[str]:
        page = h.get("/ui/fleet", params=query).text
        return set(re.findall(r'<tr data-device="([^"]+)"', page))

    assert listed({"id": f"{f.model}-cam"}) == {f"{f.model}-cam-1", f"{f.model}-cam-2"}
    assert listed({"id": f"{f.model}-d1"}) == {f"{f.model}-d1"}
    assert listed({"id": f"{f.model}-cam", "part": "live"}) == {f"{f.model}-cam-1", f"{f.model}-cam-2"}
    assert listed({"id": "no-such-prefix"}) == set()
    assert 'name="id"' in h.get("/ui/fleet").text  # the search box
    h.close()


def test_the_dashboard_form_speaks_the_cli_vocabulary_and_shows_the_members_before_starting(env: Env) -> None:
    layout = {**plain(3), "canary": ({"ring": "canary"}, {"profile": "x86-64-cpu"})}
    f = make_fleet(env, layout)
    m = f.model
    canary = f"{m}-canary"
    h = signed_in(env)
    csrf = h.get("/ui/rollouts").text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    signed = f.client.sign(env.keys.load(), m, 2, expires_in_s=3600).model_dump_json()
    form = {"csrf": csrf, "signed": signed, "target": f"fleet={m}", "steps": "label:ring=canary/soak=1m, 34%, 100%",
            "min_devices": "1", "soak_s": "0", "max_failure_pct": "10", "min_reporting": "1"}
    before = (f.client.rollouts(m), [r.release for r in f.client.releases(m)])
    page = h.post("/ui/rollouts", data=form)
    assert page.status_code == 200 and "You are about to" in page.text, page.text
    after = (f.client.rollouts(m), [r.release for r in f.client.releases(m)])
    assert after == before, f"the preview left something: {before} -> {after}"
    items = page.text.split('id="preview"', 1)[1].split("</ol>", 1)[0].split("<li")[1:]
    counts = [int(x.split('data-count="', 1)[1].split('"', 1)[0]) for x in items]
    assert len(items) == 3 and canary in items[0] and counts[0] == 1, items
    # 34 % of the four targeted devices is 1.36: one device (floor), never two; 100 % takes the rest
    assert sum(counts) == 4 and counts[1] <= 1, counts
    started = h.post("/ui/rollouts", data={**form, "confirmed": "yes"})
    assert started.status_code == 303, started.text
    st = f.client.rollout(int(started.headers["location"].rsplit("/", 1)[1]))
    assert st.steps[0].members == 1 and st.rollout.steps[0].soak_s == 60 and st.rollout.steps[0].group is not None
    assert st.rollout.steps[1].percent == 34
    f.client.rollout_action(st.rollout.id, "abort", "test")

    # The quality gate comes through the form: refused here as on the CLI, for a version without an evaluation set.
    again = f.client.sign(env.keys.load(), m, 2, expires_in_s=3600).model_dump_json()
    refused = h.post("/ui/rollouts", data={**form, "signed": again, "steps": "100%", "max_quality_drop": "0.02"})
    assert refused.status_code in (400, 409, 422) and "evaluation" in refused.text, refused.text

    # A step's own thresholds and a start time come through the form too; the rollout waits, scheduled.
    later = {**form, "signed": again, "steps": "label:ring=canary/failure=0/reporting=1, 100%", "start_at": "+2h"}
    page = h.post("/ui/rollouts", data=later)
    assert page.status_code == 200 and "ring=canary (failure rate &lt;= 0%, min 1 reporting)" in page.text
    start = page.text.split('id="confirm-start">', 1)[1].split("</dd>", 1)[0]
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in (120m|2\.0h)\): scheduled until then", start), start
    started = h.post("/ui/rollouts", data={**later, "confirmed": "yes"})
    assert started.status_code == 303, started.text
    rid = int(started.headers["location"].rsplit("/", 1)[1])
    ro = f.client.rollout(rid).rollout
    assert ro.state == "scheduled" and ro.steps[0].max_failure_rate == 0.0 and ro.steps[0].min_reporting == 1
    assert abs((ro.start_at or 0) - time.time() - 7200) < 60 and f.on(ro.release) == set()
    view = h.get(f"/ui/rollouts/{rid}").text
    assert offered(view) == {"abort"}
    assert re.search(r"\(in (120m|2\.0h)\)", view.split('id="rollout-start">', 1)[1].split("</dd>")[0])
    assert str(int(ro.start_at or 0)) not in view  # a date and a relative time, never the epoch
    listing = h.get("/ui/rollouts").text.split(f'data-rollout="{rid}"', 1)[1].split("</tr>", 1)[0]
    assert re.search(r"starts in (120m|2\.0h)", listing), listing
    bad = h.post("/ui/rollouts", data={**later, "start_at": "next tuesday"})
    assert bad.status_code == 422 and "ISO-8601" in bad.text
    f.client.rollout_action(rid, "abort", "test")
    h.close()


def test_a_decommissioned_device_cannot_call_takes_no_part_in_rollouts_and_keeps_its_history(env: Env) -> None:
    f = make_fleet(env, plain(3))
    m = f.model
    (old_id, old), *_ = f.devices.items()
    old.report(m, "committed", f.r1, 1)
    out = env.server.cli("decommission", old_id).stdout
    assert "decommissioned" in out and "history is kept" in out, out
    assert old.poll().status_code == 401  # its credential is gone
    info = f.client.device(old_id)
    assert [e.step for e in info.events] == ["committed"] and "decommissioned" in info.labels  # history kept
    ro = f.rollout(2, [StepSpec(percent=100)], Gates(min_reporting=1))
    st = f.client.rollout(ro.id)
    assert st.targeted == 2 and st.rollout.members == 2  # the rollout neither waits for it nor counts it
    h = signed_in(env)
    row = h.get("/ui/fleet", params={"id": old_id}).text.split(f'data-device="{old_id}"', 1)[1].split("</tr>", 1)[0]
    h.close()
    assert "decommissioned" in row
    f.client.rollout_action(ro.id, "abort", "test")
