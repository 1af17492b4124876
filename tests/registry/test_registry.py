"""The registry server and its CLI, as real processes, on SQLite and on a real PostgreSQL server.

The whole module runs once per database (the ``backend`` fixture); PostgreSQL is started
from Debian's packages in a temp folder and skipped with a message when not installed.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edged.protocol.fleet.release import ReleaseManifest, TargetSelector, sign_release
from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec
from edged.registry.targets import RolloutTarget
from tests.http_client import web
from tests.registry.conftest import Env, registry_env
from tests.registry_helpers import ADMIN_TOKEN, RegistryServer, make_version
from tests.rollout_helpers import send_as_a_device

_n = itertools.count(1)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from registry_env(request, tmp_path_factory, "registry")


@pytest.fixture
def model(env: Env) -> str:
    return f"m{next(_n)}"


def push(env: Env, model: str, version: int, **kw: Any) -> Path:
    folder = make_version(env.tmp / "pub" / model / str(version), salt=f"{model}{version}", **kw)
    with env.server.client() as c:
        c.push_folder(folder, model, version)
    return folder


def enroll(env: Env, device_id: str, labels: dict[str, str] | None = None) -> str:
    """Enroll a new device; its labels come with the operator's enrollment token."""
    with env.server.client() as c:
        token = c.enrollment_token(labels=labels).token
    r = web().post(f"{env.url}/api/v1/enroll", json={"token": token, "device_id": device_id})
    assert r.status_code == 200, r.text
    return str(r.json()["credential"])


def desired(env: Env, cred: str, etag: str | None = None) -> httpx.Response:
    h = {"Authorization": f"Bearer {cred}"}
    if etag:
        h["If-None-Match"] = etag
    return web().get(f"{env.url}/api/v1/device/desired-state", headers=h)


# ---- schema ---------------------------------------------------------------------------------------
def test_migrations_match_the_models(env: Env) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from edged.registry.db import make_engine
    from edged.registry.migrate import current_revision, head_revision
    from edged.registry.schema import metadata

    engine = make_engine(env.database_url or f"sqlite:///{env.server.data_dir / 'registry.db'}")
    try:
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata())
        assert diff == []
        if env.backend == "sqlite":
            with engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()


def test_openapi_document_is_served(env: Env) -> None:
    doc = web().get(f"{env.url}/openapi.json").json()
    for path in ("/api/v1/enroll", "/api/v1/device/desired-state", "/api/v1/device/reports",
                 "/api/v1/blobs/{sha256}", "/api/v1/releases", "/api/v1/devices", "/api/v1/status"):
        assert path in doc["paths"], path
    assert web().get(f"{env.url}/docs").status_code == 200


# ---- publishing -----------------------------------------------------------------------------------
def test_cli_push_release_and_inspect(env: Env, model: str) -> None:
    srv = env.server
    folder = make_version(env.tmp / "cli" / model / "1", salt=model)
    out = srv.cli("push", str(folder), "--model", model).stdout
    assert "created" in out
    assert "identical" in srv.cli("push", str(folder), "--model", model).stdout
    # a key the registry does not trust: refused, nothing stored
    stranger = env.tmp / f"{model}-stranger.key"
    pub = srv.cli("keygen", "--out", str(stranger)).stdout.strip()
    assert len(base64.b64decode(pub)) == 32 and oct(stranger.stat().st_mode & 0o777) == "0o600"
    r = srv.cli("release", model, "1", "--key", str(stranger), check=False)
    assert r.returncode == 1 and "does not verify" in r.stderr
    out = srv.cli("release", model, "1", "--key", str(env.keys.path), "--label", "ring=canary",
                  "--check-folder", str(folder), "--json").stdout
    rel = json.loads(out)
    assert (rel["release"], rel["version"], rel["selector"]["labels"]) == (1, 1, {"ring": "canary"})
    releases = json.loads(srv.cli("releases", model, "--json").stdout)
    assert [x["release"] for x in releases] == [1]
    models = {m["name"]: m for m in json.loads(srv.cli("models", "--json").stdout)}
    assert models[model]["versions"] == [1] and models[model]["latest_release"] == 1
    st = json.loads(srv.cli("status", model, "--json").stdout)
    assert st["models"][0]["releases"][0]["release"] == 1


