"""Issue #36, the registry side: one rogue device must not steer a rollout, nor cost the registry anything.

Every test runs against a real ``edged-registry serve`` process (one for the module, SQLite, rollouts
evaluated only when the test asks) with devices speaking its HTTP API, as an attacker holding one
enrolled device's credential would. Each attack got through before issue #36:

1. a device outside a rollout halted it (a ``rolled-back`` report, telemetry full of errors or slow
   requests) or completed it (a ``committed`` report);
8. the dashboard's sign-in limit was evaded with ``X-Forwarded-For`` (uvicorn trusted it from loopback);
9. a signed-out session cookie kept working;
10. ``victim-01\\n`` enrolled beside ``victim-01`` (the pattern's ``$``), model names likewise;
11. a device's ``serving`` list (and other collections) had no bound;
12. counts of 2^63, 2^70 or NaN answered 500.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.passwords import hash_password
from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.http_client import web
from tests.registry_helpers import ADMIN_TOKEN, Keys, RegistryServer, make_version
from tests.rollout_helpers import ApiDevice

OPERATOR_PASSWORD = "operator password 36"
_n = itertools.count(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    tmp: Path = tmp_path_factory.mktemp("containment")
    keys = Keys.make(tmp)
    conf = tmp / "registry.toml"
    # shedding off: a refused 2 MB body costs this small test machine a late event loop, and the next
    # request must be judged on its content, not shed
    conf.write_text("[registry]\nshed_loop_lag_s = 0\n"
                    f'[registry.operators]\nalice = "{hash_password(OPERATOR_PASSWORD)}"\n')
    srv = RegistryServer(tmp, [keys.public], extra_args=["--config", str(conf), "--rollout-tick", "1h"]).start()
    srv.keys = keys  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _ui(url: str, address: str = "127.0.0.6") -> httpx.Client:
    """A dashboard client from its own loopback address (the sign-in test locks 127.0.0.1 out)."""
    return httpx.Client(base_url=url, timeout=30, follow_redirects=False,
                        transport=httpx.HTTPTransport(local_address=address))


def _enroll(server: RegistryServer, device_id: str, labels: dict[str, str]) -> ApiDevice:
    with server.client() as c:
        token = c.enrollment_token(labels=labels).token
    return ApiDevice.enroll(server.url, token, device_id, labels, {"profile": "x86-64-cpu"})


def _post_telemetry(dev: ApiDevice, windows: list[dict[str, Any]], **sample: Any) -> httpx.Response:
    dev.tseq += 1
    item = {"device": dev.id, "seq": dev.tseq, "run": dev.run, "t": time.time(), "window_s": 10.0, "uptime_s": 10.0,
            "models": windows, **sample}
    return web().post(f"{dev.url}{INGEST_PATH}", headers=dev.auth, json={"buffer_id": dev.run, "items": [item]})


def _two_versions_one_released(server: RegistryServer) -> tuple[str, Any, Keys]:
    """A fresh model with versions 1 and 2 pushed and version 1 released; its name, a client, the keys."""
    m = f"c{next(_n)}"
    c = server.client()
    keys: Keys = server.keys  # type: ignore[attr-defined]
    for v in (1, 2):
        c.push_folder(make_version(server.root / "pub" / m / str(v), salt=f"{m}-{v}"), m, v)
    c.release(keys.load(), m, 1, expires_in_s=3600)
    return m, c, keys


# ---- attack 1: a device outside the rollout decides nothing -------------------------------------------
def test_a_device_outside_a_rollout_neither_halts_nor_completes_it(server: RegistryServer) -> None:
    m, c, keys = _two_versions_one_released(server)
    member = _enroll(server, f"{m}-member", {"ring": "canary", "fleet": m})
    rogue = _enroll(server, f"{m}-rogue", {"ring": "other", "fleet": m})
    spec = RolloutCreate(model=m, release=0, steps=[StepSpec(percent=100, soak_s=0)],
                         target=RolloutTarget(labels={"ring": "canary", "fleet": m}),
                         gates=Gates(max_failure_rate=0.1, max_error_rate=0.01, max_p99_ratio=2.0, min_requests=100,
                                     min_reporting=1))
    ro = c.release_with_rollout(keys.load(), m, 2, spec, expires_in_s=3600)
    n = ro.release
    assert ro.members == 1 and member.release(m) == n and rogue.release(m) != n
    # a report that the rogue rolled the release back: it would halt the rollout at failure_rate 1 > 0.1
    rogue.report(m, "rolled-back", n, 2, "trial failed")
    assert c.evaluate_rollouts() == {}
    # telemetry of the new version with 99 % errors (error_rate), then slow requests against a fast
    # previous version (p99_ratio): the rogue is neither a member nor targeted
    rogue.telemetry(m, 2, ok=10, errors=990)
    rogue.telemetry(m, 1, ok=1000, latency_s=0.002)
    rogue.telemetry(m, 2, ok=1000, latency_s=2.0)
    assert c.evaluate_rollouts() == {}
    # a 'committed' report would complete a rollout whose one member reported nothing
    rogue.report(m, "committed", n, 2)
    assert c.evaluate_rollouts() == {}
    st = c.rollout(ro.id)
    assert st.rollout.state == "running" and st.rollout.reason is None
    assert {g.gate: g.value for g in st.gates}["min_reporting"] == 0  # nobody counted finished
    assert next(g for g in st.gates if g.gate == "error_rate").judged is False
    assert member.reverts(m) == [] and member.release(m) == n  # no member was told to revert
    # the rogue's reports are recorded (and the dashboard's device page says they were not counted)
    assert [e.step for e in c.device(rogue.id).events][-2:] == ["rolled-back", "committed"]
    with _ui(server.url) as h:
        assert h.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
        page = h.get(f"/ui/devices/{rogue.id}", params={"part": "live"})
        assert page.status_code == 200
        assert f"not counted: not in rollout {ro.id}" in page.text
        assert "not counted" not in h.get(f"/ui/devices/{member.id}", params={"part": "live"}).text
    # the member's own word still counts: its commit completes the rollout, its failure would have halted it
    member.telemetry(m, 2, ok=200, latency_s=0.002)
    member.report(m, "committed", n, 2)
    assert c.evaluate_rollouts() == {str(ro.id): "completed"}
    assert c.rollout(ro.id).totals["committed"] == 1
    c.close()


def test_a_device_labelled_out_of_a_rollout_stops_counting(server: RegistryServer) -> None:
    """Verdicts are remembered between evaluations, but only while a device's labels stay what they were."""
    m, c, keys = _two_versions_one_released(server)
    a = _enroll(server, f"{m}-a", {"ring": "canary", "fleet": m})
    b = _enroll(server, f"{m}-b", {"ring": "canary", "fleet": m})
    spec = RolloutCreate(model=m, release=0, steps=[StepSpec(percent=100, soak_s=3600)],
                         target=RolloutTarget(labels={"ring": "canary", "fleet": m}),
                         gates=Gates(max_failure_rate=0.1, min_reporting=1))
    ro = c.release_with_rollout(keys.load(), m, 2, spec, expires_in_s=3600)
    b.report(m, "downloading", ro.release, 2)
    assert c.evaluate_rollouts() == {} and c.rollout(ro.id).totals["updating"] == 1  # b counted as a member
    c.set_labels(b.id, {"ring": "lab"})  # an operator moves b out of the target
    b.report(m, "rolled-back", ro.release, 2, "trial failed")
    assert c.evaluate_rollouts() == {}  # b's failure is no longer the rollout's
    a.report(m, "rolled-back", ro.release, 2, "trial failed")
    assert c.evaluate_rollouts() == {str(ro.id): "halted"}  # a member's is
    assert "1 of 1 finished" in (c.rollout(ro.id).rollout.reason or "")
    c.close()


