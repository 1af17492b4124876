"""The registry's dashboard in a real headless Chromium (Debian's, driven by Selenium) over a real fleet.

Three ``edged run`` daemons with telemetry on and one registry process. The browser logs in,
opens a device and waits for charts drawn from the daemons' own uploaded telemetry, sees
each daemon with what it serves on the fleet page, starts a rollout of a good release from the page and
watches it progress live (no reload), starts one of a broken release and sees it halt with
the failure-rate gate over its limit, then rolls the good one back and sees the fleet return
to version 1. Screenshots of each page at desktop and phone width go to
``$EDGED_DASHBOARD_SCREENSHOTS`` (default: a folder under pytest's tmp dir). Without a
browser the access checks still run over plain HTTP.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from edged.registry.passwords import hash_password
from tests.registry_helpers import (
    ADMIN_TOKEN,
    EdgedRun,
    Keys,
    RegistryServer,
    device_toml,
    free_port,
    headless_chromium,
    make_version,
)
from tests.registry_helpers import wait_for as _wait_for

MODEL = "digits"
OPERATOR_PASSWORD = "alice's long passphrase"
N = 3
FLEET = {"fleet": "dash-test"}
DESKTOP = (1280, 900)
PHONE = (390, 844)
SIDEWAYS = "return document.documentElement.scrollWidth - window.innerWidth"


@dataclass
class World:
    tmp: Path
    keys: Keys
    server: RegistryServer
    client: Any
    daemons: dict[str, EdgedRun]
    unplugged_credential: str

    def serving(self) -> dict[str, list[int]]:
        return {d: p.versions(MODEL) for d, p in self.daemons.items()}

    def signed(self, version: int) -> str:
        return str(self.client.sign(self.keys.load(), MODEL, version, expires_in_s=3600).model_dump_json())


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    return _wait_for(pred, timeout, 0.2, what)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("dashboard")
    keys = Keys.make(tmp)
    # online = called in the last 10 s: the daemons poll every 0.2 s, a stored last-seen time is rewritten once it is
    # 4.75 s old, in writes every 0.5 s (settings.last_seen_resolution_s)
    # (a loaded 2-core machine delays both by seconds now and then)
    conf = tmp / "registry.toml"
    conf.write_text("[registry]\ndashboard_online_s = 10.0\nlast_seen_flush_s = 0.5\n"
                    f"[registry.operators]\nalice = \"{hash_password(OPERATOR_PASSWORD)}\"\n")
    server = RegistryServer(tmp, [keys.public], extra_args=["--config", str(conf), "--rollout-tick", "0.2s",
                                                          "--dashboard-poll", "1s"])
    server.start()
    client = server.client()
    # a device that enrolled and never called again: offline on the page; its credential must not open it
    # (enrolled first: the browser finds it offline once dashboard_online_s passed since)
    spare = client.enrollment_token(uses=1, labels={"fleet": "spare"}).token
    r = httpx.post(f"{server.url}/api/v1/enroll", json={"token": spare, "device_id": "unplugged",
                                                        "labels": {"fleet": "spare"},
                                                        "facts": {"profile": "x86-64-cpu"}}, timeout=10)
    r.raise_for_status()
    pub = tmp / "pub"
    make_version(pub / "1", salt="v1")
    client.push_folder(make_version(pub / "2", salt="v2"), MODEL, 2)
    client.push_folder(make_version(pub / "3", salt="v3", golden_fail=True), MODEL, 3)
    token = client.enrollment_token(uses=N, labels=FLEET).token
    daemons = {}
    for i in range(N):
        dev, home = f"dev-{i}", tmp / f"dev-{i}"
        repo = home / "repo"
        shutil.copytree(pub / "1", repo / MODEL / "1")
        port = free_port()
        cfg = device_toml(home, repo, server.url, [keys.public], token=token, device_id=dev, http_port=port,
                          poll_s=0.2)
        text = cfg.read_text().replace("[telemetry]\nenabled = false",
                                       "[telemetry]\nenabled = true\ninterval_s = 1.0\nupload_interval_s = 1.0")
        cfg.write_text(text + "trial_s = 0.5\nretry_max_s = 2.0\nfacts_interval_s = 2.0\n")
        daemons[dev] = EdgedRun(cfg, port, home / "daemon.log")
    try:
        for d in daemons.values():
            d.start()
        for d in daemons.values():
            d.wait_http(90)
        wait_for(lambda: len(client.devices(FLEET)) == N, 60, "every daemon enrolled")
        yield World(tmp, keys, server, client, daemons, r.json()["credential"])
    finally:
        for d in daemons.values():
            d.stop()
        client.close()
        server.stop()


# ---- without a browser: what a missing or wrong credential gets -------------------------------------
def test_pages_and_data_refuse_without_an_admin_session(world: World) -> None:
    url = world.server.url
    with httpx.Client(base_url=url, timeout=10, follow_redirects=False) as h:
        for path in ("/ui/fleet", "/ui/devices/dev-0", "/ui/models", "/ui/rollouts", "/ui/rollouts/1"):
            r = h.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login"), (path, r.status_code)
            assert h.get(path, params={"part": "live"}).status_code == 401, path
        # a device credential is not a way in, neither as a bearer header nor at the login form
        dev_auth = {"Authorization": f"Bearer {world.unplugged_credential}"}
        assert h.get("/ui/fleet", headers=dev_auth).status_code == 303
        assert h.get("/ui/fleet", params={"part": "live"}, headers=dev_auth).status_code == 401
        r = h.post("/ui/login", data={"token": world.unplugged_credential})
        assert r.status_code == 401 and "set-cookie" not in r.headers and "not the registry" in r.text
        # a forged or altered cookie is no session
        h.cookies.set("edged_session", "v1.99999999999.abc.0000", path="/ui")
        assert h.get("/ui/fleet", params={"part": "live"}).status_code == 401
        h.cookies.clear()
        # an operator account opens it too; a wrong password, the admin token or a device credential given as
        # an operator's password, an unknown operator, or 'admin' as a name do not
        for name, secret in (("alice", "wrong"), ("alice", ADMIN_TOKEN), ("alice", world.unplugged_credential),
                             ("mallory", OPERATOR_PASSWORD), ("admin", ADMIN_TOKEN)):
            r = h.post("/ui/login", data={"name": name, "token": secret})
            assert r.status_code == 401 and "set-cookie" not in r.headers, (name, r.status_code)
        r = h.post("/ui/login", data={"name": "alice", "token": OPERATOR_PASSWORD, "next": "/ui/rollouts"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/rollouts"
        assert "HttpOnly" in r.headers["set-cookie"]
        page = h.get("/ui/rollouts")
        assert page.status_code == 200 and "Signed in as alice" in page.text
        h.cookies.clear()
        r = h.post("/ui/login", data={"token": ADMIN_TOKEN, "next": "/ui/models"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/models"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and "Path=/ui" in cookie
        assert h.get("/ui/fleet").status_code == 200
        # an action without the session's CSRF token (or with another) is refused and changes nothing
        before = world.client.rollouts()
        form = {"signed": world.signed(2), "steps": "100", "min_reporting": "1"}
        assert h.post("/ui/rollouts", data={**form, "confirmed": "yes"}).status_code == 403
        assert h.post("/ui/rollouts", data={**form, "confirmed": "yes", "csrf": "0" * 64}).status_code == 403
        page = h.get("/ui/rollouts").text
        csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        r = h.post("/ui/rollouts", data={**form, "confirmed": "yes", "csrf": csrf},
                   headers={"Origin": "http://attacker.example"})
        assert r.status_code == 403
        # with the token but without confirming: a confirmation page, nothing started
        r = h.post("/ui/rollouts", data={**form, "csrf": csrf})
        assert r.status_code == 200 and "You are about to" in r.text and 'name="confirmed" value="yes"' in r.text
        assert world.client.rollouts() == before
        h.cookies.clear()
        assert h.post("/ui/rollouts", data={**form, "confirmed": "yes", "csrf": csrf}).status_code == 401
        assert world.client.rollouts() == before


# ---- in Chromium -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(*DESKTOP) as driver:
        yield driver


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("EDGED_DASHBOARD_SCREENSHOTS")
    out = Path(env) if env else tmp_path_factory.mktemp("dashboard-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


class Page:
    """The browser on one page: waits for what the page shows, never for a fixed time."""

    def __init__(self, driver: Any, base: str, shots: Path) -> None:
        from selenium.webdriver.common.by import By

        self.d, self.base, self.shots, self.by = driver, base, shots, By

    def open(self, path: str) -> None:
        self.d.get(self.base + path)

    def text(self, css: str) -> str:
        def once() -> str:
            els = self.d.find_elements(self.by.CSS_SELECTOR, css)
            return str(els[0].text) if els else ""

        return str(self.read(once))

    def all(self, css: str) -> list[Any]:
        return list(self.d.find_elements(self.by.CSS_SELECTOR, css))

    def until(self, pred: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        from selenium.common.exceptions import StaleElementReferenceException

        def safe() -> Any:
            try:
                return pred()
            except StaleElementReferenceException:  # the live region was replaced mid-read
                return False

        try:
            return wait_for(safe, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}; the page showed:\n{self.text('main')[:3000]}") from None

    def read(self, fn: Callable[[], Any]) -> Any:
        """fn's value, read again when a live update replaced the elements it was reading."""
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(20):
            try:
                return fn()
            except StaleElementReferenceException:
                continue
        return fn()

    def screenshot(self, name: str) -> None:
        """Desktop and phone width; at phone width the page itself must not scroll sideways."""
        for label, (w, h) in (("desktop", DESKTOP), ("phone", PHONE)):
            self.d.set_window_size(w, h)
            self.until(lambda width=w: self.d.execute_script("return window.innerWidth") <= width,
                       "the window resized", 10)
            self.until(lambda: self.d.execute_script(SIDEWAYS) <= 1, f"{name} at {label} width not to scroll sideways",
                       10)
            self.d.save_screenshot(str(self.shots / f"{name}-{label}.png"))
        self.d.set_window_size(*DESKTOP)

    def polls(self) -> int:
        return int(self.d.find_element(self.by.ID, "live").get_attribute("data-polls") or 0)