def test_push_refuses_inconsistent_versions(env: Env, model: str) -> None:
    folder = push(env, model, 1)
    with env.server.client() as c:
        from edged.registry.admin_client import RegistryClientError, folder_files

        files = [e for e, _ in folder_files(folder)]
        # versions are immutable: different files under the same number
        other = make_version(env.tmp / "pub" / model / "1b", salt="different")
        with pytest.raises(RegistryClientError, match="immutable"):
            c.push_folder(other, model, 1)
        # a file the manifest names is missing from the version
        with pytest.raises(RegistryClientError, match="not among the pushed files"):
            c._call("PUT", f"/models/{model}/versions/2",
                    json={"files": [f.model_dump() for f in files if f.path != "model.onnx"]})
        # a blob that was never uploaded
        bogus = [f.model_dump() for f in files] + [{"path": "extra.bin", "sha256": "0" * 64, "size": 1}]
        with pytest.raises(RegistryClientError, match="not uploaded"):
            c._call("PUT", f"/models/{model}/versions/3", json={"files": bogus})
        # an upload whose content does not match its address
        r = web().put(f"{env.url}/api/v1/blobs/{'1' * 64}", content=b"hello", headers=env.admin())
        assert r.status_code == 400 and "sha256" in r.json()["error"]["message"]


def test_release_checks(env: Env, model: str) -> None:
    push(env, model, 1)
    key = env.keys.load()
    with env.server.client() as c:
        from edged.registry.admin_client import RegistryClientError

        files = c.version(model, 1).files

        def post(m: ReleaseManifest, k: Any = key) -> httpx.Response:
            return web().post(f"{env.url}/api/v1/releases", content=sign_release(m, k).model_dump_json(),
                              headers={**env.admin(), "Content-Type": "application/json"})

        now = int(time.time())
        good = ReleaseManifest(model=model, version=1, release=5, issued_at=now, expires_at=now + 3600, files=files)
        assert post(good).status_code == 201
        assert post(good).status_code == 409  # the same number again
        lower = good.model_copy(update={"release": 4})
        assert "not above the latest" in post(lower).json()["error"]["message"]
        expired = good.model_copy(update={"release": 6, "issued_at": now - 7200, "expires_at": now - 3600})
        assert "expired" in post(expired).json()["error"]["message"]
        longer = files[-1].model_copy(update={"size": files[-1].size + 1})
        wrong_files = good.model_copy(update={"release": 6, "files": [*files[:-1], longer]})
        assert "file list differs" in post(wrong_files).json()["error"]["message"]
        missing = good.model_copy(update={"release": 6, "version": 9})
        assert post(missing).status_code == 404
        # a signature over different bytes
        signed = sign_release(good.model_copy(update={"release": 6}), key)
        forged = signed.model_copy(update={"manifest": base64.b64encode(
            good.model_copy(update={"release": 7}).canonical_bytes()).decode()})
        r = web().post(f"{env.url}/api/v1/releases", content=forged.model_dump_json(),
                       headers={**env.admin(), "Content-Type": "application/json"})
        assert r.status_code == 400 and "does not verify" in r.json()["error"]["message"]
        # the client takes the next number itself
        info = c.release(key, model, 1, expires_in_s=600)
        assert info.release == 6
        assert c.next_release(model) == 7
        with pytest.raises(RegistryClientError, match="not found"):
            c.version(model, 42)


