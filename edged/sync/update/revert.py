"""The registry halted or rolled back a rollout: stop running, or never install, its releases here."""

from __future__ import annotations

from edged.sync import plan
from edged.sync.update import report, undo
from edged.sync.update.context import UpdateContext


def run(ctx: UpdateContext, model: str, releases: list[int], reason: str) -> None:
    ms = ctx.known(model)
    if ms is None:
        return  # never had the model: nothing of it runs here, and the state keeps no entry per name sent
    action, release = plan.revert_action(ms, releases)
    why = f"{plan.REVERT_PREFIX}: {reason or 'rollout stopped'}"
    if action == "none" or release is None:
        return
    if action == "forget":
        with ctx.store.lock:
            before = dict(ms.rejected)
            for r in releases:
                ms.rejected.setdefault(r, why)
            undo.trim(ms.rejected)
            # Unchanged when more than KEEP_REFUSALS numbers come back at every poll: nothing to write then.
            # Written with the poll's other changes: the registry repeats a revert at every poll.
            if ms.rejected != before:
                ctx.store.save_later()
        return
    if action == "abandon":
        p = ms.pending
        assert p is not None
        undo.abandon(ctx, model)
        with ctx.store.lock:
            ms.rejected[release] = why
            undo.trim(ms.rejected)
            report.failure(
                ctx.client,
                model,
                "rolled-back",
                version=p.version,
                release=release,
                reason=why,
                detail={"serving": ms.current.version if ms.current else None, "step": p.step},
            )
        return
    if action == "rollback":
        undo.rollback(ctx, model, why)
        return
    lkg = ms.lkg
    if action == "to-lkg" and lkg is not None and ctx.repo.version_dir(model, lkg.version).is_dir():
        undo.to_last_known_good(ctx, model, why)
        return
    if (model, release) not in ctx.unrevertable:  # said once
        ctx.unrevertable.add((model, release))
        report.failure(
            ctx.client,
            model,
            "failed",
            version=ms.current.version if ms.current else None,
            release=release,
            reason=f"{why}; but no last-known-good version is kept here, so it keeps serving",
        )
