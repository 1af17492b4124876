"""Rollouts: a release going to a target in steps, its progress, and the operator's controls.

A rollout gates its release: the release is offered only to the rollout's members (see
:mod:`edged.registry.desired`). Steps admit devices by stable hashing (percent steps) or
by an explicit group; :mod:`edged.registry.evaluator` moves a running rollout on when a
step has enough committed devices and its soak time passed with every health gate
(:mod:`edged.registry.gates`) green, and halts it when a gate is crossed; the members of
a halted or rolled-back rollout are told to return to their last-known-good. Every change
that alters what devices are offered bumps the registry revision.
"""

from __future__ import annotations

import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from edged.protocol.fleet.release import TargetSelector
from edged.registry.db import (
    DeviceEventRow,
    DeviceRow,
    ModelRow,
    ReleaseRow,
    RolloutRow,
    VersionRow,
)
from edged.registry.decommission import is_decommissioned
from edged.registry.gates import Population, Side, quality_scores, readings, release_counts, telemetry_watermark
from edged.registry.rollout_wire import (
    ACTIVE_STATES,
    PROGRESS,
    STEP_PROGRESS,
    Admission,
    GateReading,
    Gates,
    MemberProgress,
    RolloutCreate,
    RolloutInfo,
    RolloutStatus,
    StepProgress,
    StepSpec,
)
from edged.registry.service import bump_revision, conflict, create_release, get_model, invalid, not_found
from edged.registry.targets import Membership, Ramp, RolloutTarget, percent_cutoff, rank, selector_matches

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ACTIONS = ("pause", "resume", "abort", "rollback")


# ---- devices a rollout is for -------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    id: str
    labels: dict[str, Any]
    facts: dict[str, Any]


def targeted(s: Session, ro: RolloutRow, selector: TargetSelector) -> list[Candidate]:
    """Enrolled devices the rollout's target and its release's signed selector both select (O(fleet))."""
    target = RolloutTarget.model_validate(ro.target)
    out = []
    rows = s.execute(select(DeviceRow.id, DeviceRow.admin_labels, DeviceRow.facts).order_by(DeviceRow.id)).all()
    for r in rows:
        labels = dict(r.admin_labels or {})  # operator-owned only (see DeviceRow.effective_labels)
        facts = r.facts or {}
        if is_decommissioned(labels):  # it will never call again: no step may wait for it
            continue
        if selector_matches(selector, r.id, labels) and target.matches(r.id, labels, facts):
            out.append(Candidate(r.id, labels, facts))
    return out


def membership(ro: RolloutRow, step: int | None = None, *, admitted: bool = True) -> Membership:
    """Members up to ``step`` (default: the current one); ``admitted=False``: the whole current step, also
    the devices its ramp has not let in yet."""
    k = ro.step if step is None else step
    if ro.state == "scheduled":
        k = -1  # not started: no step, no member
    ramp = Ramp.load(ro.admission) if admitted and k == ro.step else None
    return Membership.of(RolloutTarget.model_validate(ro.target), ro.salt, list(ro.steps), list(ro.cutoffs), k,
                         ramp=ramp)


# rollout id -> (what decides its membership apart from the cutoffs, the verdicts known)
_KNOWN: OrderedDict[int, tuple[str, dict[str, tuple[bool, str, int]]]] = OrderedDict()
_KNOWN_ROLLOUTS = 32


def _known_members(ro: RolloutRow, selector: TargetSelector) -> dict[str, tuple[bool, str, int]] | None:
    """This process's record of the rollout's known members (see :class:`Population`), kept for the last
    few rollouts evaluated; forgotten if what decides membership apart from the cutoffs ever differs."""
    if ro.id is None:
        return None
    what = json.dumps([ro.target, ro.salt, ro.steps, selector.model_dump(mode="json")], sort_keys=True)
    entry = _KNOWN.get(ro.id)
    if entry is None or entry[0] != what:
        entry = _KNOWN[ro.id] = (what, {})
    _KNOWN.move_to_end(ro.id)
    while len(_KNOWN) > _KNOWN_ROLLOUTS:
        _KNOWN.popitem(last=False)
    return entry[1]


