"""Step "download": fetch the release's files into staging, each verified against the signed manifest."""

from __future__ import annotations

from pathlib import Path

from edged.protocol.fleet.release import ReleaseManifest
from edged.sync.capped_http import StoppedError, SyncHttpError, TransferError
from edged.sync.download import fetch_release
from edged.sync.faults import fault_point
from edged.sync.repo import folder_matches
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the files are here and whole (the update moved on to "prepare")."""
    c = ctx.client
    if folder_matches(ctx.repo.version_dir(model, m.version), m.files):
        # e.g. going back to the last-known-good by a new release: the files are already here
        c.outbox.report(
            model,
            "verifying",
            version=m.version,
            release=m.release,
            detail={"downloaded_bytes": 0, "note": "already in the repository"},
        )
        machine.move(ctx.store, ctx.state, model, "prepare")
        return True
    if (model, m.release) not in ctx.download_reported:  # once, not at every resumed attempt
        ctx.download_reported.add((model, m.release))
        c.outbox.report(
            model,
            "downloading",
            version=m.version,
            release=m.release,
            detail={"bytes": m.total_size, "files": len(m.files)},
        )
    try:
        stats = fetch_release(
            ctx.http,
            c.auth.credential(),
            m,
            staged,
            chunk=ctx.settings.download_chunk_kb * 1024,
            should_stop=ctx.stop.is_set,
        )
    except StoppedError:
        return False
    except TransferError as e:
        undo.refuse(ctx, model, m.release, m.version, f"download refused: {e}")
        return False
    except SyncHttpError as e:
        if e.status in (403, 404):
            undo.refuse(ctx, model, m.release, m.version, f"download refused by the registry: {e}")
            return False
        raise
    c.outbox.report(
        model,
        "verifying",
        version=m.version,
        release=m.release,
        detail={"downloaded_bytes": stats.bytes, "resumed_files": stats.resumed_files},
    )
    ctx.repo.seal(staged)
    fault_point("verify.done")
    machine.move(ctx.store, ctx.state, model, "prepare")
    return True
