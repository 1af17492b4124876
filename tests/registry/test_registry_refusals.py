"""Refusals say what they are, and an enrollment token's lifetime is bounded.

A real ``edged-registry serve`` process per database (SQLite and PostgreSQL), spoken to over HTTP:

* a missing or refused device credential, or enrollment token, is ``401 unauthenticated`` on every
  device route (the fast path's, the routers', telemetry ingest's), never ``invalid_argument``;
  a known device asking for a file outside its releases is ``403 permission_denied``;
* the operator client types refusals as the registry does: 401 ``UNAUTHENTICATED``, 403 ``PERMISSION_DENIED``;
* an enrollment or re-enrollment token's ``ttl_s`` is finite, above 0 and at most 30 days: beyond it the
  API answers ``400 invalid_argument`` naming ``ttl_s`` (a number out of range, as every other), and the
  client and the CLI refuse it as a typed error before sending.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import MAX_ENROLL_TTL_S
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.admin_client import RegistryClient, RegistryClientError
from tests.http_client import web
from tests.registry.conftest import Env, registry_env
from tests.rollout_helpers import ApiDevice

_n = itertools.count(1)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    conf = tmp_path_factory.mktemp("refusals-conf") / "registry.toml"
    conf.write_text("[registry]\nshed_loop_lag_s = 0\n")  # judged on content, never shed on a busy machine
    yield from registry_env(request, tmp_path_factory, "refusals", extra_args=["--config", str(conf)])


def _device(env: Env) -> ApiDevice:
    with env.server.client() as c:
        token = c.enrollment_token().token
    return ApiDevice.enroll(env.url, token, f"ref-{next(_n)}")


def _refusal(r: httpx.Response, status: int) -> dict[str, str]:
    """The ``error`` object of an answer that must have ``status``."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    err: dict[str, str] = r.json()["error"]
    return err


def test_a_refused_device_credential_is_unauthenticated_on_every_device_route(env: Env) -> None:
    dev = _device(env)
    asks: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/api/v1/device/desired-state", None),  # the fast path
        ("POST", "/api/v1/device/reports", {"events": []}),
        ("PUT", "/api/v1/device/facts", {"facts": {}}),
        ("POST", "/api/v1/device/credential", None),
        ("POST", INGEST_PATH, {"buffer_id": "b", "items": []}),
        ("GET", f"/api/v1/blobs/{'0' * 64}", None)]
    for headers in ({}, {"Authorization": "Bearer edged_dev_not-a-credential"}):
        for method, path, body in asks:
            r = web().request(method, env.url + path, json=body, headers=headers, timeout=30)
            assert _refusal(r, 401)["code"] == "unauthenticated", (method, path, headers)
    r = web().post(f"{env.url}/api/v1/enroll", json={"token": "edge_guess", "device_id": f"ref-{next(_n)}"})
    assert _refusal(r, 401)["code"] == "unauthenticated"
    # known, but not allowed: a file outside the device's releases
    r = web().get(f"{env.url}/api/v1/blobs/{'0' * 64}", headers=dev.auth, timeout=30)
    assert _refusal(r, 403)["code"] == "permission_denied"


def test_the_operator_client_types_refusals_as_the_registry_does(env: Env) -> None:
    with env.server.client() as c:
        viewer = c.create_token(f"viewer-{next(_n)}", "viewer").token
    with RegistryClient(env.url, "not-a-token-0123456789") as stranger, pytest.raises(RegistryClientError) as e:
        stranger.devices()
    assert (e.value.status, e.value.code) == (401, ErrorCode.UNAUTHENTICATED)
    with RegistryClient(env.url, viewer) as v, pytest.raises(RegistryClientError) as e:
        v.enrollment_token()
    assert (e.value.status, e.value.code) == (403, ErrorCode.PERMISSION_DENIED)


def test_an_enrollment_tokens_lifetime_is_finite_and_at_most_30_days(env: Env) -> None:
    dev = _device(env)
    admin = {**env.admin(), "Content-Type": "application/json"}
    paths = ["/api/v1/enrollment-tokens", f"/api/v1/devices/{dev.id}/reenroll"]
    # out of range or not finite: 400, as every number out of range; not a number at all: 422
    bad = {"1e300": 400, str(MAX_ENROLL_TTL_S + 1): 400, "0": 400, "-5": 400, "1e999": 400, "Infinity": 400,
           "NaN": 400, '"forever"': 422}
    for path in paths:
        for ttl, status in bad.items():
            r = web().post(env.url + path, content=f'{{"ttl_s": {ttl}}}', headers=admin, timeout=30)
            err = _refusal(r, status)
            assert err["code"] == "invalid_argument" and "ttl_s" in err["message"], (path, ttl, err)
    # the refused re-enrollment left the device's credential alone
    assert dev.poll().status_code == 200
    with env.server.client() as c:
        before = time.time()
        tok = c.enrollment_token(ttl_s=MAX_ENROLL_TTL_S)
        assert before + MAX_ENROLL_TTL_S <= tok.expires_at <= time.time() + MAX_ENROLL_TTL_S
        for ttl_s in (1e300, float("inf"), float("nan"), 0.0):
            with pytest.raises(RegistryClientError) as e:
                c.enrollment_token(ttl_s=ttl_s)
            assert e.value.code is ErrorCode.INVALID_ARGUMENT and "ttl_s" in str(e.value), ttl_s
            with pytest.raises(RegistryClientError) as e:
                c.reenroll(dev.id, ttl_s=ttl_s)
            assert e.value.code is ErrorCode.INVALID_ARGUMENT and "ttl_s" in str(e.value), ttl_s
    assert dev.poll().status_code == 200
    for argv in (["enroll-token", "--ttl", "31d"], ["reenroll", dev.id, "--ttl", "31d"]):
        out = env.server.cli(*argv, check=False)
        assert out.returncode == 1 and "ttl_s" in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
    assert dev.poll().status_code == 200