# ---- attack 8: the sign-in limit keys on the real peer ------------------------------------------------
def test_forwarded_for_does_not_evade_the_sign_in_limit(server: RegistryServer) -> None:
    # from 127.0.0.1, whose forwarded headers uvicorn believes by default
    attacker = httpx.Client(base_url=server.url, timeout=30, follow_redirects=False)
    with attacker, _ui(server.url, "127.0.0.3") as mine:
        codes = []
        for i in range(14):
            data = {"name": "alice", "token": f"guess {i}"} if i % 2 else {"token": f"guess {i}"}
            r = attacker.post("/ui/login", data=data, headers={"X-Forwarded-For": f"10.66.{i}.1",
                                                               "X-Real-IP": f"10.66.{i}.1"})
            codes.append(r.status_code)
        assert codes[:10] == [401] * 10 and codes[10:] == [429] * 4, codes
        # refused before any check, whatever address it claims, even with the right token
        r = attacker.post("/ui/login", data={"token": ADMIN_TOKEN}, headers={"X-Forwarded-For": "10.77.0.1"})
        assert r.status_code == 429 and "set-cookie" not in r.headers
        # another real peer is not locked out
        r = mine.post("/ui/login", data={"name": "alice", "token": OPERATOR_PASSWORD})
        assert r.status_code == 303


