"""The audit log: who did what to the registry, when, from where, and why.

Every operator action that changes state adds one row with :func:`record`, in the transaction
of the action itself, so an action is never without its row nor a row without its action. The
log only grows: there is no API to change or remove a row, and the database refuses UPDATE and
DELETE on the table (triggers from the ``0008_tokens_audit`` migration).
"""

from __future__ import annotations

import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from edged.protocol.fleet.messages import MAX_INT32
from edged.registry.access import Principal
from edged.registry.access_tables import AuditRow
from edged.registry.access_wire import AuditEntry, AuditPage

MAX_PAGE = 1000


def record(s: Session, who: Principal, action: str, target: str, reason: str = "") -> None:
    """Add the row of an action to the transaction ``s`` that does it."""
    s.add(
        AuditRow(
            at=time.time(),
            actor=who.name[:64],
            role=who.role.label,
            source=who.source,
            action=action[:64],
            target=target[:256],
            reason=reason[:4000],
        )
    )


def recent(s: Session, limit: int = 100, offset: int = 0) -> AuditPage:
    """A page of the log, newest first (``offset`` rows skipped)."""
    # an offset past anything the database can count (the dashboard's ?from=) is simply past the end
    limit, offset = max(1, min(limit, MAX_PAGE)), max(0, min(offset, MAX_INT32))
    rows = s.scalars(select(AuditRow).order_by(AuditRow.id.desc()).limit(limit).offset(offset)).all()
    total = s.scalar(select(func.count()).select_from(AuditRow)) or 0
    return AuditPage(
        entries=[
            AuditEntry(
                id=r.id,
                at=r.at,
                actor=r.actor,
                role=r.role,
                source=r.source,
                action=r.action,
                target=r.target,
                reason=r.reason,
            )
            for r in rows
        ],
        total=total,
    )
