"""Which devices each step of a proposed rollout would take, before the operator confirms it.

The preview runs the very code that starts a rollout (``rollouts.create_rollout`` and ``enter_step``
for each later step) in a transaction that is always rolled back: no release, rollout or revision
is left behind, and the members shown are the ones the rollout would take if nothing changes before
the confirmation (a device enrolling later may still fall into a percent step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from edged.protocol.fleet.release import TargetSelector
from edged.registry import rollouts
from edged.registry.db import ReleaseRow
from edged.registry.rollout_wire import RolloutCreate

SHOWN = 30  # ids listed per step; the count is always whole


@dataclass
class StepPreview:
    select: str
    count: int  # devices this step adds
    devices: list[str] = field(default_factory=list)  # the first SHOWN of them, in id order


def preview(sessions: sessionmaker[Session], req: RolloutCreate, public_keys: list[str]) -> list[StepPreview]:
    """Per step, the devices it would add; raises what starting the rollout would raise (a conflict, a bad release)."""
    with sessions() as s:
        s.begin()
        try:
            info = rollouts.create_rollout(s, req.model_copy(update={"start_at": None}), public_keys)  # as if now
            ro = rollouts.get_rollout(s, info.id)
            rel = s.get_one(ReleaseRow, ro.release_id)
            selector = TargetSelector.model_validate(rel.selector)
            devices = rollouts.targeted(s, ro, selector)
            now, seen, out = time.time(), set[str](), []
            for k, spec in enumerate(req.steps):
                if k:
                    rollouts.enter_step(s, ro, k, now, selector, committed=0, devices=devices)
                members = rollouts.membership(ro, k, admitted=False)
                fresh = [d.id for d in devices if d.id not in seen and members.member(d.id, d.labels, d.facts)]
                seen.update(fresh)
                out.append(StepPreview(spec.describe(), len(fresh), fresh[:SHOWN]))
            return out
        finally:
            s.rollback()
