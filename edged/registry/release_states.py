"""What became of each release, in one phrase every listing shows (API, CLI, dashboard).

A release row only knows whether it was revoked; what an operator asks is whether it is still
the one to use: ``valid``, ``superseded`` (a later release that was not stopped exists),
``halted`` / ``aborted`` / ``rolled back`` (its last rollout ended that way), ``expired``,
``revoked``; a fleet rollback's release adds ``restores rN``.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from edged.protocol.fleet.messages import EventInfo
from edged.registry.db import ModelRow, ReleaseRow, RolloutRow

# A release whose last rollout ended in one of these is not in use, whatever later releases exist.
# Releases no device runs by their rollout: stopped, or not started yet (scheduled: it supersedes nothing yet).
STOPPED = {"halted": "halted", "aborted": "aborted", "rolled-back": "rolled back", "scheduled": "scheduled"}


def release_states(s: Session, model_id: int, now: float | None = None) -> dict[int, str]:
    """Release number -> its state phrase, for every release of the model."""
    t = time.time() if now is None else now
    last_rollout: dict[int, str] = {}
    for release_id, state in s.execute(select(RolloutRow.release_id, RolloutRow.state)
                                       .where(RolloutRow.model_id == model_id).order_by(RolloutRow.id)):
        last_rollout[release_id] = state
    rows = s.execute(select(ReleaseRow.id, ReleaseRow.number, ReleaseRow.revoked_at, ReleaseRow.expires_at,
                            ReleaseRow.restores).where(ReleaseRow.model_id == model_id)).all()
    bases: dict[int, str] = {}
    for rid, number, revoked_at, expires_at, _ in rows:
        if revoked_at is not None:
            bases[number] = "revoked"
        elif expires_at is not None and expires_at < t:
            bases[number] = "expired"
        else:
            bases[number] = STOPPED.get(last_rollout.get(rid, ""), "valid")
    newest = max((n for n, b in bases.items() if b == "valid"), default=None)
    out = {}
    for _, number, _, _, restores in rows:
        phrase = bases[number]
        if phrase == "valid" and newest is not None and number < newest:
            phrase = "superseded"
        out[number] = phrase + (f", restores r{restores}" if restores is not None else "")
    return out


def with_rollback_reasons(s: Session, events: list[EventInfo]) -> list[EventInfo]:
    """A device's update history: events about a fleet rollback's release carry the operator's reason (the
    release's notes, "rollback to release N: why") where the device gave none — the device only knows it
    was offered an earlier version again, not why."""
    wanted = {(e.model, e.release) for e in events if not e.reason and e.release is not None}
    if not wanted:
        return events
    notes: dict[tuple[str, int], str] = {}
    for model, number, text in s.execute(
            select(ModelRow.name, ReleaseRow.number, ReleaseRow.notes)
            .join(ModelRow, ModelRow.id == ReleaseRow.model_id)
            .where(ModelRow.name.in_({m for m, _ in wanted}), ReleaseRow.restores.is_not(None))):
        notes[(model, number)] = text or f"rollback of model {model}"
    for e in events:
        if not e.reason and e.release is not None and (e.model, e.release) in notes:
            e.reason = notes[(e.model, e.release)]
    return events