# ---- devices --------------------------------------------------------------------------------------
def test_enrollment_tokens_and_credentials(env: Env, model: str) -> None:
    with env.server.client() as c:
        tok = c.enrollment_token(uses=1).token
        short = c.enrollment_token(uses=1, ttl_s=0.001).token
    first = web().post(f"{env.url}/api/v1/enroll", json={"token": tok, "device_id": f"{model}-a"})
    assert first.status_code == 200
    cred = first.json()["credential"]
    again = web().post(f"{env.url}/api/v1/enroll", json={"token": tok, "device_id": f"{model}-b"})
    assert again.status_code == 401  # one-time
    assert web().post(f"{env.url}/api/v1/enroll",
                      json={"token": short, "device_id": f"{model}-c"}).status_code == 401  # expired
    assert web().post(f"{env.url}/api/v1/enroll",
                      json={"token": "edge_guess", "device_id": f"{model}-d"}).status_code == 401
    assert web().post(f"{env.url}/api/v1/enroll",
                      json={"token": tok, "device_id": "bad/id"}).status_code == 422
    assert desired(env, cred).status_code == 200


def test_enrollment_token_cannot_take_over_an_existing_device(env: Env, model: str) -> None:
    """The attack: a valid enrollment token used on an enrolled device's id to steal its identity."""
    real = f"{model}-real"
    cred = enroll(env, real)
    with env.server.client() as c:
        fleet_token = c.enrollment_token(uses=1).token
    stolen = web().post(f"{env.url}/api/v1/enroll", json={"token": fleet_token, "device_id": real})
    assert stolen.status_code == 409, stolen.text
    err = stolen.json()["error"]
    assert err["code"] == "failed_precondition" and err["message"].startswith("device_id:")
    assert "credential" not in stolen.json()
    assert desired(env, cred).status_code == 200  # the real device keeps working
    # the refused attempt did not spend the single-use token: a new device still enrolls with it
    assert web().post(f"{env.url}/api/v1/enroll", json={"token": fleet_token, "device_id": f"{model}-new"}
                      ).status_code == 200

    # the device itself rotates its credential by proving it holds the current one
    auth = {"Authorization": f"Bearer {cred}"}
    rotated = web().post(f"{env.url}/api/v1/device/credential", headers=auth)
    assert rotated.status_code == 200 and rotated.json()["device_id"] == real
    cred2 = rotated.json()["credential"]
    assert desired(env, cred).status_code == 401 and desired(env, cred2).status_code == 200
    assert web().post(f"{env.url}/api/v1/device/credential", headers=auth).status_code == 401
    assert web().post(f"{env.url}/api/v1/device/credential").status_code == 401

    # an operator re-enrolls it (lost state, leaked credential): the old credential stops at once and
    # the single-use token enrolls this id only
    out = env.server.cli("reenroll", real, "--ttl", "1h", "--json")
    reenroll_token = json.loads(out.stdout)["token"]
    assert desired(env, cred2).status_code == 401
    other = web().post(f"{env.url}/api/v1/enroll", json={"token": reenroll_token, "device_id": f"{model}-x"})
    assert other.status_code == 403 and other.json()["error"]["message"].startswith("device_id:")
    back = web().post(f"{env.url}/api/v1/enroll", json={"token": reenroll_token, "device_id": real})
    assert back.status_code == 200, back.text
    assert desired(env, back.json()["credential"]).status_code == 200
    assert web().post(f"{env.url}/api/v1/enroll", json={"token": reenroll_token, "device_id": real}
                      ).status_code == 401  # spent
    assert env.server.cli("reenroll", f"{model}-unknown", check=False).returncode != 0


