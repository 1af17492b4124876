"""Step "install": move the prepared copy into the model repository (one rename, made durable)."""

from __future__ import annotations

from pathlib import Path

from edged.protocol.fleet.release import ReleaseManifest
from edged.sync.faults import fault_point
from edged.sync.state import ModelSync
from edged.sync.update import machine
from edged.sync.update.context import UpdateContext


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the version is in the repository (the update moved on to "activate")."""
    try:
        ctx.repo.install(model, m.version, staged, m.files)
    except FileNotFoundError:
        machine.move(ctx.store, ctx.state, model, "download")  # the staged copy is gone, the repository has none
        return False

    def installed(ms: ModelSync) -> None:
        if m.version not in ms.installed:
            ms.installed.append(m.version)

    machine.move(ctx.store, ctx.state, model, "activate", installed)
    fault_point("install.renamed")
    return True