def proxy_is_believed(url: str, admin_token: str) -> None:
    """With ``forwarded_allow_ips`` the limit counts per forwarded client (each behind the proxy its own).
    Run on a registry configured with ``forwarded_allow_ips = ["127.0.0.5"]`` (the session test starts one)."""
    with _ui(url, "127.0.0.5") as proxy:
        for i in range(10):
            r = proxy.post("/ui/login", data={"token": f"guess {i}"}, headers={"X-Forwarded-For": "10.9.9.1"})
            assert r.status_code == 401
        assert proxy.post("/ui/login", data={"token": admin_token},
                          headers={"X-Forwarded-For": "10.9.9.1"}).status_code == 429
        r = proxy.post("/ui/login", data={"token": admin_token}, headers={"X-Forwarded-For": "10.9.9.2"})
        assert r.status_code == 303


# ---- attack 9: sessions end on the server ---------------------------------------------------------
def _csrf(h: httpx.Client) -> str:
    page = h.get("/ui/rollouts")
    assert page.status_code == 200, page.status_code
    return page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_sign_out_token_rotation_and_operator_removal_end_sessions(server: RegistryServer) -> None:
    """Also attack 8's other half: a registry configured with ``forwarded_allow_ips`` believes its proxy."""
    cookies = {}
    for who, data in (("admin", {"token": ADMIN_TOKEN}), ("alice", {"name": "alice", "token": OPERATOR_PASSWORD}),
                      ("admin-2", {"token": ADMIN_TOKEN})):
        with _ui(server.url) as h:
            assert h.post("/ui/login", data=data).status_code == 303
            cookies[who] = h.cookies.get("edged_session", path="/ui")

    def live(cookie: str | None, url: str = server.url) -> int:
        with _ui(url) as h:
            h.cookies.set("edged_session", cookie or "", path="/ui")
            return h.get("/ui/rollouts", params={"part": "live"}).status_code

    assert {who: live(v) for who, v in cookies.items()} == {"admin": 200, "alice": 200, "admin-2": 200}
    # sign out: the same cookie, kept or copied, no longer works (before: it did for 12 h); others still do
    with _ui(server.url) as h:
        h.cookies.set("edged_session", cookies["admin"] or "", path="/ui")
        r = h.post("/ui/logout", data={"csrf": _csrf(h)})
        assert r.status_code == 303
    assert live(cookies["admin"]) == 401
    with _ui(server.url) as h:
        h.cookies.set("edged_session", cookies["admin"] or "", path="/ui")
        assert h.get("/ui/fleet").status_code == 303  # to the login
    assert live(cookies["alice"]) == 200 and live(cookies["admin-2"]) == 200
    # a second registry process on the same database with a rotated admin token and without alice:
    # neither open session works there (while the first process, configured as before, still honours them)
    token2 = server.root / "admin-rotated.token"
    token2.write_text("rotated-admin-token-0123456789")
    conf2 = server.root / "registry-rotated.toml"
    conf2.write_text('[registry]\nshed_loop_lag_s = 0\nforwarded_allow_ips = ["127.0.0.5"]\n')
    other = RegistryServer(server.root, list(server.public_keys),
                           extra_args=["--config", str(conf2), "--admin-token-file", str(token2),
                                       "--rollout-tick", "1h"])
    other.token_file.write_text(ADMIN_TOKEN)  # start() writes it; the later --admin-token-file wins
    other.start()
    try:
        assert live(cookies["alice"], other.url) == 401 and live(cookies["admin-2"], other.url) == 401
        assert live(cookies["alice"]) == 200 and live(cookies["admin-2"]) == 200
        # attack 8 behind a reverse proxy: that registry believes 127.0.0.5's X-Forwarded-For
        proxy_is_believed(other.url, "rotated-admin-token-0123456789")
    finally:
        other.stop()


