"""The descriptor budget (issue 36, attack 7): caps sized from RLIMIT_NOFILE, the soft limit raised."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from edged.config import parse_config
from edged.descriptors import plan

GRPC = '[grpc]\nlisten = "127.0.0.1:0"\n'


def test_configured_caps_that_fit_are_kept() -> None:
    p = plan(parse_config(GRPC), soft=65536, hard=65536, in_use=40)
    assert (p.http_connections, p.http_backlog, p.grpc_connections, p.reduced) == (1000, 500, 1000, False)


def test_caps_that_do_not_fit_are_scaled_down_to_leave_the_reserve() -> None:
    cfg = parse_config(GRPC + "[descriptors]\nreserve = 100\n")
    p = plan(cfg, soft=1024, hard=1024, in_use=50)
    assert p.reduced
    used = p.http_connections + p.http_backlog + p.grpc_connections + 16
    assert used <= 1024 - 50 - 100, p
    assert p.http_connections == p.grpc_connections > 300, p  # scaled together, in proportion
    assert "scaled" not in p.describe() and "limit 1024" in p.describe()


def test_no_grpc_listener_gets_no_share() -> None:
    p = plan(parse_config(""), soft=1024, hard=4096, in_use=30)
    assert p.grpc_connections == 0 and p.http_connections + p.http_backlog <= 1024 - 30 - 256


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = ("import resource; from edged.descriptors import raise_soft_limit; print(raise_soft_limit()); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run(["prlimit", "--nofile=256:2048", "--", sys.executable, "-c", code], capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert out[0] == "(2048, 2048, 256)" and out[1] == "(2048, 2048)", out
