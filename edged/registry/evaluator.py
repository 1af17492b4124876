"""Moves running rollouts on and halts unhealthy ones; every registry process runs one.

Each evaluation locks the rollout's row (PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so with
several processes one evaluates while the others skip it; SQLite: the write transaction
serialises), re-reads it, and decides from the database alone, so any process may do it
and a restart loses nothing. Times are wall-clock seconds because several processes
compare them; a step's soak time counts from the moment it had let all its members in
(see :func:`pace`) and enough of them committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from edged.protocol.fleet.release import TargetSelector
from edged.registry.db import ModelRow, ReleaseRow, RolloutRow, VersionRow
from edged.registry.gates import (
    Quality,
    Side,
    accumulate,
    crossed,
    halt_reason,
    needed_reports,
    quality_scores,
    readings,
    release_counts,
    waiting_for_quality,
)
from edged.registry.rollout_wire import StepSpec
from edged.registry.rollouts import (
    begin,
    enter_step,
    freeze_gates,
    own_limits,
    population,
    recount,
    step_base,
    step_gates,
)
from edged.registry.service import bump_revision
from edged.registry.targets import Ramp

log = logging.getLogger(__name__)
RECOUNT_S = 15.0  # a step short of devices looks for newly enrolled ones this often
HOLD_MIN_S = 10.0  # admission held for a busy registry stays held at least this long (each change is a revision)
Busy = Callable[[], str | None]


def pace(s: Session, ro: RolloutRow, t: float, busy: Busy | None) -> bool:
    """Hold the current step's admission while the registry is behind, let it go on once it is not;
    returns whether the step has let all its members in."""
    ramp = Ramp.load(ro.admission)
    if ramp is None:
        return True
    if ramp.done(t):
        ro.admission = None  # the same members as the ramp's end: no revision needed
        return True
    why = busy() if busy is not None else None
    held_at = (ro.gate_state or {}).get("admission_held_at")
    if why is not None and ramp.per_s > 0:
        ro.admission = ramp.held(t).dump()
        ro.gate_state = {**(ro.gate_state or {}), "admission_held": why, "admission_held_at": t}
        bump_revision(s)
        log.info("rollout %d: admission held: %s", ro.id, why)
    elif why is None and ramp.per_s <= 0 and (held_at is None or t - float(held_at) >= HOLD_MIN_S):
        ro.admission = ramp.resumed(t).dump()
        ro.gate_state = {k: v for k, v in (ro.gate_state or {}).items()
                         if k not in ("admission_held", "admission_held_at")}
        bump_revision(s)
        log.info("rollout %d: admission goes on", ro.id)
    return False


def evaluate(s: Session, ro: RolloutRow, now: float | None = None, busy: Busy | None = None) -> str | None:
    """One evaluation of a running rollout; returns what changed ("halted", "step 2", "completed") or None.

    ``busy``: why the registry should not let more devices start updating now (None: it may).
    """
    if ro.state != "running":
        return None
    t = time.time() if now is None else now
    rel = s.get_one(ReleaseRow, ro.release_id)
    model = s.get_one(ModelRow, ro.model_id).name
    selector = TargetSelector.model_validate(rel.selector)
    spec = StepSpec.model_validate(ro.steps[ro.step])
    gates = step_gates(ro)  # the rollout's, with the step's own thresholds where it sets them
    last = float((ro.gate_state or {}).get("recounted_at", 0.0))
    if ro.step_members < max(1, spec.min_devices) and t - last >= RECOUNT_S:
        recount(s, ro, selector)  # O(fleet): at most every RECOUNT_S
        ro.gate_state = {**ro.gate_state, "recounted_at": t}
    pop = population(ro, selector)  # whose word counts: every gate and the step's readiness use it
    counts = release_counts(s, ro.model_id, rel.number, pop)
    new, base = Side.load(None), Side.load(None)
    if gates.max_error_rate is not None or gates.max_p99_ratio is not None:
        new, base = accumulate(s, ro, model, s.get_one(VersionRow, rel.version_id).version, pop)
    quality = Quality()
    if gates.max_quality_drop is not None or gates.min_quality is not None:
        quality = quality_scores(s, ro.model_id, rel.number, pop)
    rs = own_limits(ro, readings(gates, counts, ro.step_members, new, base, quality=quality))
    bad = crossed(rs)
    if bad:
        freeze_gates(s, ro, rs)
        ro.state, ro.reason, ro.updated_at, ro.finished_at = "halted", halt_reason(bad), t, t
        if (ramp := Ramp.load(ro.admission)) is not None:
            ro.admission = ramp.held(t).dump()
        bump_revision(s)
        log.warning("rollout %d (model %s release %d) halted in step %d: %s", ro.id, model, rel.number,
                    ro.step + 1, ro.reason)
        return "halted"
    admitted = pace(s, ro, t, busy)
    members = ro.step_members
    if ro.step_ready_at is None and admitted:
        base_members, base_committed = step_base(ro)
        # enough of the step's own devices committed (all of them when there are fewer than min_devices)
        required = min(max(1, spec.min_devices), max(0, members - base_members))
        if (members > 0 and counts.committed >= base_committed + required
                and counts.finished >= needed_reports(gates, members) and not waiting_for_quality(rs)):
            ro.step_ready_at = t
            ro.updated_at = t
    if ro.step_ready_at is None or t - ro.step_ready_at < spec.soak_s:
        return None
    if ro.step + 1 >= len(ro.steps):
        freeze_gates(s, ro, rs)
        ro.state, ro.step, ro.reason, ro.updated_at, ro.finished_at = "completed", len(ro.steps), None, t, t
        bump_revision(s)
        log.info("rollout %d (model %s release %d) completed", ro.id, model, rel.number)
        return "completed"
    enter_step(s, ro, ro.step + 1, t, selector, committed=counts.committed)
    bump_revision(s)
    log.info("rollout %d (model %s release %d): step %d of %d, %d device(s)", ro.id, model, rel.number,
             ro.step + 1, len(ro.steps), ro.step_members)
    return f"step {ro.step + 1}"


def start_due(s: Session, ro: RolloutRow, t: float) -> str | None:
    """A scheduled rollout whose time came starts: its first step takes its members (``"started"``)."""
    if ro.state != "scheduled" or ro.start_at is None or ro.start_at > t:
        return None
    rel = s.get_one(ReleaseRow, ro.release_id)
    begin(s, ro, t, TargetSelector.model_validate(rel.selector), rel.number)
    bump_revision(s)
    log.info("rollout %d (release %d): its scheduled time came; step 1 of %d, %d device(s)", ro.id, rel.number,
             len(ro.steps), ro.step_members)
    return "started"


def tick(sessions: sessionmaker[Session], now: float | None = None, *,
         read_sessions: sessionmaker[Session] | None = None, busy: Busy | None = None) -> dict[int, str]:
    """Start the scheduled rollouts whose time came, then evaluate every running rollout once, each in its own
    transaction."""
    t = time.time() if now is None else now
    out: dict[int, str] = {}
    with (read_sessions or sessions)() as s:
        due = list(s.scalars(select(RolloutRow.id).where(RolloutRow.state == "scheduled", RolloutRow.start_at <= t)))
    for rid in due:
        with sessions() as s, s.begin():
            ro = s.scalar(select(RolloutRow).where(RolloutRow.id == rid, RolloutRow.state == "scheduled")
                          .with_for_update(skip_locked=True))
            if ro is not None and (what := start_due(s, ro, t)) is not None:
                out[rid] = what
    with (read_sessions or sessions)() as s:
        ids = list(s.scalars(select(RolloutRow.id).where(RolloutRow.state == "running")))
    for rid in ids:
        with sessions() as s, s.begin():
            ro = s.scalar(select(RolloutRow).where(RolloutRow.id == rid, RolloutRow.state == "running")
                          .with_for_update(skip_locked=True))
            if ro is None:
                continue  # finished meanwhile, or another process is evaluating it
            what = evaluate(s, ro, now, busy)
            if what is not None:
                out[rid] = what
    return out


class Evaluator:
    """A thread that calls :func:`tick` every ``interval_s`` while anything might be running."""

    def __init__(self, sessions: sessionmaker[Session], interval_s: float,
                 on_change: Callable[[dict[int, str]], None] | None = None,
                 read_sessions: sessionmaker[Session] | None = None, busy: Busy | None = None) -> None:
        self.sessions, self.interval_s, self.on_change = sessions, interval_s, on_change
        self.read_sessions, self.busy = read_sessions, busy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="registry-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                changed = tick(self.sessions, read_sessions=self.read_sessions, busy=self.busy)
                self.ticks += 1
                if changed and self.on_change is not None:
                    self.on_change(changed)
            except Exception:
                log.exception("rollout evaluation failed; trying again in %.1fs", self.interval_s)