def population(ro: RolloutRow, selector: TargetSelector) -> Population:
    """THE decision of whose reports, scores and telemetry a rollout's gates and completion count: its
    members up to the current step (admitted, and selected by the release's own signed selector); and
    for the previous version's telemetry, the devices it targets. Every gate reading uses this."""
    members = membership(ro)
    target = RolloutTarget.model_validate(ro.target)

    def member(device: str, labels: dict[str, Any], facts: dict[str, Any]) -> bool:
        return selector_matches(selector, device, labels) and members.member(device, labels, facts)

    def targeted(device: str, labels: dict[str, Any], facts: dict[str, Any]) -> bool:
        return selector_matches(selector, device, labels) and target.matches(device, labels, facts)

    uses_facts = bool(target.facts or target.profiles) or any(
        g.facts or g.profiles for g in members.groups)
    cut = json.dumps([ro.step, ro.cutoffs, members.current_cutoff() if members.ramp is not None else None])
    return Population(member, targeted, facts=uses_facts, known=_known_members(ro, selector), cut=cut)


def counted(s: Session, ro: RolloutRow, device_id: str, labels: dict[str, Any], facts: dict[str, Any]) -> bool:
    """Whether the rollout counts what this device says about its release (for pages that show it)."""
    rel = s.get_one(ReleaseRow, ro.release_id)
    return population(ro, TargetSelector.model_validate(rel.selector)).member(device_id, labels, facts)


ADMIT_FIRST_S = 2.0  # a paced step lets in this many seconds' worth of devices at once


def enter_step(s: Session, ro: RolloutRow, k: int, now: float, selector: TargetSelector, *,
               committed: int, devices: list[Candidate] | None = None) -> None:
    """Start step ``k``: fix its rank cutoff (percent steps), count the members so far, and with
    ``admit_per_minute`` set, ramp the cutoff up from the previous step's instead of jumping to it.

    ``committed``: devices that committed the release before this step; the step is ready
    when enough of its own devices committed on top of them.
    """
    devices = targeted(s, ro, selector) if devices is None else devices
    ro.gate_state = {**(ro.gate_state or {}), "step_base": {"members": ro.step_members if k else 0,
                                                            "committed": committed}}
    spec = StepSpec.model_validate(ro.steps[k])
    cutoffs = list(ro.cutoffs)[:k] + [None] * max(0, k - len(ro.cutoffs))
    if spec.percent is not None:
        earlier = max([c for c in cutoffs if c is not None], default=-1.0)
        previous = cutoffs[k] if k < len(ro.cutoffs) and ro.cutoffs[k] is not None else -1.0
        cut = percent_cutoff([rank(ro.salt, d.id) for d in devices], spec.percent, spec.min_devices)
        cutoffs.append(max(cut, earlier, previous))
    else:
        cutoffs.append(None)
    ro.cutoffs = cutoffs
    ro.step = k
    ro.admission = None
    members = membership(ro, k)
    ro.step_members = sum(1 for d in devices if members.member(d.id, d.labels, d.facts))
    if spec.percent is not None and ro.admit_per_minute and devices:
        ro.admission = _ramp(ro, cutoffs, devices, now)
    ro.step_started_at = now
    ro.step_ready_at = None
    ro.updated_at = now


def _ramp(ro: RolloutRow, cutoffs: list[Any], devices: list[Candidate], now: float) -> dict[str, float] | None:
    """The ramp of a percent step's cutoff, or None when its new members are few enough to let in at once.

    Ranks are evenly spread, so ``admit_per_minute`` devices a minute is that share of the targeted
    devices' rank range a minute; a step admits its first ``ADMIT_FIRST_S`` seconds' worth at once.
    """
    assert ro.admit_per_minute is not None
    to = float(cutoffs[-1])
    start = max([float(c) for c in cutoffs[:-1] if c is not None], default=-1.0)
    fresh = sum(1 for d in devices if start < rank(ro.salt, d.id) <= to)
    if fresh <= ro.admit_per_minute / 60.0 * ADMIT_FIRST_S:
        return None
    rate_s = ro.admit_per_minute / 60.0 / len(devices)
    begin = max(start, 0.0)
    ramp = Ramp(begin, now - ADMIT_FIRST_S, rate_s, rate_s, to)
    return ramp.dump()  # a step is only entered by a running rollout: a pause holds the ramp in act()


def recount(s: Session, ro: RolloutRow, selector: TargetSelector) -> None:
    """A step short of devices (a small or growing fleet): place devices that enrolled since it began."""
    started, ready, base, admission = ro.step_started_at, ro.step_ready_at, step_base(ro), ro.admission
    enter_step(s, ro, ro.step, ro.step_started_at, selector, committed=base[1])
    ro.gate_state = {**ro.gate_state, "step_base": {"members": base[0], "committed": base[1]}}
    ro.step_started_at, ro.step_ready_at = started, ready
    if admission is None or ro.admission is None:
        ro.admission = None
    else:  # keep admitting from where it was, up to the (possibly moved) cutoff
        ro.admission = {**admission, "to": ro.admission["to"]}