def test_device_cannot_label_itself_into_another_customers_release(env: Env, model: str) -> None:
    """The attack: customer A's device sets customer B's label to join B's rollout and fetch B's files."""
    push(env, model, 1)
    push(env, model, 2)
    a = enroll(env, f"{model}-a", {"customer": "a"})
    b = enroll(env, f"{model}-b", {"customer": "b"})
    with env.server.client() as c:
        r1 = c.release(env.keys.load(), model, 1, expires_in_s=600).release
        spec = RolloutCreate(model=model, release=0, steps=[StepSpec(percent=100)], gates=Gates(),
                             target=RolloutTarget(labels={"customer": "b"}))
        r2 = c.release_with_rollout(env.keys.load(), model, 2, spec, expires_in_s=600).release
        only_v2 = next(f.sha256 for f in c.version(model, 2).files if f.path == "labels.txt")

    def release_of(cred: str) -> int:
        return int({m["model"]: m["release"] for m in desired(env, cred).json()["models"]}[model])

    assert (release_of(a), release_of(b)) == (r1, r2)
    before = desired(env, a)
    h = {"Authorization": f"Bearer {a}"}
    r = web().put(f"{env.url}/api/v1/device/facts", headers=h,
                  json={"labels": {"customer": "b"}, "facts": {"profile": "x86-64-cpu"}})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "permission_denied" and r.json()["error"]["message"].startswith("labels:")
    # nothing changed: same desired state (ETag), B's files still refused, labels as the operator set them
    assert desired(env, a).headers["etag"] == before.headers["etag"] and release_of(a) == r1
    assert web().get(f"{env.url}/api/v1/blobs/{only_v2}", headers=h).status_code == 403
    with env.server.client() as c:
        assert c.device(f"{model}-a").labels == {"customer": "a"}
        assert c.device(f"{model}-a").facts == {}
    # facts alone are still accepted
    ok = web().put(f"{env.url}/api/v1/device/facts", headers=h, json={"facts": {"profile": "x86-64-cpu"}})
    assert ok.status_code == 200
    # nor can a device choose labels at enrollment beyond those its operator's token carries
    with env.server.client() as c:
        tok = c.enrollment_token(uses=2, labels={"customer": "a"}).token
    bad = web().post(f"{env.url}/api/v1/enroll", json={"token": tok, "device_id": f"{model}-c",
                                                       "labels": {"customer": "b"}})
    assert bad.status_code == 403 and bad.json()["error"]["message"].startswith("labels:")
    good = web().post(f"{env.url}/api/v1/enroll", json={"token": tok, "device_id": f"{model}-c",
                                                        "labels": {"customer": "a"}})
    assert good.status_code == 200 and release_of(good.json()["credential"]) == r1
    # operators relabel devices
    out = env.server.cli("label", f"{model}-a", "customer=b", "--json")
    assert json.loads(out.stdout)["labels"] == {"customer": "b"}
    assert release_of(a) == r2


def test_access_control(env: Env, model: str) -> None:
    push(env, model, 1)
    push(env, model, 2)
    cred = enroll(env, f"{model}-dev")
    dev_h = {"Authorization": f"Bearer {cred}"}
    with env.server.client() as c:
        c.release(env.keys.load(), model, 1, expires_in_s=600, selector=TargetSelector(devices=[f"{model}-dev"]))
        v1 = {f.path: f.sha256 for f in c.version(model, 1).files}
        v2 = {f.path: f.sha256 for f in c.version(model, 2).files}
    # publishing needs the admin token; a device credential is not one
    for h in ({}, dev_h, {"Authorization": "Bearer wrong-token-0123456789"}):
        assert web().get(f"{env.url}/api/v1/devices", headers=h).status_code == 401
        assert web().post(f"{env.url}/api/v1/enrollment-tokens", json={}, headers=h).status_code == 401
    # the admin token is not a device credential either
    assert desired(env, ADMIN_TOKEN).status_code == 401
    # a device reads only the files of releases meant for it
    assert web().get(f"{env.url}/api/v1/blobs/{v1['labels.txt']}", headers=dev_h).status_code == 200
    assert web().get(f"{env.url}/api/v1/blobs/{v2['labels.txt']}", headers=dev_h).status_code == 403
    assert web().get(f"{env.url}/api/v1/blobs/{v2['labels.txt']}").status_code == 401
    assert web().get(f"{env.url}/api/v1/blobs/{v2['labels.txt']}", headers=env.admin()).status_code == 200
    # and its reports land on itself only: there is no device id in the path to forge
    r = send_as_a_device("POST", f"{env.url}/api/v1/device/reports", dev_h, {"events": [
        {"seq": 1, "model": model, "step": "committed", "version": 1, "release": 1, "at": 0}]})
    assert r.json() == {"accepted": 1}
    with env.server.client() as c:
        assert [m.state for m in c.device(f"{model}-dev").models] == ["committed"]



