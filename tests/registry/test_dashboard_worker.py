"""The dashboard's pages read and rendered in a process of their own (edged.registry.web.worker).

The child answers what the registry's own threads would, passes refusals back as refusals,
is replaced when it dies, and never outlives the registry. The browser test
(test_dashboard.py) drives the pages through it over HTTP; bench/dashboard_cost.py measures
what it spares the device polls.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.errors import ErrorCode
from edged.registry.db import make_engine, make_sessionmaker, readonly
from edged.registry.desired import SnapshotCache
from edged.registry.migrate import upgrade
from edged.registry.service import RegistryError
from edged.registry.web.pages import PageAsk, Pages
from edged.registry.web.worker import InProcess, PageProcess
from tests.registry.test_rollout_scale import populate
from tests.registry_helpers import PY, REPO_ROOT

DEVICES = 25


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('pages') / 'registry.db'}"
    engine = make_engine(url)
    upgrade(engine)
    populate(engine, DEVICES)
    engine.dispose()
    return url


@pytest.fixture
def child(db_url: str) -> Iterator[PageProcess]:
    p = PageProcess(db_url, poll_s=5.0, online_s=60.0)
    yield p
    p.close()


def devices_on(body: bytes | None) -> set[str]:
    assert body is not None
    return set(re.findall(r'href="/ui/devices/([\w.:-]+)"', body.decode()))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its parent) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_the_child_renders_what_the_registry_threads_render(db_url: str, child: PageProcess) -> None:
    engine = readonly(make_engine(db_url))
    here = InProcess(Pages(make_sessionmaker(engine), SnapshotCache(), poll_s=5.0, online_s=60.0))
    ask = PageAsk(name="fleet", csrf="c" * 16, who="alice", here="/ui/fleet")
    there, local = asyncio.run(child.render(ask)), asyncio.run(here.render(ask))
    assert there.error is None and there.body is not None
    assert len(devices_on(there.body)) == DEVICES and devices_on(there.body) == devices_on(local.body)
    assert "alice" in there.body.decode() and 'value="' + "c" * 16 in there.body.decode()
    # a filter is applied there too
    for profile, kept in (("x86-64-cpu", DEVICES), ("jetson-orin", 0)):
        sub = asyncio.run(child.render(PageAsk(name="fleet", query={"profile": profile})))
        assert len(devices_on(sub.body)) == kept, profile
    # the live region: its ETag, and no body when the page already has it
    live = asyncio.run(child.render(PageAsk(name="fleet", query={"part": "live"})))
    assert live.body is not None and live.etag.startswith('"')
    again = asyncio.run(child.render(PageAsk(name="fleet", query={"part": "live"}, if_none_match=live.etag)))
    assert again.body is None and again.etag == live.etag and again.error is None
    # every page renders there
    for name, key in (("models", ""), ("rollouts", ""), ("device", "dev-3")):
        out = asyncio.run(child.render(PageAsk(name=name, key=key)))
        assert out.error is None and out.body is not None and b"</html>" in out.body, name
    engine.dispose()


def test_a_refusal_comes_back_as_a_refusal(child: PageProcess) -> None:
    out = asyncio.run(child.render(PageAsk(name="device", key="no-such-device")))
    assert out.body is None and out.error is not None and out.error[1] == 404
    with pytest.raises(RegistryError) as e:
        out.raise_error()
    assert e.value.code is ErrorCode.NOT_FOUND and "no-such-device" in e.value.message
    assert asyncio.run(child.render(PageAsk(name="nothing"))).error is not None


def test_a_killed_child_is_replaced(child: PageProcess) -> None:
    first = child.pid()
    os.kill(first, signal.SIGKILL)
    out = asyncio.run(child.render(PageAsk(name="fleet")))
    assert out.error is None and len(devices_on(out.body)) == DEVICES
    assert child.pid() != first


def test_the_child_ends_with_the_registry(db_url: str) -> None:
    # closed: the child is gone and pages are refused as "stopping"
    p = PageProcess(db_url, poll_s=5.0, online_s=60.0)
    pid = p.pid()
    p.close()
    assert not alive(pid)
    with pytest.raises(RegistryError) as e:
        asyncio.run(p.render(PageAsk(name="fleet")))
    assert e.value.status == 503
    # killed: a registry that had no time to say so still leaves no child behind
    script = textwrap.dedent(f"""
        import os, signal
        from edged.registry.web.worker import PageProcess
        p = PageProcess({db_url!r}, poll_s=5.0, online_s=60.0)
        print(p.pid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == -signal.SIGKILL, r.stderr
    orphan = int(r.stdout.strip())
    deadline = time.monotonic() + 10
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(orphan)