def fleet_rows(p: Page) -> dict[str, dict[str, str]]:
    out = {}
    for tr in p.all("#fleet tbody tr[data-device]"):
        cells = tr.find_elements(p.by.CSS_SELECTOR, "th, td")
        out[tr.get_attribute("data-device")] = {"state": cells[1].text, "serves": cells[2].text,
                                                "should": cells[3].text, "error": cells[6].text}
    return out


def filter_fleet(p: Page, **fields: str) -> None:
    """Fill the fleet page's filter form (the other fields emptied) and submit it."""
    from selenium.webdriver.support.ui import Select

    p.open("/ui/fleet")
    form = p.d.find_element(p.by.CSS_SELECTOR, "form.filters")
    box = form.find_element(p.by.NAME, "label")
    box.clear()
    box.send_keys(fields.get("label", ""))
    for name in ("model", "profile", "state"):
        sel = Select(form.find_element(p.by.NAME, name))
        if fields.get(name):
            sel.select_by_visible_text(fields[name])
        else:
            sel.select_by_index(0)
    form.find_element(p.by.CSS_SELECTOR, "button[type=submit]").click()
    p.until(lambda: all(f"{k}=" in p.d.current_url for k in fields), "the filtered fleet page")


def start_rollout(p: Page, signed: str, steps: str, *, min_devices: int, soak_s: float, max_failure_pct: float,
                  min_reporting: int) -> int:
    p.open("/ui/rollouts")
    d = p.d
    # pasted, as the page asks: typed key by key, a kilobyte of JSON takes the browser seconds
    d.execute_script("arguments[0].value = arguments[1];"
                     "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));",
                     d.find_element(p.by.ID, "signed"), signed)
    for name, value in (("steps", steps), ("min_devices", str(min_devices)), ("soak_s", str(soak_s)),
                        ("max_failure_pct", str(max_failure_pct)), ("min_reporting", str(min_reporting)),
                        ("target", "fleet=dash-test")):
        el = d.find_element(p.by.NAME, name)
        el.clear()
        el.send_keys(value)
    d.find_element(p.by.ID, "create-rollout").click()
    # nothing starts before the operator confirms what the page says will happen
    p.until(lambda: "You are about to" in p.text("main"), "the confirmation page")
    assert "start this rollout" in p.text("main") and "fleet=dash-test" in p.text("main")
    d.find_element(p.by.ID, "confirm").click()
    p.until(lambda: "/ui/rollouts/" in d.current_url and p.text("#rollout-state"), "the rollout's page")
    return int(d.current_url.rsplit("/", 1)[1])