def step_base(ro: RolloutRow) -> tuple[int, int]:
    """(members, committed devices) when the current step began."""
    b = (ro.gate_state or {}).get("step_base") or {}
    return int(b.get("members", 0)), int(b.get("committed", 0))


# ---- create ---------------------------------------------------------------------------------------
def _release_row(s: Session, model_id: int, number: int) -> ReleaseRow:
    row = s.scalar(select(ReleaseRow).where(ReleaseRow.model_id == model_id, ReleaseRow.number == number))
    if row is None:
        raise not_found(f"release {number}")
    return row


def _latest_rollouts(s: Session, model_id: int) -> dict[int, RolloutRow]:
    out: dict[int, RolloutRow] = {}
    for ro in s.scalars(select(RolloutRow).where(RolloutRow.model_id == model_id).order_by(RolloutRow.id)):
        out[ro.release_id] = ro
    return out


def default_baseline(s: Session, model_id: int, below: int) -> int | None:
    """The version of the newest release below ``below`` that the whole fleet may run (no rollout, or completed)."""
    latest = _latest_rollouts(s, model_id)
    for r in s.scalars(select(ReleaseRow).where(ReleaseRow.model_id == model_id, ReleaseRow.number < below,
                                                ReleaseRow.revoked_at.is_(None)).order_by(ReleaseRow.number.desc())):
        ro = latest.get(r.id)
        if ro is None or ro.state == "completed":
            return s.get_one(VersionRow, r.version_id).version
    return None


def _require_evaluation(v: VersionRow, model: str) -> None:
    """A quality gate on a version without an evaluation set could never be judged: refuse it up front."""
    try:
        has = "evaluation" in tomllib.loads(v.manifest_toml)
    except tomllib.TOMLDecodeError:
        has = False
    if not has:
        raise invalid(f"model {model!r} version {v.version} has no [evaluation] set in its model.toml: the quality "
                      "gates (max_quality_drop, min_quality) could never be judged")


def create_rollout(s: Session, req: RolloutCreate, public_keys: list[str], *,
                   admit_per_minute: float = 0.0) -> RolloutInfo:
    """``admit_per_minute``: the registry's default pace for a rollout that names none (0: at once)."""
    m = get_model(s, req.model)
    active = s.scalar(select(RolloutRow).where(RolloutRow.model_id == m.id, RolloutRow.state.in_(ACTIVE_STATES)))
    if active is not None:
        raise conflict(f"rollout {active.id} of model {req.model!r} is {active.state}; abort it or let it finish "
                       "first")
    if req.signed is not None:
        info = create_release(s, req.signed, public_keys)
        if info.model != req.model:
            raise invalid(f"the signed release is for model {info.model!r}, not {req.model!r}")
        number = info.release
    else:
        assert req.release is not None
        number = req.release
    rel = _release_row(s, m.id, number)
    if rel.revoked_at is not None:
        raise conflict(f"release {number} of model {req.model!r} is revoked")
    if req.gates.max_quality_drop is not None or req.gates.min_quality is not None:
        _require_evaluation(s.get_one(VersionRow, rel.version_id), req.model)
    now = time.time()
    baseline = req.baseline_version if req.baseline_version is not None else default_baseline(s, m.id, number)
    later = req.start_at is not None and req.start_at > now
    ro = RolloutRow(model_id=m.id, release_id=rel.id, state="scheduled" if later else "running",
                    target=req.target.model_dump(mode="json"), start_at=req.start_at if later else now,
                    steps=[st.model_dump(mode="json") for st in req.steps], gates=req.gates.model_dump(mode="json"),
                    salt=req.salt or req.model, step=0, cutoffs=[], step_members=0, step_started_at=now,
                    baseline_version=baseline, gate_state={}, notes=req.notes,
                    created_at=now, updated_at=now,
                    admit_per_minute=(req.admit_per_minute if req.admit_per_minute is not None
                                      else admit_per_minute) or None)
    if not later:
        begin(s, ro, now, TargetSelector.model_validate(rel.selector), number)
    s.add(ro)
    s.flush()
    bump_revision(s)
    return rollout_info(s, ro)


