"""Operators' numbers, the dashboard's rollout form, enrollment facts and a fleet rollback's paced rollout.

A real ``edged-registry serve`` process per database (SQLite and PostgreSQL), spoken to over HTTP:

* an id, version, release number or page offset beyond what the database stores answers ``400``
  naming the field (as a device's out-of-range counts do), never a ``500`` from the database;
* the dashboard's rollout form holds its minimum device count to the API's bounds (``422``, not a
  ``500`` from a rollout that could not be read back);
* the facts a device sends when it enrolls are bounded as the facts it sends later are (``413``);
* a fleet rollback that stops a rollout still letting devices in holds its admission, as pause,
  abort and a halt do: nobody joins a rolled-back rollout afterwards.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.http_client import web
from tests.registry.conftest import Env, registry_env
from tests.registry_helpers import ADMIN_TOKEN, make_version
from tests.rollout_helpers import ApiDevice

_n = itertools.count(1)
HUGE = str(2**63)  # above every integer column (PostgreSQL's bigint, SQLite's 64-bit integer)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    conf = tmp_path_factory.mktemp("bounds-conf") / "registry.toml"
    conf.write_text("[registry]\nshed_loop_lag_s = 0\n")  # judged on content, never shed on a busy machine
    yield from registry_env(request, tmp_path_factory, "bounds",
                            extra_args=["--config", str(conf), "--rollout-tick", "1h"])


def _model(env: Env, versions: int = 2) -> tuple[str, Any]:
    """A fresh model with ``versions`` versions pushed and version 1 released; its name and a client."""
    m = f"b{next(_n)}"
    c = env.server.client()
    for v in range(1, versions + 1):
        c.push_folder(make_version(env.tmp / "pub" / m / str(v), salt=f"{m}-{v}"), m, v)
    c.release(env.keys.load(), m, 1, expires_in_s=3600)
    return m, c


def _dashboard(env: Env) -> tuple[httpx.Client, str]:
    """A dashboard session of the admin token, and its CSRF token."""
    h = httpx.Client(base_url=env.url, timeout=30, follow_redirects=False)
    assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
    page = h.get("/ui/rollouts").text
    return h, page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_numbers_out_of_range_in_operators_requests_are_a_400_never_a_500(env: Env) -> None:
    m, c = _model(env)
    admin = env.admin()
    signed = {"manifest": "e30=", "signature": "AA==", "key_id": "k"}
    asks: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/api/v1/rollouts/{HUGE}", None),
        ("POST", f"/api/v1/rollouts/{HUGE}/pause", {}),
        ("GET", f"/api/v1/audit?offset={HUGE}", None),
        ("GET", f"/api/v1/models/{m}/versions/{HUGE}", None),
        ("PUT", f"/api/v1/models/{m}/versions/{HUGE}", {"files": [{"path": "a", "sha256": "0" * 64, "size": 1}]}),
        ("POST", f"/api/v1/models/{m}/releases/{HUGE}/revoke", None),
        ("GET", f"/api/v1/models/{m}/telemetry?version={HUGE}", None),
        ("GET", f"/api/v1/models/{m}/telemetry/summary?version={HUGE}", None),
        ("POST", "/api/v1/rollouts", {"model": m, "release": int(HUGE), "steps": [{"percent": 100}]}),
        ("POST", "/api/v1/rollouts", {"model": m, "release": 1, "baseline_version": int(HUGE),
                                      "steps": [{"percent": 100}]}),
        ("POST", f"/api/v1/models/{m}/rollback", {"to_release": int(HUGE), "signed": signed}),
    ]
    for method, path, body in asks:
        r = web().request(method, env.url + path, json=body, headers=admin, timeout=30)
        assert r.status_code == 400, (method, path, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "invalid_argument", (method, path)
    # nothing changed, and the registry still answers
    assert [r.release for r in c.releases(m)] == [1] and c.rollouts(model=m) == []
    # the dashboard's pages: a rollout id beyond any is refused, an audit page beyond the log is empty
    h, _csrf = _dashboard(env)
    try:
        assert h.get(f"/ui/rollouts/{HUGE}").status_code == 400
        assert h.get(f"/ui/audit?from={HUGE}").status_code == 200
    finally:
        h.close()
    c.close()


def test_the_dashboards_rollout_form_holds_min_devices_to_the_apis_bounds(env: Env) -> None:
    m, c = _model(env)
    h, csrf = _dashboard(env)
    try:
        for bad in ("-1", "1000001"):
            for confirmed in ("", "yes"):  # the confirmation page, and starting it
                r = h.post("/ui/rollouts", data={"csrf": csrf, "pick": f"{m}:1", "steps": "50,100",
                                                 "min_devices": bad, "confirmed": confirmed})
                assert r.status_code == 422, (bad, confirmed, r.status_code, r.text[:300])
                assert "min_devices" in r.text
        assert c.rollouts(model=m) == []
        # in bounds it still goes through
        r = h.post("/ui/rollouts", data={"csrf": csrf, "pick": f"{m}:1", "steps": "50,100", "min_devices": "3",
                                         "confirmed": "yes"})
        assert r.status_code == 303, r.text[:300]
        (ro,) = c.rollouts(model=m)
        assert ro.steps[0].min_devices == 3
    finally:
        h.close()
    c.close()


def test_facts_sent_at_enrollment_are_bounded_as_later_facts_are(env: Env) -> None:
    with env.server.client() as c:
        token = c.enrollment_token(uses=1).token
    name = f"b-enroll-{next(_n)}"
    r = web().post(f"{env.url}/api/v1/enroll", timeout=30,
                   json={"token": token, "device_id": name, "facts": {f"k{i}": i for i in range(1025)}})
    assert r.status_code == 413 and "facts" in r.json()["error"]["message"], r.text[:300]
    # refused before the token was spent: the device enrolls with facts within the bound
    r = web().post(f"{env.url}/api/v1/enroll", timeout=30,
                   json={"token": token, "device_id": name, "facts": {f"k{i}": i for i in range(1024)}})
    assert r.status_code == 200, r.text[:300]


def test_a_fleet_rollback_holds_the_admission_of_the_rollout_it_stops(env: Env) -> None:
    m, c = _model(env)
    for i in range(6):
        token = c.enrollment_token(labels={"fleet": m}).token
        ApiDevice.enroll(env.url, token, f"{m}-d{i}", {"fleet": m}, {"profile": "x86-64-cpu"})
    # one device a day: the step's ramp is still letting devices in when the rollback comes
    spec = RolloutCreate(model=m, release=0, steps=[StepSpec(percent=100)], gates=Gates(min_reporting=1),
                         target=RolloutTarget(labels={"fleet": m}), admit_per_minute=1 / 1440)
    ro = c.release_with_rollout(env.keys.load(), m, 2, spec, expires_in_s=3600)
    assert ro.admission is not None and not ro.admission.held
    back = c.rollback(env.keys.load(), m, reason="bad answers", expires_in_s=3600)
    assert back.stopped_rollouts == [ro.id]
    after = c.rollout(ro.id).rollout
    assert after.state == "rolled-back"
    # as after pause, abort or a halt: the cutoff stands still, nobody else becomes a member of it
    assert after.admission is not None and after.admission.held, after.admission
    c.close()
