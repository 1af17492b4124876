"""A finished rollout's record and the actions its page offers (issue 40, items 4 and 5), against a real registry
process with devices driven over its HTTP API, evaluations triggered by hand (as in ``test_rollout.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from edged.registry.rollout_wire import Gates, StepSpec
from tests.registry.conftest import Env, registry_env
from tests.registry.test_rollout import make_fleet, plain
from tests.registry_helpers import ADMIN_TOKEN


@pytest.fixture(scope="module", params=["sqlite"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from registry_env(request, tmp_path_factory, "record", extra_args=["--rollout-tick", "1h"])


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
    assert offered(page) == {"rollback"}
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    # Resume cannot be walked through a confirmation: refused at once, on a page titled for what happened.
    r = h.post(f"/ui/rollouts/{ro.id}/resume", data={"csrf": csrf})
    assert r.status_code == 409 and "Not possible now" in r.text and "Confirm" not in r.text, r.text
    assert "<title>Not done" not in r.text
    missing = h.get("/ui/rollouts/999999")
    assert missing.status_code == 404 and "Not found" in missing.text and "Not done" not in missing.text
    h.close()