def test_dashboard_in_chromium(world: World, browser: Any, shots: Path) -> None:
    w, p = world, Page(browser, world.server.url, shots)
    # -- login: the fleet page redirects to the login form, the admin token opens it
    p.open("/ui/fleet")
    p.until(lambda: "/ui/login" in p.d.current_url, "the login redirect")
    p.screenshot("login")
    p.d.find_element(p.by.ID, "token").send_keys(ADMIN_TOKEN)
    p.d.find_element(p.by.CSS_SELECTOR, "form button[type=submit]").click()
    p.until(lambda: p.d.current_url.endswith("/ui/fleet"), "the fleet page after login")

    # -- a device: charts drawn from the daemon's own telemetry (requests made here, then uploaded); this page
    # comes first, while the unplugged device's online window runs out for the fleet page below
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    for d in w.daemons.values():
        for _ in range(5):
            assert d.infer(x).status_code == 200
    p.open("/ui/devices/dev-0")
    drawn = "return [...document.querySelectorAll('figure.chart')].map(f => [f.id, +(f.dataset.drawn || 0)])"
    p.until(lambda: dict(p.d.execute_script(drawn)).get("chart-rate", 0) > 0
            and dict(p.d.execute_script(drawn)).get("chart-load", 0) > 0
            and dict(p.d.execute_script(drawn)).get("chart-latency", 0) > 0
            and p.all("#chart-rate canvas"), "the device's request and load charts drawn from telemetry", 90)
    label = p.read(lambda: p.d.find_element(p.by.CSS_SELECTOR, "#chart-rate .plot").get_attribute("aria-label"))
    assert "digits v1 req/s" in label, label
    latency = p.read(lambda: p.d.find_element(p.by.CSS_SELECTOR, "#chart-latency .plot").get_attribute("aria-label"))
    assert "digits v1 p99 latest" in latency and "latest none" not in latency.split("p99")[1], latency
    assert "digits" in p.text("#device-models") and "onnxruntime" in p.text("#device-models")
    p.until(lambda: dict(p.d.execute_script(drawn)).get("chart-memory", 0) > 0, "the memory chart")
    memory = p.read(lambda: p.d.find_element(p.by.CSS_SELECTOR, "#chart-memory .plot").get_attribute("aria-label"))
    assert "used MB latest" in memory and "edged RSS MB latest" in memory, memory
    p.screenshot("device")
    # a chosen window: the charts are drawn again over the last hour
    from selenium.webdriver.support.ui import Select

    Select(p.d.find_element(p.by.NAME, "window")).select_by_visible_text("1h")
    p.d.find_element(p.by.CSS_SELECTOR, "form.filters button").click()
    p.until(lambda: "window=1h" in p.d.current_url and dict(p.d.execute_script(drawn)).get("chart-rate", 0) > 0,
            "the device's charts over one hour")
    assert p.d.find_element(p.by.NAME, "window").get_attribute("value") == "1h"

    # -- filters: the form narrows the table (and its live updates), the counts stay the whole fleet's; first the
    # filters that do not depend on who is online, while the unplugged device's online window runs out
    filter_fleet(p, label="fleet=dash-test")
    p.until(lambda: set(fleet_rows(p)) == set(w.daemons), "the label filter keeps the three daemons")
    filter_fleet(p, label="fleet=spare", profile="x86-64-cpu")
    p.until(lambda: set(fleet_rows(p)) == {"unplugged"}, "label and profile filters combined")
    filter_fleet(p, model=MODEL)
    p.until(lambda: set(fleet_rows(p)) == set(w.daemons), "the model filter keeps the daemons serving it")
    filter_fleet(p, label="fleet=elsewhere")
    p.until(lambda: "No device matches" in p.text("#fleet"), "an empty match said so")

    # -- fleet: every daemon online with what it serves (reported by the daemon) and what it should
    # (the unplugged device called once, at its enrollment: offline once that is dashboard_online_s old)
    p.open("/ui/fleet")
    p.until(lambda: all("digits v1" in r["serves"] and r["state"].startswith("online")
                        for d, r in fleet_rows(p).items() if d != "unplugged") and len(fleet_rows(p)) == N + 1
            and fleet_rows(p)["unplugged"]["state"].startswith("offline"),
            "three online daemons serving digits v1 and the unplugged device offline on the fleet page")
    rows = p.read(lambda: fleet_rows(p))
    assert rows["unplugged"]["state"].startswith("offline")
    assert p.text("#count-devices") == str(N + 1) and p.text("#count-online") == str(N)
    assert p.text("#count-offline") == "1"
    assert all("onnxruntime" in rows[d]["serves"] or "digits v1" in rows[d]["serves"] for d in w.daemons)
    p.screenshot("fleet")

    # -- the state filters (a daemon on a loaded machine may miss its online window for a moment: state filters
    # are checked against what each listed line says, and the never-calling device must be among the offline ones)
    def only(state: str) -> bool:
        rows = fleet_rows(p)
        return bool(rows) and all(r["state"].startswith(state) for r in rows.values())

    filter_fleet(p, state="offline")
    # (reads of the live region go through p.until: a poll may replace it mid-read)
    p.until(lambda: "unplugged" in fleet_rows(p) and only("offline") and p.text("#count-devices") == str(N + 1)
            and f"{len(fleet_rows(p))} match" in p.text("#live"), "only offline devices listed, the fleet counted")
    polls = p.polls()
    p.until(lambda: p.polls() > polls, "a live update of the filtered page")
    p.until(lambda: "unplugged" in fleet_rows(p) and only("offline"), "the live update still filtered")
    filter_fleet(p, state="online")
    p.until(lambda: "unplugged" not in fleet_rows(p) and only("online"), "only online devices listed")

    # -- a good release: started from the page, watched step by step without a reload
    # (each step soaks 1.5 s after its devices committed: the page opens on step 1 of 2, its live updates, polled
    # every second, bring step 2 of 2 and the end)
    good = start_rollout(p, w.signed(2), "34, 100", min_devices=1, soak_s=1.5, max_failure_pct=0, min_reporting=1)
    marker = p.d.execute_script("window.__sameDocument = 1; return 1")
    steps_seen: list[str] = []

    def completed() -> bool:
        step = p.text("#rollout-step")
        if step and (not steps_seen or steps_seen[-1] != step):
            steps_seen.append(step)
        return p.text("#rollout-state") == "completed" and p.text("#total-committed") == str(N)

    p.until(completed, "the good rollout completed on every daemon, on the page", 120)
    assert p.d.execute_script("return window.__sameDocument") == marker, "the page reloaded instead of updating"
    assert p.polls() > 0
    assert steps_seen[0].startswith("1 of 2") and steps_seen[-1].startswith("2 of 2"), steps_seen
    assert all(v == [2] for v in w.serving().values()), w.serving()
    p.screenshot("rollout-completed")
    for d in w.daemons.values():  # traffic on version 2, for the models page's side-by-side comparison
        for _ in range(5):
            assert d.infer(x).status_code == 200

    # -- a broken release: halts in its first step with the failure-rate gate over its limit
    bad = start_rollout(p, w.signed(3), "50, 100", min_devices=2, soak_s=0.5, max_failure_pct=10, min_reporting=2)
    p.until(lambda: p.text("#rollout-state") == "halted", "the broken rollout halted, on the page", 90)
    gate = p.read(lambda: [c.text for c in p.all("#gates tr[data-gate='failure_rate'] td")])
    assert gate and float(gate[0]) > float(gate[1]) and gate[3] == "CROSSED", gate
    assert "failure_rate" in p.text("#rollout-reason")
    assert p.text("#rollout-step").startswith("1 of 2")
    p.screenshot("rollout-halted")

    # -- the rollouts list shows both, with their states
    p.open("/ui/rollouts")
    p.until(lambda: "completed" in p.text(f"tr[data-rollout='{good}']") and "halted" in p.text(
        f"tr[data-rollout='{bad}']"), "both rollouts listed")
    p.screenshot("rollouts")

    # -- roll the good one back from its page: confirm with a reason, then every daemon returns to version 1
    p.open(f"/ui/rollouts/{good}")
    p.d.find_element(p.by.ID, "action-rollback").click()
    p.until(lambda: "You are about to" in p.text("main"), "the rollback confirmation")
    assert f"roll back rollout {good}" in p.text("main")
    p.d.find_element(p.by.ID, "reason").send_keys("dashboard test")
    p.d.find_element(p.by.ID, "confirm").click()
    p.until(lambda: p.text("#rollout-state") == "rolled-back", "the rollout rolled back")
    assert "dashboard test" in p.text("#rollout-reason")
    wait_for(lambda: all(v == [1] for v in w.serving().values()), 60, "every daemon back on version 1")
    p.open("/ui/fleet")
    p.until(lambda: all("digits v1" in fleet_rows(p)[d]["serves"] for d in w.daemons), "the fleet back on v1")
    p.open("/ui/devices/dev-1")
    p.until(lambda: "rolled-back" in p.text("#history"), "the rollback in the device's update history")
    history = p.text("#history")
    assert "committed" in history and "last-known-good" in history

    # -- models and releases: versions, signatures, who runs what, per-version telemetry side by side
    p.open("/ui/models")
    p.until(lambda: p.all("tr[data-release]") and p.all("tr[data-version='3']"), "the models page")
    releases = p.read(lambda: {r.get_attribute("data-release"): r.text for r in p.all("tr[data-release]")})
    key_id = w.client.releases(MODEL)[0].key_id
    assert len(releases) == 2 and all(key_id in t for t in releases.values()), releases
    v1 = p.text("tr[data-version='1']").split()
    assert v1[0] == "v1" and int(v1[1]) == N and int(v1[2]) >= N * 5, v1  # devices running it, requests
    # version 2 against version 1, the figures the telemetry gates judge: error-rate change and p99 ratio
    p.until(lambda: "v1" in p.text("tr[data-version='2'] td:nth-of-type(7)"), "version 2 compared with version 1")
    cells = p.read(lambda: [c.text for c in p.all("tr[data-version='2'] td")])
    assert int(cells[1]) >= N * 5 and cells[7] == "+0.00 pp" and cells[8].endswith("\u00d7"), cells
    assert float(cells[8].rstrip("\u00d7")) > 0
    p.until(lambda: int(dict(p.d.execute_script(drawn)).get("chart-digits-rate", 0)) > 0, "the per-version chart")
    p.screenshot("models")
