"""Step "install": move the prepared copy into the model repository (one rename, made durable)."""

from __future__ import annotations

from pathlib import Path

from edged.protocol.fleet.release import ReleaseManifest
from edged.sync.faults import fault_point
from edged.sync.repo import folder_matches
from edged.sync.state import ModelSync
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext


def replaces_kept(ctx: UpdateContext, model: str, ms: ModelSync, m: ReleaseManifest) -> str | None:
    """Why the release may not be installed: its version number is that of the current or last-known-good
    version, whose folder here holds other files (None: it may). Installing would replace that folder in
    place, and a rollback would then "return" to the new files, the old ones gone."""
    folder = ctx.repo.version_dir(model, m.version)
    for kept, what in ((ms.current, "served"), (ms.lkg, "kept as the last-known-good")):
        if kept is None or kept.version != m.version or not folder.exists() or folder_matches(folder, m.files):
            continue
        source = "a local copy" if kept.release == 0 else f"release {kept.release}"
        return (f"version {m.version} is {what} from {source} whose files differ from release {m.release}'s; "
                "publish a new version number")
    return None


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the version is in the repository (the update moved on to "activate")."""
    clash = replaces_kept(ctx, model, ctx.ms(model), m)
    if clash is not None:  # checked when the update began; again here, the last step before the rename
        undo.abandon(ctx, model)
        undo.refuse(ctx, model, m.release, m.version, clash, permanent=True)
        return False
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
