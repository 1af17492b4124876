"""Sign-in attempts are bounded per client address, and refused ones cost no password check.

The guard itself with a clock the test moves (edged.registry.web.login_guard), then over HTTP
against a real registry: an address that failed ten times is refused even with the right
token until its failures age out, while another address signs in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edged.registry.passwords import hash_password
from edged.registry.web.login_guard import LoginGuard
from tests.registry_helpers import ADMIN_TOKEN, Keys, RegistryServer


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_failures_lock_an_address_until_they_age_out() -> None:
    clock = Clock()
    g = LoginGuard(max_failures=3, window_s=60, max_addresses=100, clock=clock)
    for _ in range(2):
        g.failed("10.0.0.1")
        clock.t += 10
    assert g.retry_after("10.0.0.1") is None  # two failures: may still try
    g.failed("10.0.0.1")
    assert g.retry_after("10.0.0.1") == pytest.approx(40.0)  # until the first failure is 60 s old
    assert g.retry_after("10.0.0.2") is None  # others are not affected
    clock.t += 40
    assert g.retry_after("10.0.0.1") is None  # one failure aged out: one more try
    g.failed("10.0.0.1")
    assert g.retry_after("10.0.0.1") == pytest.approx(10.0)
    # a success forgets the address's failures
    g.succeeded("10.0.0.1")
    assert g.retry_after("10.0.0.1") is None
    g.failed("10.0.0.1")
    assert g.retry_after("10.0.0.1") is None


def test_made_up_addresses_cost_a_fixed_amount_of_memory() -> None:
    clock = Clock()
    g = LoginGuard(max_failures=2, window_s=60, max_addresses=50, clock=clock)
    g.failed("victim")
    g.failed("victim")
    for i in range(10_000):
        g.failed(f"10.1.{i // 256}.{i % 256}")
        g.failed(f"10.1.{i // 256}.{i % 256}")
    assert len(g._failures) == 50
    # the most recent are the ones kept (each got only its two tries)
    assert g.retry_after("10.1.39.15") is not None and g.retry_after("victim") is None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    tmp: Path = tmp_path_factory.mktemp("login")
    keys = Keys.make(tmp)
    conf = tmp / "registry.toml"
    conf.write_text(f"[registry.operators]\nalice = \"{hash_password('right password')}\"\n")
    srv = RegistryServer(tmp, [keys.public], extra_args=["--config", str(conf)]).start()
    yield srv
    srv.stop()


def test_an_address_that_keeps_failing_is_refused_without_a_check(server: RegistryServer) -> None:
    other = httpx.Client(base_url=server.url, timeout=30, follow_redirects=False,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with other, httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as mine:
        for i in range(10):
            data = {"name": "alice", "token": f"guess {i}"} if i % 2 else {"token": f"guess {i}"}
            r = other.post("/ui/login", data=data)
            assert r.status_code == 401, (i, r.status_code)
        # the eleventh try is refused before the token is looked at: even the right one
        for data in ({"token": ADMIN_TOKEN}, {"name": "alice", "token": "right password"}):
            r = other.post("/ui/login", data=data)
            assert r.status_code == 429 and "set-cookie" not in r.headers
            assert 0 < int(r.headers["retry-after"]) <= 300 and "Too many failed sign-ins" in r.text
        # another address is not locked out
        r = mine.post("/ui/login", data={"name": "alice", "token": "right password"})
        assert r.status_code == 303 and "edged_session" in r.headers["set-cookie"]
