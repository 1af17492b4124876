"""Step "install": move the prepared copy into the model repository (one rename, made durable)."""

from __future__ import annotations

from pathlib import Path

from edged.protocol.fleet.release import ReleaseManifest
from edged.sync.faults import fault_point
from edged.sync.repo import folder_matches
from edged.sync.state import ModelSync
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext


def already_there(ctx: UpdateContext, model: str, m: ReleaseManifest) -> bool:
    """Whether the repository's folder for the release's version holds exactly its files (hashed once per
    check: models are large, and both the clash check and the install need the answer)."""
    folder = ctx.repo.version_dir(model, m.version)
    return folder.exists() and folder_matches(folder, m.files)


def replaces_kept(
    ctx: UpdateContext, model: str, ms: ModelSync, m: ReleaseManifest, same: bool | None = None
) -> str | None:
    """Why the release may not be installed: its version number is that of the current or last-known-good
    version, whose folder here holds other files (None: it may). Installing would replace that folder in
    place, and a rollback would then "return" to the new files, the old ones gone. ``same``: what
    :func:`already_there` said, when the caller asked it already."""
    kept_here = [(kept, what) for kept, what in ((ms.current, "served"), (ms.lkg, "kept as the last-known-good"))
                 if kept is not None and kept.version == m.version]
    if not kept_here or not ctx.repo.version_dir(model, m.version).exists():
        return None
    if same if same is not None else already_there(ctx, model, m):
        return None
    kept, what = kept_here[0]
    source = "a local copy" if kept.release == 0 else f"release {kept.release}"
    return (f"version {m.version} is {what} from {source} whose files differ from release {m.release}'s; "
            "publish a new version number")


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the version is in the repository (the update moved on to "activate")."""
    same = already_there(ctx, model, m)
    clash = replaces_kept(ctx, model, ctx.ms(model), m, same)
    if clash is not None:  # checked when the update began; again here, the last step before the rename
        undo.abandon(ctx, model)
        undo.refuse(ctx, model, m.release, m.version, clash, permanent=True)
        return False
    try:
        ctx.repo.install(model, m.version, staged, m.files, same=same)
    except FileNotFoundError:
        machine.move(ctx.store, ctx.state, model, "download")  # the staged copy is gone, the repository has none
        return False

    def installed(ms: ModelSync) -> None:
        if m.version not in ms.installed:
            ms.installed.append(m.version)

    machine.move(ctx.store, ctx.state, model, "activate", installed)
    fault_point("install.renamed")
    return True