def begin(s: Session, ro: RolloutRow, now: float, selector: TargetSelector, release: int) -> None:
    """Start ``ro`` now (created to run at once, or its scheduled time came): its first step takes its members."""
    ro.state, ro.updated_at, ro.step_started_at = "running", now, now
    ro.gate_state = {**(ro.gate_state or {}), "watermark": telemetry_watermark(s)}
    enter_step(s, ro, 0, now, selector, committed=0)
    # members that committed the release before the rollout began (a pin, an earlier rollout): the step
    # needs its own commits on top of them
    ro.gate_state = {**ro.gate_state, "step_base": {
        "members": 0, "committed": release_counts(s, ro.model_id, release, population(ro, selector)).committed}}


# ---- read -----------------------------------------------------------------------------------------
def get_rollout(s: Session, rollout_id: int, *, lock: bool = False) -> RolloutRow:
    q = select(RolloutRow).where(RolloutRow.id == rollout_id)
    ro = s.scalar(q.with_for_update() if lock else q)
    if ro is None:
        raise not_found(f"rollout {rollout_id}")
    return ro


def rollout_info(s: Session, ro: RolloutRow) -> RolloutInfo:
    row = s.execute(select(ModelRow.name, ReleaseRow.number, VersionRow.version)
                    .join(ReleaseRow, ReleaseRow.model_id == ModelRow.id)
                    .join(VersionRow, VersionRow.id == ReleaseRow.version_id)
                    .where(ReleaseRow.id == ro.release_id)).one()
    return RolloutInfo(id=ro.id, model=row.name, release=row.number, version=row.version, state=ro.state,
                       step=ro.step, steps=[StepSpec.model_validate(x) for x in ro.steps],
                       target=RolloutTarget.model_validate(ro.target), gates=Gates.model_validate(ro.gates),
                       salt=ro.salt, baseline_version=ro.baseline_version, reason=ro.reason,
                       members=ro.step_members, step_started_at=ro.step_started_at, step_ready_at=ro.step_ready_at,
                       created_at=ro.created_at, updated_at=ro.updated_at, finished_at=ro.finished_at, notes=ro.notes,
                       admit_per_minute=ro.admit_per_minute, admission=admission_info(ro), start_at=ro.start_at)


def admission_info(ro: RolloutRow, now: float | None = None) -> Admission | None:
    """Where the current step's ramp stands, while it still has devices to let in."""
    ramp = Ramp.load(ro.admission)
    t = time.time() if now is None else now
    if ramp is None or ramp.done(t):
        return None
    held = ramp.per_s <= 0
    why = str((ro.gate_state or {}).get("admission_held") or "") if held and ro.state == "running" else ""
    return Admission(cutoff=ramp.cutoff(t), to=ramp.to, held=held, done_at=ramp.finish_at(t),
                     reason=why or (f"rollout {ro.state}" if held else None))


def list_rollouts(s: Session, model: str | None = None, state: str | None = None) -> list[RolloutInfo]:
    q = select(RolloutRow).order_by(RolloutRow.id)
    if model is not None:
        q = q.where(RolloutRow.model_id == get_model(s, model).id)
    if state is not None:
        q = q.where(RolloutRow.state == state)
    return [rollout_info(s, ro) for ro in s.scalars(q)]


def _last_reports(s: Session, model: str, release: int, *, full: bool) -> dict[str, Any]:
    """Each device's last report about one release: its progress there, even after it moved on to another.
    Rows with device_id and step (``full``: also version, reason, detail, received_at)."""
    e = DeviceEventRow
    cols = [e.device_id, e.step] + ([e.version, e.reason, e.detail, e.received_at] if full else [])
    out: dict[str, Any] = {}
    for row in s.execute(select(*cols).where(e.model == model, e.release_number == release).order_by(e.seq)):
        out[row.device_id] = row
    return out


def _member(d: str, joined: int, progress: str, ev: Any) -> MemberProgress:
    detail = ev.detail if ev is not None and isinstance(ev.detail, dict) else {}

    def num(key: str) -> float | None:
        v = detail.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    req, err = num("requests"), num("errors")
    return MemberProgress(device_id=d, step=joined, progress=progress, report=ev.step if ev else None,
                          version=ev.version if ev else None, reason=ev.reason if ev else None,
                          at=ev.received_at if ev else None, requests=None if req is None else int(req),
                          errors=None if err is None else int(err), p99_ms=num("p99_ms"))


