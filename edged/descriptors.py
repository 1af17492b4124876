"""The daemon's file-descriptor budget (issue 36, attack 7).

Every TCP connection costs a descriptor. Without caps, 20,000 idle gRPC connections took them
all and the shared-memory socket, HTTP health checks and model files could no longer open one.
At start the soft ``RLIMIT_NOFILE`` is raised to the hard limit, the descriptors already open are
counted, a reserve is set aside (``[descriptors] reserve``), and the HTTP and gRPC connection caps
(and HTTP's accept backlog, which the kernel hands over in bursts) are sized to fit in the rest:
a configured cap is kept when it fits, scaled down with a warning when it does not.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

from edged.config import Config

log = logging.getLogger(__name__)

HTTP_BACKLOG = 512  # accept queue: asyncio accepts up to this many at once, each a descriptor until refused
GRPC_BURST = 16  # grpcio accepts one at a time and closes those over its cap at once
MIN_CAP = 8
_INFINITE_TARGET = 1 << 20


@dataclass(frozen=True)
class DescriptorPlan:
    soft: int  # the soft limit in force after start
    hard: int  # -1: unlimited
    raised_from: int | None  # the soft limit before edged raised it
    in_use: int  # open when the plan was made (models loaded, before the listeners)
    reserve: int
    http_connections: int
    http_backlog: int
    grpc_connections: int
    reduced: bool  # a configured cap did not fit and was scaled down

    def describe(self) -> str:
        hard = "unlimited" if self.hard < 0 else str(self.hard)
        raised = f" (raised from {self.raised_from})" if self.raised_from is not None else ""
        return (f"descriptors: limit {self.soft}{raised}, hard {hard}, {self.in_use} open, reserve {self.reserve}; "
                f"HTTP at most {self.http_connections} connections (accept backlog {self.http_backlog}), "
                f"gRPC at most {self.grpc_connections}")


def open_descriptors() -> int:
    """Descriptors this process holds now (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def raise_soft_limit() -> tuple[int, int, int | None]:
    """Soft limit to the hard one where allowed: ``(soft, hard, soft before or None if unchanged)``;
    hard is -1 when unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = hard == resource.RLIM_INFINITY
    target = _nr_open() if infinite else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target, -1 if infinite else hard, soft
        except (OSError, ValueError) as e:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, target, e)
    if soft == resource.RLIM_INFINITY:
        soft = target
    return soft, -1 if infinite else hard, None


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return min(int(f.read()), _INFINITE_TARGET)
    except (OSError, ValueError):
        return _INFINITE_TARGET


def plan(cfg: Config, *, soft: int, hard: int, in_use: int, raised_from: int | None = None) -> DescriptorPlan:
    """Size the listeners' caps so that listeners + reserve + what is open fit under ``soft``."""
    reserve = cfg.descriptors.reserve
    http_want = cfg.http.max_connections if cfg.http.enabled else 0
    backlog_want = min(HTTP_BACKLOG, max(16, http_want // 2)) if http_want else 0
    grpc_on = cfg.grpc is not None and cfg.grpc.enabled
    grpc_want = cfg.grpc.max_connections if cfg.grpc is not None and grpc_on else 0
    burst = GRPC_BURST if grpc_on else 0
    want = http_want + backlog_want + grpc_want
    room = soft - in_use - reserve - burst
    if want <= room:
        return DescriptorPlan(soft, hard, raised_from, in_use, reserve, http_want, backlog_want, grpc_want, False)
    f = max(room, 0) / want

    def scaled(n: int) -> int:
        return max(MIN_CAP, int(n * f)) if n else 0

    return DescriptorPlan(soft, hard, raised_from, in_use, reserve, scaled(http_want), scaled(backlog_want),
                          scaled(grpc_want), True)


def plan_for_daemon(cfg: Config) -> DescriptorPlan:
    """Raise the limit (unless configured not to), count, plan, and log what was chosen."""
    if cfg.descriptors.raise_soft_limit:
        soft, hard, before = raise_soft_limit()
    else:
        s, h = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft, hard, before = (_nr_open() if s == resource.RLIM_INFINITY else s,
                              -1 if h == resource.RLIM_INFINITY else h, None)
    p = plan(cfg, soft=soft, hard=hard, in_use=open_descriptors(), raised_from=before)
    if p.reduced:
        log.warning("%s: the configured caps (HTTP %d, gRPC %s) do not fit the descriptor limit and were scaled "
                    "down; raise LimitNOFILE (systemd) or lower [http]/[grpc] max_connections", p.describe(),
                    cfg.http.max_connections, cfg.grpc.max_connections if cfg.grpc is not None else "-")
    else:
        log.info("%s", p.describe())
    return p
