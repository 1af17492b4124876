"""Who may call what, over every route of the app, and the audit log of what they did.

The routes are taken from the app itself (``app.routes``): a route added without an access rule in
``edged.registry.access.RULES`` fails ``test_every_route_has_a_rule`` and is refused by the server.
Each rule is then tried over real HTTP against a real registry (SQLite; PostgreSQL in the slow set) with a viewer
token, a releaser token, a device credential, no credential and dashboard sessions of a viewer and a
releaser operator.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.access import RULES, Kind, principal
from edged.registry.admin_client import RegistryClient, RegistryClientError
from edged.registry.passwords import hash_password
from edged.registry.roles import Role
from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.http_client import web
from tests.registry.conftest import Env, registry_env
from tests.registry_helpers import ADMIN_TOKEN, PY, REPO_ROOT, Keys, make_version

MODEL = "acc"
QUERY = {"/api/v1/models/{model}/rollback": "?to=1"}  # not the current release (2); "previous" has none
# what a releaser's actions name in the sweep: nothing that exists, so the sweep changes nothing
NOTHING = {
    "sha256": "0" * 64,
    "model": "no-model",
    "version": "9",
    "number": "9",
    "device_id": "no-device",
    "rollout_id": "999",
    "action": "pause",
    "name": "nobody",
}
PASSWORD = "operator password for tests"


def app_routes(tmp: Path, keys: Keys) -> dict[tuple[str, str], Any]:
    """Every (method, path) the registry app answers, as FastAPI lists them (HEAD goes with GET), and its route."""
    from fastapi.routing import iter_route_contexts

    from edged.registry.api import create_app
    from edged.registry.settings import RegistrySettings

    (tmp / "admin.token").write_text(ADMIN_TOKEN)
    app = create_app(
        RegistrySettings(data_dir=tmp / "data", admin_token_file=tmp / "admin.token", public_keys=[keys.public])
    )
    return {
        (m, rc.path): rc.original_route
        for rc in iter_route_contexts(app.routes)
        for m in rc.methods or ()
        if m != "HEAD"
    }


# The rules are the app's, checked before any query: the same on either database. The PostgreSQL repeat
# runs with the slow set; the audit log's append-only triggers, which are the database's own, are held on
# both databases always (tests/registry/test_registry.py).
@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    conf = tmp_path_factory.mktemp("access-conf") / "registry.toml"
    h = hash_password(PASSWORD)
    # no load shedding: on a busy test machine it would answer device writes 503 before anyone is authenticated
    conf.write_text(
        f"[registry]\nshed_loop_lag_s = 0\n"
        f'[registry.operators]\nvera = "{h}"\nrex = "{h}"\n[registry.operator_roles]\nvera = "viewer"\n'
    )
    yield from registry_env(request, tmp_path_factory, "access", extra_args=["--config", str(conf)])


@dataclass
class World:
    env: Env
    client: Any
    tokens: dict[str, str]  # viewer, releaser -> token
    device: str  # a device credential
    values: dict[str, str]  # what fills each path parameter

    def url(self, path: str, values: dict[str, str] | None = None) -> str:
        fill = values or self.values
        return self.env.url + re.sub(r"\{(\w+)\}", lambda m: fill[m.group(1)], path) + QUERY.get(path, "")


@pytest.fixture(scope="module")
def world(env: Env) -> Iterator[World]:
    c = env.server.client()
    for v in (1, 2):
        c.push_folder(make_version(env.tmp / "pub" / str(v), salt=f"acc{v}"), MODEL, v)
        c.release(env.keys.load(), MODEL, v, expires_in_s=3600)
    enroll = c.enrollment_token(labels={"fleet": MODEL}).token
    r = web().post(f"{env.url}/api/v1/enroll", json={"token": enroll, "device_id": "acc-d1"}, timeout=10)
    r.raise_for_status()
    ro = c.create_rollout(
        RolloutCreate(
            model=MODEL,
            release=2,
            steps=[StepSpec(percent=100)],
            gates=Gates(min_reporting=1),
            target=RolloutTarget(labels={"fleet": MODEL}),
        )
    )
    tokens = {role: c.create_token(f"ci-{role}", role).token for role in ("viewer", "releaser")}
    values = {
        "sha256": c.version(MODEL, 1).files[0].sha256,
        "model": MODEL,
        "version": "1",
        "number": "1",
        "device_id": "acc-d1",
        "rollout_id": str(ro.id),
        "action": "nosuch",
        "name": "nobody",
    }
    yield World(env, c, tokens, r.json()["credential"], values)
    c.close()


def test_every_route_has_a_rule(tmp_path: Path) -> None:
    routes = app_routes(tmp_path, Keys.make(tmp_path))
    assert set(routes) - set(RULES) == set(), "routes without an access rule in edged.registry.access.RULES"
    assert set(RULES) - set(routes) == set(), "rules for routes the app does not have"
    # an API route that changes something takes the operator (access.Actor): its audit row needs the actor
    takes_actor = {
        key
        for key, route in routes.items()
        if any(d.call is principal for d in getattr(getattr(route, "dependant", None), "dependencies", []))
    }
    changes = {k for k, r in RULES.items() if r.kind is Kind.OPERATOR and r.role > Role.VIEWER}
    assert changes - takes_actor == {("POST", "/api/v1/blobs/missing")}  # a question, answered with a POST


def test_a_route_without_a_rule_is_refused(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from edged.registry.api import create_app
    from edged.registry.settings import RegistrySettings

    (tmp_path / "admin.token").write_text(ADMIN_TOKEN)
    app = create_app(
        RegistrySettings(
            data_dir=tmp_path / "data",
            admin_token_file=tmp_path / "admin.token",
            public_keys=[Keys.make(tmp_path).public],
        )
    )

    @app.get("/api/v1/added-later")
    def added() -> dict[str, str]:
        return {"secret": "x"}

    r = TestClient(app).get("/api/v1/added-later", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 403 and "secret" not in r.text


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def call(w: World, method: str, path: str, headers: dict[str, str], values: dict[str, str] | None = None) -> int:
    """The status of one request (a JSON ``{}`` body on anything but GET); its answer is in the log on failure."""
    body = None if method == "GET" else "{}"
    h = {**headers, **({"Content-Type": "application/json"} if body else {})}
    r = web().request(method, w.url(path, values), content=body, headers=h, timeout=30, follow_redirects=True)
    print(method, path, r.status_code, r.text[:300])
    return r.status_code


def test_roles_over_every_api_route(world: World) -> None:
    viewer, releaser = bearer(world.tokens["viewer"]), bearer(world.tokens["releaser"])
    device = bearer(world.device)
    for (method, path), rule in sorted(RULES.items(), key=lambda kv: kv[0][1]):
        where = f"{method} {path}"
        if rule.kind is Kind.OPERATOR:
            assert call(world, method, path, {}) == 401, where
            assert call(world, method, path, device) == 401, where  # a device credential is no operator's
            if method == "GET":
                assert 200 <= call(world, method, path, viewer) < 300, where
            else:
                assert call(world, method, path, viewer) == 403, where
                got = call(world, method, path, releaser, NOTHING)
                assert (got == 403) == (rule.role is Role.ADMIN), (where, got)
                assert got != 401, where
        elif rule.kind is Kind.DEVICE:
            # an operator's token, even the bootstrap admin's, is not a device credential
            for who in (viewer, bearer(ADMIN_TOKEN)):
                assert call(world, method, path, who) in (401, 422), where
        elif rule.kind is Kind.BLOB:
            assert call(world, method, path, {}) == 401, where
            assert call(world, method, path, viewer) == 200, where
        elif rule.kind is Kind.PUBLIC and method == "GET":
            world.values["name"] = "dash.css"  # the one public route with a parameter: a static file
            assert call(world, method, path, {}) == 200, where
            world.values["name"] = "nobody"


def test_device_routes_take_device_credentials_only(world: World) -> None:
    """The device routes answer the device's credential (so the 401s above are about who called)."""
    dev, viewer = bearer(world.device), bearer(world.tokens["viewer"])
    for method, path, body in (
        ("GET", "/api/v1/device/desired-state", None),
        ("POST", "/api/v1/device/reports", {"events": []}),
        ("PUT", "/api/v1/device/facts", {}),
        ("POST", INGEST_PATH, {"buffer_id": "b-1"}),
    ):
        assert web().request(method, world.env.url + path, json=body, headers=dev, timeout=30).status_code == 200
        assert web().request(method, world.env.url + path, json=body, headers=viewer, timeout=30).status_code == 401, (
            path
        )


