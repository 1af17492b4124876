"""Fleet rollback: bring an earlier release's version back to every device as a new, higher release.

Devices refuse release numbers below the highest they accepted (the rollback-attack guard),
and a device-local "return to your last-known-good" depends on what each device happened to
keep, so two of those in a row split a fleet. A rollback here is therefore a new release,
signed by the operator like any other, that carries the earlier release's version (and its
signed selector): every device that release selects converges on it, downloading it again
where it was pruned, and a second rollback is simply a newer release still. Running or
paused rollouts of the model are rolled back with it, so devices trying that release stop (a
scheduled one is aborted: it never starts).

"previous" follows what the fleet ran: the current release is the newest one not halted
or rolled back; the release before a rollback release is the one before the release it
restored, so repeated "previous" rollbacks keep walking back instead of bouncing.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from edged.protocol.fleet.release import ReleaseError, TargetSelector
from edged.registry.db import ReleaseRow, RolloutRow, VersionRow
from edged.registry.rollout_wire import ACTIVE_STATES, REVERT_STATES, RollbackPlan, RollbackRequest, RollbackResult
from edged.registry.rollouts import freeze_gates
from edged.registry.service import bump_revision, conflict, create_release, get_model, invalid, not_found
from edged.registry.targets import Ramp

PREVIOUS = "previous"
MAX_CHAIN = 1000  # restores chains are acyclic (they point to lower numbers); this only bounds the walk


def _history(s: Session, model_id: int) -> tuple[list[ReleaseRow], dict[int, str]]:
    """Releases newest first, and the state of each release's latest rollout (absent: none)."""
    rows = list(s.scalars(select(ReleaseRow).where(ReleaseRow.model_id == model_id)
                          .order_by(ReleaseRow.number.desc())))
    states: dict[int, str] = {}
    for release_id, state in s.execute(select(RolloutRow.release_id, RolloutRow.state)
                                       .where(RolloutRow.model_id == model_id).order_by(RolloutRow.id)):
        states[release_id] = state
    return rows, states


def _version(s: Session, r: ReleaseRow) -> int:
    return s.get_one(VersionRow, r.version_id).version


def current_release(rows: list[ReleaseRow], states: dict[int, str]) -> ReleaseRow | None:
    """The newest unrevoked release whose rollout (if any) was not halted or rolled back, nor is still scheduled."""
    return next((r for r in rows if r.revoked_at is None and states.get(r.id) not in REVERT_STATES
                 and states.get(r.id) != "scheduled"), None)


def previous_release(s: Session, rows: list[ReleaseRow], states: dict[int, str], cur: ReleaseRow) -> ReleaseRow | None:
    """The release the fleet ran before ``cur``: below it (below what it restored, for a rollback release),
    unrevoked, fully rolled out (no rollout or a completed one), with a different version."""
    by_number = {r.number: r for r in rows}
    anchor = cur
    for _ in range(MAX_CHAIN):
        if anchor.restores is None or anchor.restores not in by_number:
            break
        anchor = by_number[anchor.restores]
    cur_version = _version(s, cur)
    for r in rows:
        if r.number >= anchor.number or r.revoked_at is not None:
            continue
        if states.get(r.id, "completed") != "completed":
            continue
        if _version(s, r) != cur_version:
            return r
    return None


def plan(s: Session, model: str, to: str) -> RollbackPlan:
    m = get_model(s, model)
    rows, states = _history(s, m.id)
    cur = current_release(rows, states)
    if to == PREVIOUS:
        if cur is None:
            raise conflict(f"model {model!r} has no current release to roll back from")
        target = previous_release(s, rows, states, cur)
        if target is None:
            raise conflict(f"model {model!r}: no fully rolled-out release with another version before release "
                           f"{cur.number}; name one with --to N")
    else:
        try:
            number = int(to)
        except ValueError:
            raise invalid(f"--to: a release number or {PREVIOUS!r}, not {to!r}") from None
        target = next((r for r in rows if r.number == number), None)
        if target is None:
            raise not_found(f"release {number} of model {model!r}")
        if target.revoked_at is not None:
            raise conflict(f"release {number} of model {model!r} is revoked; it cannot come back")
    version = _version(s, target)
    if cur is not None and cur.number == target.number:
        raise conflict(f"release {target.number} is already the current release of model {model!r}")
    return RollbackPlan(model=model, current_release=cur.number if cur else None,
                        current_version=_version(s, cur) if cur else None, to_release=target.number,
                        version=version, selector=TargetSelector.model_validate(target.selector),
                        next_release=(rows[0].number + 1) if rows else 1)


def rollback(s: Session, model: str, req: RollbackRequest, public_keys: list[str]) -> RollbackResult:
    """Store the operator's signed rollback release and stop the model's active rollouts, in one transaction."""
    m = get_model(s, model)
    target = s.scalar(select(ReleaseRow).where(ReleaseRow.model_id == m.id, ReleaseRow.number == req.to_release))
    if target is None:
        raise not_found(f"release {req.to_release} of model {model!r}")
    if target.revoked_at is not None:
        raise conflict(f"release {req.to_release} of model {model!r} is revoked; it cannot come back")
    try:
        manifest = req.signed.unverified()  # create_release checks the signature; this only routes the request
    except ReleaseError as e:
        raise invalid(str(e)) from None
    version = _version(s, target)
    if manifest.model != model or manifest.version != version:
        raise invalid(f"the signed release carries {manifest.model!r} version {manifest.version}; rolling back to "
                      f"release {req.to_release} needs {model!r} version {version}")
    now = time.time()
    why = f"rolled back to release {req.to_release} (version {version})" + (f": {req.reason}" if req.reason else "")
    stopped = []
    for ro in s.scalars(select(RolloutRow).where(RolloutRow.model_id == m.id, RolloutRow.state.in_(ACTIVE_STATES))
                        .with_for_update()):
        freeze_gates(s, ro)
        # a scheduled one never started: it has no member to send back, it just never starts
        ro.state = "aborted" if ro.state == "scheduled" else "rolled-back"
        ro.reason, ro.updated_at, ro.finished_at = why, now, now
        if (ramp := Ramp.load(ro.admission)) is not None:  # as a pause, an abort or a halt: nobody else joins it
            ro.admission = ramp.held(now).dump()
        stopped.append(ro.id)
    info = create_release(s, req.signed, public_keys)  # bumps the registry revision
    row = s.scalar(select(ReleaseRow).where(ReleaseRow.model_id == m.id, ReleaseRow.number == info.release))
    assert row is not None
    row.restores = req.to_release
    bump_revision(s)
    return RollbackResult(model=model, release=info.release, version=version, restores=req.to_release,
                          stopped_rollouts=stopped)