def test_the_audit_log_refuses_updates_and_deletes(env: Env, model: str) -> None:
    """The audit log is append-only by the database's own triggers (migration 0008), one per dialect."""
    from sqlalchemy import text

    from edged.registry.db import make_engine

    push(env, model, 1)  # its upload and push are audited rows, whatever ran before
    engine = make_engine(env.database_url or f"sqlite:///{env.server.data_dir / 'registry.db'}")
    try:
        with engine.connect() as conn:
            n = conn.execute(text("SELECT count(*) FROM audit_log")).scalar()
            assert n
        for sql in ("UPDATE audit_log SET actor = 'someone else'", "DELETE FROM audit_log"):
            with pytest.raises(Exception, match="append-only"), engine.begin() as conn:
                conn.execute(text(sql))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM audit_log")).scalar() == n
            assert conn.execute(text("SELECT count(*) FROM audit_log WHERE actor = 'someone else'")).scalar() == 0
    finally:
        engine.dispose()

def test_desired_state_selectors_etag_pins_and_revocation(env: Env, model: str) -> None:
    push(env, model, 1)
    push(env, model, 2)
    canary = enroll(env, f"{model}-canary", {"ring": "canary"})
    stable = enroll(env, f"{model}-stable", {"ring": "stable"})
    key = env.keys.load()
    with env.server.client() as c:
        c.release(key, model, 1, expires_in_s=600)
        r2 = c.release(key, model, 2, expires_in_s=600, selector=TargetSelector(labels={"ring": "canary"}))

        def mine(cred: str) -> dict[str, int]:
            return {m["model"]: m["release"] for m in desired(env, cred).json()["models"]}

        assert mine(canary)[model] == r2.release
        assert mine(stable)[model] == 1
        # ETag: unchanged state answers 304, a change answers 200 with a new tag
        first = desired(env, stable)
        tag = first.headers["etag"]
        assert desired(env, stable, tag).status_code == 304
        # operators can relabel a device (admin labels win over what the device says)
        c.set_labels(f"{model}-stable", {"ring": "canary"})
        changed = desired(env, stable, tag)
        assert changed.status_code == 200 and changed.headers["etag"] != tag
        assert mine(stable)[model] == r2.release
        # per-device desired state: a pin overrides selectors
        c.pin(f"{model}-stable", model, 1)
        assert mine(stable)[model] == 1
        c.pin(f"{model}-stable", model, None)
        assert mine(stable)[model] == r2.release
        # revoking falls back to the previous release (which devices that took 2 will refuse)
        c.revoke(model, r2.release)
        assert mine(canary)[model] == 1
        devs = {d.device_id: d for d in c.devices({"ring": "canary"})}
        assert set(devs) >= {f"{model}-canary", f"{model}-stable"}


