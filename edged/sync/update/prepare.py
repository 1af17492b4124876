"""Step "prepare": load, warm up and golden-check the staged copy for this device's profile, then let it go."""

from __future__ import annotations

from pathlib import Path

from edged.protocol.fleet.release import ReleaseManifest
from edged.repository.digests import DigestCache
from edged.repository.store import load_version
from edged.sync.faults import fault_point
from edged.sync.repo import folder_matches
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the version proved it runs here (the update moved on to "install")."""
    if folder_matches(staged, m.files):
        where = staged
    elif folder_matches(ctx.repo.version_dir(model, m.version), m.files):
        where = ctx.repo.version_dir(model, m.version)
    else:
        machine.move(ctx.store, ctx.state, model, "download")  # staged files damaged (e.g. power loss): fetch again
        return False
    entry = load_version(model, m.version, where, DigestCache(None))
    reason, label = entry.error, None
    if reason is None:
        tried = ctx.engine.rehearse(entry, ctx.stop)
        reason, label = tried.reason, tried.label
    if reason is not None:
        undo.rollback(ctx, model, f"prepare failed: {reason}")
        return False
    fault_point("prepare.done")
    machine.move(ctx.store, ctx.state, model, "install")
    ctx.client.outbox.report(model, "prepared", version=m.version, release=m.release, detail={"engine": label})
    return True