def login(w: World, name: str) -> tuple[httpx.Client, str]:
    h = httpx.Client(base_url=w.env.url, timeout=30)
    r = h.post("/ui/login", data={"name": name, "token": PASSWORD})
    assert r.status_code == 303, r.text
    page = h.get("/ui/fleet").text
    return h, page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_roles_over_every_dashboard_route(world: World) -> None:
    viewer, csrf = login(world, "vera")
    releaser, rcsrf = login(world, "rex")
    rid = world.values["rollout_id"]
    try:
        for (method, path), rule in RULES.items():
            if rule.kind is not Kind.PAGE:
                continue
            url = world.url(path)
            if method == "GET":
                assert viewer.get(url, follow_redirects=True).status_code == 200, path
                # an API token is no session
                assert (
                    web()
                    .get(url, params={"part": "live"}, headers=bearer(world.tokens["releaser"]), timeout=30)
                    .status_code
                    == 401
                ), path
            elif rule.role > Role.VIEWER:  # a forged action, with a valid CSRF token: refused for the role
                r = viewer.post(url, data={"csrf": csrf, "confirmed": "yes", "steps": "100", "pick": f"{MODEL}:2"})
                assert r.status_code == 403 and "viewer" in r.text, (path, r.status_code)
                got = releaser.post(world.url(path, NOTHING), data={"csrf": rcsrf}).status_code
                assert got not in (401, 403), (path, got)
        # a viewer is offered no action; a releaser is
        page = viewer.get(f"/ui/rollouts/{rid}").text
        assert "Signed in as vera (viewer)" in page and 'id="action-' not in page and "/pause" not in page
        assert 'id="create-rollout"' not in viewer.get("/ui/rollouts").text
        assert 'id="action-pause"' in releaser.get(f"/ui/rollouts/{rid}").text
        assert 'id="create-rollout"' in releaser.get("/ui/rollouts").text
    finally:
        viewer.close()
        releaser.close()