# ---- attack 10: ids and names match whole -----------------------------------------------------------
def test_ids_names_and_labels_with_control_characters_are_refused(server: RegistryServer) -> None:
    with server.client() as c:
        token = c.enrollment_token(uses=10).token
    for bad in ("victim-01\n", "victim-01\r", "victim\x00", "victim-01\u0085"):
        r = web().post(f"{server.url}/api/v1/enroll", json={"token": token, "device_id": bad})
        assert r.status_code == 422 and "device_id" in r.text, (bad, r.status_code)
    dev = ApiDevice.enroll(server.url, token, f"victim-{next(_n)}")
    # model names in reports and in what the device says it serves
    for model in ("digits\n", "digits\x1b[2J", "../digits"):
        r = web().post(f"{server.url}/api/v1/device/reports", headers=dev.auth, json={"events": [
            {"seq": 1, "model": model, "step": "committed", "at": time.time()}]})
        assert r.status_code == 422 and "model" in r.text, (model, r.status_code)
        r = web().put(f"{server.url}/api/v1/device/facts", headers=dev.auth, json={"serving": [{"model": model}]})
        assert r.status_code == 422, (model, r.status_code)
    # label values an operator sets go onto pages: no control characters there either
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as a:
        assert a.post("/api/v1/enrollment-tokens", json={"labels": {"site": "a\nb"}}).status_code == 422
        assert a.patch(f"/api/v1/devices/{dev.id}/labels", json={"labels": {"site": "lab\n"}}).status_code == 422
        assert a.patch(f"/api/v1/devices/{dev.id}/labels", json={"labels": {"site": "lab"}}).status_code == 200
    with server.client() as c:
        assert [d.device_id for d in c.devices() if d.device_id.startswith("victim")] == [dev.id]