def test_blob_download_supports_ranges(env: Env, model: str) -> None:
    folder = push(env, model, 1)
    with env.server.client() as c:
        sha = next(f.sha256 for f in c.version(model, 1).files if f.path == "model.onnx")
    data = (folder / "model.onnx").read_bytes()
    url = f"{env.url}/api/v1/blobs/{sha}"
    full = web().get(url, headers=env.admin())
    assert full.content == data and full.headers["etag"] == f'"{sha}"'
    part = web().get(url, headers={**env.admin(), "Range": "bytes=100-", "If-Range": f'"{sha}"'})
    assert part.status_code == 206 and part.content == data[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    stale = web().get(url, headers={**env.admin(), "Range": "bytes=100-", "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == data
    assert web().get(url, headers={**env.admin(), "Range": f"bytes={len(data) + 5}-"}).status_code == 416


def test_reports_are_idempotent_and_summarised(env: Env, model: str) -> None:
    push(env, model, 1)
    with env.server.client() as c:
        rel = c.release(env.keys.load(), model, 1, expires_in_s=600)
    creds = [enroll(env, f"{model}-{i}") for i in range(3)]

    def report(cred: str, events: list[dict[str, Any]]) -> int:
        r = send_as_a_device("POST", f"{env.url}/api/v1/device/reports", {"Authorization": f"Bearer {cred}"},
                             {"events": events})
        assert r.status_code == 200, r.text
        return int(r.json()["accepted"])

    def ev(seq: int, step: str, reason: str | None = None) -> dict[str, Any]:
        return {"seq": seq, "model": model, "step": step, "version": 1, "release": rel.release, "reason": reason,
                "at": 1.0}

    batch = [ev(1, "downloading"), ev(2, "verifying"), ev(3, "prepared"), ev(4, "active-trial"), ev(5, "committed")]
    assert report(creds[0], batch) == 5
    assert report(creds[0], batch) == 0  # a resend after a lost answer
    assert report(creds[1], [ev(1, "downloading"), ev(2, "rolled-back", "golden check failed")]) == 2
    assert report(creds[2], [ev(7, "failed", "sha256 mismatch")]) == 1
    assert report(creds[2], [ev(6, "downloading")]) == 1  # late, older: stored but does not move the state
    with env.server.client() as c:
        st = c.status(model)
        assert st.models[0].releases[0].devices == {"committed": 1, "rolled-back": 1, "failed": 1}
        d = c.device(f"{model}-1")
        assert d.models[0].reason == "golden check failed"
        assert [e.step for e in d.events] == ["downloading", "rolled-back"]
    bad = send_as_a_device("POST", f"{env.url}/api/v1/device/reports", {"Authorization": f"Bearer {creds[0]}"},
                           {"events": [{**ev(9, "committed"), "step": "hacked"}]})
    assert bad.status_code == 422


def test_oversized_json_body_is_refused(env: Env) -> None:
    r = web().post(f"{env.url}/api/v1/enroll", content=b"{" + b" " * (9 << 20) + b"}",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_no_secrets_in_logs(env: Env, model: str) -> None:
    cred = enroll(env, f"{model}-secret")
    web().get(f"{env.url}/api/v1/device/desired-state", headers={"Authorization": f"Bearer {cred}x"})
    with env.server.client() as c:
        tok = c.enrollment_token().token
    web().post(f"{env.url}/api/v1/enroll", json={"token": tok + "x", "device_id": "d", "labels": {"a": "b"}})
    log = env.server.log()
    for secret in (ADMIN_TOKEN, cred, tok):
        assert secret not in log
        assert secret[5:25] not in log


def test_two_registry_processes_share_one_database(env: Env, model: str) -> None:
    """Stateless processes behind a load balancer: publish through one, serve devices from the other."""
    if env.backend != "postgresql":
        pytest.skip("several registry processes share PostgreSQL (SQLite is the one-machine default)")
    second = RegistryServer(env.tmp / "second", [env.keys.public], database_url=env.database_url,
                            extra_args=["--blob-dir", str(env.server.data_dir / "blobs")]).start()
    try:
        push(env, model, 1)
        cred = enroll(env, f"{model}-lb")
        with second.client() as c:
            assert model in {m.name for m in c.models()}
            rel = c.release(env.keys.load(), model, 1, expires_in_s=600)
        got = web().get(f"{second.url}/api/v1/device/desired-state", headers={"Authorization": f"Bearer {cred}"})
        assert {m["model"]: m["release"] for m in got.json()["models"]}[model] == rel.release
        sha = next(m for m in got.json()["models"] if m["model"] == model)["signed"]["manifest"]
        files = json.loads(base64.b64decode(sha))["files"]
        blob = web().get(f"{second.url}/api/v1/blobs/{files[0]['sha256']}", headers={"Authorization": f"Bearer {cred}"})
        assert blob.status_code == 200 and len(blob.content) == files[0]["size"]
    finally:
        second.stop()