def cli(w: World, token: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"EDGED_REGISTRY_URL": w.env.url, "EDGED_REGISTRY_TOKEN": token, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [PY, "-m", "edged.registry", *args], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120
    )
    assert not check or r.returncode == 0, r.stderr
    return r


def test_named_tokens_and_the_audit_log(world: World) -> None:
    made = json.loads(cli(world, ADMIN_TOKEN, "token", "create", "ci-alice", "--role", "releaser", "--json").stdout)
    alice = made["token"]
    assert made["role"] == "releaser" and made["created_by"] == "bootstrap" and alice.startswith("edgt_")
    listed = world.client.tokens()
    assert "ci-alice" in [t.name for t in listed] and alice not in str(listed)  # the registry keeps its sha256 only
    # a releaser labels devices, but makes no token
    cli(world, alice, "label", "acc-d1", "ring=<b>canary</b>")
    as_alice = RegistryClient(world.env.url, alice, source="cli")
    with pytest.raises(RegistryClientError, match="403"):
        as_alice.create_token("ci-mallory", "admin")
    # the dashboard's actions are in the same log, with the operator's name
    h, csrf = login(world, "rex")
    rid = world.values["rollout_id"]
    try:
        r = h.post(f"/ui/rollouts/{rid}/pause", data={"csrf": csrf, "confirmed": "yes", "reason": "<i>night</i>"})
        assert r.status_code == 303, r.text
        page = h.get("/ui/audit").text
        assert "&lt;i&gt;night&lt;/i&gt;" in page and "<i>night" not in page  # escaped
        assert "&lt;b&gt;canary" in page
    finally:
        h.close()
    assert world.client.revoke_token("ci-alice").revoked_at is not None
    with pytest.raises(RegistryClientError, match="401"):  # revoked: refused from the next request on
        as_alice.devices()
    as_alice.close()
    log = json.loads(cli(world, world.tokens["viewer"], "audit", "--limit", "4", "--json").stdout)["entries"]
    assert [(e["actor"], e["source"], e["action"], e["target"]) for e in log] == [
        ("bootstrap", "api", "token.revoke", "token ci-alice"),
        ("rex", "dashboard", "rollout.pause", f"rollout {rid}"),
        ("ci-alice", "cli", "device.labels", "device acc-d1"),
        ("bootstrap", "cli", "token.create", "token ci-alice"),
    ]
    assert log[1]["reason"] == "<i>night</i>" and log[1]["role"] == "releaser"
    # what the fixture did to set the registry up is there too, by the bootstrap admin over the API
    done = {(e.actor, e.action) for e in world.client.audit(limit=1000).entries}
    for action in ("blob.upload", "version.push", "release.create", "enrollment-token.create", "rollout.create"):
        assert ("bootstrap", action) in done, action
    text = cli(world, world.tokens["viewer"], "audit", "--limit", "2").stdout
    assert "token.revoke" in text and "rollout.pause" in text and "device.labels" not in text