def rollout_status(s: Session, rollout_id: int, *, with_members: bool = False) -> RolloutStatus:
    """Progress per step (O(fleet): an operator's query, not a device's) and the gate readings.

    A member's progress is its last report about this release, not the last report it made at
    all: after a rollback a device reports its last-known-good release again, and still counts
    here as rolled back. When the rollout ended, members that never began are "not started".
    """
    ro = get_rollout(s, rollout_id)
    info = rollout_info(s, ro)
    rel = s.get_one(ReleaseRow, ro.release_id)
    selector = TargetSelector.model_validate(rel.selector)
    devices = targeted(s, ro, selector)
    reports = _last_reports(s, info.model, info.release, full=with_members)
    waiting = "pending" if ro.state in ACTIVE_STATES else "not_started"
    last = min(ro.step, len(ro.steps) - 1)
    members = [membership(ro, k) for k in range(last + 1)]
    whole_step = membership(ro, admitted=False) if ro.admission is not None else None
    not_admitted = 0
    per_step = [dict.fromkeys(PROGRESS, 0) for _ in ro.steps]
    listed: list[MemberProgress] = []
    for d in devices:
        joined = next((k for k, mem in enumerate(members) if mem.member(d.id, d.labels, d.facts)), None)
        if joined is None:
            if whole_step is not None and whole_step.member(d.id, d.labels, d.facts):
                not_admitted += 1
            continue
        ev = reports.get(d.id)
        where = STEP_PROGRESS.get(ev.step, waiting) if ev is not None else waiting
        per_step[joined][where] += 1
        if with_members:
            listed.append(_member(d.id, joined, where, ev))
    steps = []
    for k, spec in enumerate(info.steps):
        steps.append(StepProgress(index=k, select=spec.describe(), soak_s=spec.soak_s,
                                  status=step_status(ro.state, ro.step, k),
                                  members=sum(per_step[k].values()), counts=per_step[k]))
    totals = {p: sum(x[p] for x in per_step) for p in PROGRESS}
    final = (ro.gate_state or {}).get(FINAL_GATES)
    if ro.state not in ACTIVE_STATES and isinstance(final, list):  # frozen when it ended (freeze_gates)
        gate_readings = [GateReading.model_validate(x) for x in final]
    else:
        gate_readings = live_readings(s, ro, info.release, selector)
    soak_left = None
    if ro.state in ACTIVE_STATES and ro.step_ready_at is not None and ro.step < len(ro.steps):
        clock = float((ro.gate_state or {}).get("paused_at") or time.time()) if ro.state == "paused" else time.time()
        soak_left = max(0.0, info.steps[ro.step].soak_s - (clock - ro.step_ready_at))
    return RolloutStatus(rollout=info, targeted=len(devices), totals=totals, steps=steps, gates=gate_readings,
                         soak_left_s=soak_left, not_admitted=not_admitted, members=listed)


def step_status(state: str, current: int, k: int) -> str:
    """A step as the rollout's state machine sees it: a stopped rollout's step is where it stopped, not current."""
    if state == "scheduled":
        return "waiting"
    if state == "completed" or k < current:
        return "done"
    if state in ACTIVE_STATES:
        return "current" if k == current else "waiting"
    return state if k == current else "not-reached"  # halted, aborted, rolled-back: that step is where it ended


# ---- gate readings: live while the rollout runs, frozen when it ends -------------------------------
FINAL_GATES = "final_gates"  # in RolloutRow.gate_state: the readings as they stood at the end


def _last_step(ro: RolloutRow) -> tuple[int, StepSpec]:
    """The current step, or the last one of a completed rollout (its index == len(steps))."""
    k = min(ro.step, len(ro.steps) - 1)
    return k, StepSpec.model_validate(ro.steps[k])


def step_gates(ro: RolloutRow) -> Gates:
    """The gates the current (or last) step is judged by: the rollout's, with the step's own thresholds."""
    return _last_step(ro)[1].judged_by(Gates.model_validate(ro.gates))


def own_limits(ro: RolloutRow, rs: list[GateReading]) -> list[GateReading]:
    """Readings whose limit is the step's own say so (the gate table shows where a limit came from)."""
    k, spec = _last_step(ro)
    own = {g for g, v in (("failure_rate", spec.max_failure_rate), ("min_reporting", spec.min_reporting))
           if v is not None}
    return [r.model_copy(update={"detail": f"{r.detail}; step {k + 1}'s own limit"}) if r.gate in own else r
            for r in rs]


