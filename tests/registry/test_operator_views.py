"""What the operator sees agrees with what the fleet does (issue 40): one real ``edged run`` daemon and one
registry process; a trial shows as ``trial`` with the version on trial in the API, the CLI and the dashboard."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.registry_helpers import ADMIN_TOKEN, EdgedRun, Keys, RegistryServer, device_toml, free_port, make_version
from tests.registry_helpers import wait_for as _wait_for

MODEL = "digits"
DEVICE = "trial-dev"
FLEET = {"fleet": "views-test"}


@dataclass
class World:
    tmp: Path
    keys: Keys
    server: RegistryServer
    client: Any
    daemon: EdgedRun


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    return _wait_for(pred, timeout, 0.2, what)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("operator-views")
    keys = Keys.make(tmp)
    server = RegistryServer(tmp, [keys.public], extra_args=["--rollout-tick", "0.2s"]).start()
    client = server.client()
    pub = tmp / "pub"
    make_version(pub / "1", salt="v1")
    client.push_folder(make_version(pub / "2", salt="v2"), MODEL, 2)
    token = client.enrollment_token(uses=1, labels=FLEET).token
    home = tmp / DEVICE
    repo = home / "repo"
    shutil.copytree(pub / "1", repo / MODEL / "1")
    port = free_port()
    cfg = device_toml(home, repo, server.url, [keys.public], token=token, device_id=DEVICE, http_port=port,
                      poll_s=0.2)
    # A long trial: the checks below happen while it runs. facts_interval_s: the periodic resend must not be
    # what tells the registry about the trial.
    cfg.write_text(cfg.read_text() + "trial_s = 600\nretry_max_s = 2.0\nfacts_interval_s = 3600\n")
    daemon = EdgedRun(cfg, port, home / "daemon.log")
    try:
        daemon.start()
        daemon.wait_http(90)
        wait_for(lambda: len(client.devices(FLEET)) == 1, 60, "the daemon enrolled")
        yield World(tmp, keys, server, client, daemon)
    finally:
        daemon.stop()
        client.close()
        server.stop()


def dashboard(w: World) -> httpx.Client:
    h = httpx.Client(base_url=w.server.url, timeout=30, follow_redirects=False)
    r = h.post("/ui/login", data={"token": ADMIN_TOKEN})
    assert r.status_code == 303, r.text
    return h


def test_a_trial_shows_as_trial_of_the_new_version_in_api_cli_and_dashboard(world: World) -> None:
    w = world
    spec = RolloutCreate(model=MODEL, release=0, steps=[StepSpec(percent=100)],
                         gates=Gates(max_failure_rate=0.5, min_reporting=1), target=RolloutTarget(labels=FLEET))
    ro = w.client.release_with_rollout(w.keys.load(), MODEL, 2, spec, expires_in_s=3600)

    def on_trial() -> bool:
        steps = [m.state for m in w.client.device(DEVICE).models if m.model == MODEL and m.release == ro.release]
        return steps == ["active-trial"]

    wait_for(on_trial, 90, "the daemon to start its trial of version 2")
    assert 2 in w.daemon.versions(), "clients already get version 2"
    # The trial lasts ten minutes and facts are resent hourly: only the facts sent as the trial began can say so.
    wait_for(lambda: [(s.version, s.state) for s in w.client.device(DEVICE).serving if s.model == MODEL]
             == [(2, "trial")], 20, "the API to show the trial")
    row = next(line for line in w.server.cli("devices").stdout.splitlines() if line.startswith(DEVICE))
    assert f"v2 (r{ro.release}) trial" in row, row
    h = dashboard(w)
    fleet, device = h.get("/ui/fleet").text, h.get(f"/ui/devices/{DEVICE}").text
    h.close()
    assert f"v2 (r{ro.release})" in fleet and "<small>trial</small>" in fleet, fleet
    assert f"v2 (r{ro.release})" in device and "<small>trial</small>" in device, device


def test_the_engine_a_daemon_serves_on_is_a_fact_a_rollout_can_target(world: World) -> None:
    from edged.registry.targets import RolloutTarget

    facts = world.client.device(DEVICE).facts
    assert facts.get("engines.probed") is False  # the daemon does not try the engine libraries at start
    assert facts.get("engines.onnxruntime.available") is True, facts  # but it serves on ONNX Runtime
    assert "engines.openvino.available" not in facts  # not tried, not claimed either way
    assert RolloutTarget(facts={"engines.onnxruntime.available": "true"}).matches(DEVICE, FLEET, facts)