# ---- attacks 11 and 12: bounded collections, numbers in range ---------------------------------------
def test_device_reported_collections_are_bounded(server: RegistryServer) -> None:
    with server.client() as c:
        dev = ApiDevice.enroll(server.url, c.enrollment_token().token, f"big-{next(_n)}")
    serving = [{"model": f"m{i}", "version": 1, "release": 1, "state": "committed"} for i in range(30_000)]
    r = httpx.put(f"{server.url}/api/v1/device/facts", headers=dev.auth, json={"serving": serving}, timeout=60)
    assert r.status_code == 413 and "serving" in r.text and "1024" in r.text, (r.status_code, r.text[:300])
    r = web().put(f"{server.url}/api/v1/device/facts", headers=dev.auth, json={"serving": serving[:50]})
    assert r.status_code == 200  # a real device's list is stored
    events = [{"seq": i + 1, "model": "m", "step": "downloading", "at": time.time()} for i in range(1001)]
    r = web().post(f"{server.url}/api/v1/device/reports", headers=dev.auth, json={"events": events})
    assert r.status_code == 413 and "events" in r.text
    # telemetry: per-sample collections, and the model windows of a whole batch (each one a database row)
    r = _post_telemetry(dev, [], system={"temperatures_c": {f"zone{i}": 40.0 for i in range(5000)}})
    assert r.status_code == 413 and "temperatures_c" in r.text
    r = _post_telemetry(dev, [{"model": "m", "version": 1, "failures": {f"code{i}": 1 for i in range(500)}}])
    assert r.status_code == 413 and "failures" in r.text
    run = uuid.uuid4().hex[:12]
    items = [{"device": dev.id, "seq": k + 1, "run": run, "t": time.time(), "window_s": 1, "uptime_s": 1,
              "models": [{"model": "m", "version": 1}] * 1000} for k in range(200)]
    body = json.dumps({"buffer_id": run, "items": items}, separators=(",", ":")).encode()
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}{INGEST_PATH}", content=body, timeout=60,
                   headers={**dev.auth, "Content-Type": "application/json"})
    assert r.status_code == 413 and "200000 model windows" in r.text, (r.status_code, r.text[:300])
    print(f"200,000 model windows (a {len(body) >> 10} KiB body) refused in {time.monotonic() - t0:.2f} s")
    with server.client() as c:
        stored = c.device(dev.id)
        assert stored.events == []
    assert len(web().get(f"{server.url}/api/v1/devices/{dev.id}/telemetry",
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["points"]) == 0


def test_numbers_out_of_range_are_a_400_never_a_500(server: RegistryServer) -> None:
    with server.client() as c:
        dev = ApiDevice.enroll(server.url, c.enrollment_token().token, f"num-{next(_n)}")

    def raw(method: str, path: str, body: str) -> httpx.Response:
        return web().request(method, f"{server.url}{path}", content=body.encode(),
                             headers={**dev.auth, "Content-Type": "application/json"})

    window = '{{"model": "m", "version": 1, "success": {n}}}'
    sample = ('{{"buffer_id": "b1", "items": [{{"device": "x", "seq": {seq}, "run": "r", "t": 1.0, "window_s": 1, '
              '"uptime_s": 1, "models": [{w}]}}]}}')
    for n in (str(2**63), str(2**70), "NaN", "Infinity", "-1"):
        r = raw("POST", INGEST_PATH, sample.format(seq=1, w=window.format(n=n)))
        assert r.status_code in (400, 422) and r.status_code != 500, (n, r.status_code, r.text)
        assert r.status_code == 400 or n == "-1", (n, r.status_code)  # out of range / not finite: 400
        assert r.json()["error"]["code"] == "invalid_argument"
    for bad in ('"sum_s": NaN', '"sum_s": 1e999'):
        w = '{"model": "m", "version": 1, "success": 1, "latency": {"counts": [1], ' + bad + '}}'
        assert raw("POST", INGEST_PATH, sample.format(seq=1, w=w)).status_code == 400, bad
    assert raw("POST", INGEST_PATH, sample.format(seq=2**63, w=window.format(n=1))).status_code == 400
    # reports: sequence numbers, versions and releases the database could not hold
    for field, value in (("seq", 2**63), ("version", 2**40), ("release", 2**31), ("at", "NaN")):
        ev = {"seq": 1, "model": "m", "step": "downloading", "at": 1.0, field: value}
        body = json.dumps({"events": [ev]}).replace('"NaN"', "NaN")
        r = raw("POST", "/api/v1/device/reports", body)
        assert r.status_code == 400, (field, r.status_code, r.text)
    # free-form facts keep numbers JSON can hold; a huge one is stored as text, not a 500
    r = raw("PUT", "/api/v1/device/facts", '{"facts": {"ram": ' + str(2**70) + ', "temp": NaN}}')
    assert r.status_code == 200, r.text
    with server.client() as c:
        assert c.device(dev.id).facts == {"ram": str(2**70), "temp": None}
    # nothing broke: a well-formed sample is stored
    r = raw("POST", INGEST_PATH, sample.format(seq=3, w=window.format(n=5)))
    assert r.status_code == 200 and r.json()["accepted"] == 1