def live_readings(s: Session, ro: RolloutRow, release: int, selector: TargetSelector) -> list[GateReading]:
    acc = ro.gate_state or {}
    pop = population(ro, selector)
    counts = release_counts(s, ro.model_id, release, pop)
    quality = quality_scores(s, ro.model_id, release, pop)
    return own_limits(ro, readings(step_gates(ro), counts, ro.step_members, Side.load(acc.get("new")),
                                   Side.load(acc.get("base")), quality=quality))


def freeze_gates(s: Session, ro: RolloutRow, rs: list[GateReading] | None = None) -> None:
    """Keep the gate table as it stands now, the moment ``ro`` ends (``rs``: readings just taken): a finished
    rollout's record must not change with the fleet's later state (a completed rollout reading \"waiting\" for
    reports from devices that moved on, a halted one's crossed gate reading ok)."""
    if FINAL_GATES in (ro.gate_state or {}):
        return
    if rs is None:
        rel = s.get_one(ReleaseRow, ro.release_id)
        rs = live_readings(s, ro, rel.number, TargetSelector.model_validate(rel.selector))
    ro.gate_state = {**(ro.gate_state or {}), FINAL_GATES: [r.model_dump(mode="json") for r in rs]}


# ---- the operator's controls ----------------------------------------------------------------------
# Rolling back a completed or aborted rollout is meaningful: its members (those that activated the release) are
# told to return to their last-known-good. A halted one's members already are: a rollback would change nothing for
# any device and only overwrite the halt's reason, the record of why it stopped. A scheduled one has no member yet.
_ALLOWED = {
    "pause": {"running"},
    "resume": {"paused"},
    "abort": {"scheduled", "running", "paused"},
    "rollback": {"running", "paused", "aborted", "completed"},
}
_RESULT = {"pause": "paused", "resume": "running", "abort": "aborted", "rollback": "rolled-back"}


def allowed_actions(state: str) -> list[str]:
    """What an operator may do to a rollout in ``state`` (what pages offer, and all ``act`` accepts)."""
    return [a for a in ACTIONS if state in _ALLOWED[a]]


def act(s: Session, rollout_id: int, action: str, reason: str = "") -> RolloutInfo:
    if action not in _ALLOWED:
        raise invalid(f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
    ro = get_rollout(s, rollout_id, lock=True)
    if ro.state not in _ALLOWED[action]:
        hint = (" (a halted rollout stays halted: release a fixed version in a new rollout)"
                if action == "resume" and ro.state == "halted" else
                " (its members are already told to return to their last-known-good)"
                if action == "rollback" and ro.state == "halted" else "")
        raise conflict(f"rollout {rollout_id} is {ro.state}; cannot {action} it{hint}")
    if action == "resume":
        active = s.scalar(select(RolloutRow).where(RolloutRow.model_id == ro.model_id, RolloutRow.id != ro.id,
                                                   RolloutRow.state.in_(ACTIVE_STATES)))
        if active is not None:
            raise conflict(f"rollout {active.id} of the same model is {active.state}")
    now = time.time()
    if ro.state in ACTIVE_STATES and _RESULT[action] not in ACTIVE_STATES:
        freeze_gates(s, ro)
    ro.state = _RESULT[action]
    ro.reason = reason or f"{action} by an operator"
    ro.updated_at = now
    if ro.state in ("aborted", "rolled-back"):
        ro.finished_at = now
    if action == "resume":
        ro.finished_at = None
    # A paused rollout's soak clock stands still: resuming moves the moment the step became ready
    # forward by the pause (a paused rollout is not evaluated, so it cannot have become ready meanwhile).
    ramp = Ramp.load(ro.admission)
    if ramp is not None:  # a paused or stopped rollout lets nobody else in; resuming goes on from there
        ro.admission = (ramp.resumed(now) if action == "resume" else ramp.held(now)).dump()
    paused_at = (ro.gate_state or {}).get("paused_at")
    if action == "pause":
        ro.gate_state = {**(ro.gate_state or {}), "paused_at": now}
    elif paused_at is not None:
        if action == "resume" and ro.step_ready_at is not None:
            ro.step_ready_at += max(0.0, now - float(paused_at))
        ro.gate_state = {k: v for k, v in (ro.gate_state or {}).items() if k != "paused_at"}
    bump_revision(s)
    return rollout_info(s, ro)
