"""Going back: serve a known version again, drop an update, refuse a release, delete what is no longer kept."""

from __future__ import annotations

import logging
import time
from typing import Any

from edged.protocol.fleet.messages import QualityReport
from edged.sync import plan
from edged.sync.faults import fault_point
from edged.sync.state import ModelSync
from edged.sync.update import machine, report
from edged.sync.update.context import UpdateContext

log = logging.getLogger(__name__)
KEEP_REFUSALS = 20


def trim(d: dict[int, Any]) -> None:
    """Keep the newest :data:`KEEP_REFUSALS` releases' entries."""
    for k in sorted(d)[:-KEEP_REFUSALS]:
        del d[k]


def ensure_serving(ctx: UpdateContext, model: str, version: int | None) -> None:
    """Serve exactly ``version`` of ``model`` (None: nothing), loading it from the repository if need be."""
    eng = ctx.engine
    eng.pin(model, version)
    if version is None:
        if eng.version_count(model):
            eng.unload(model)
        return
    if eng.ready_versions(model) == [version] and eng.version_count(model) == 1:
        return
    if not ctx.repo.version_dir(model, version).is_dir():
        log.error("model=%s version %d should serve but is not in the repository", model, version)
        return
    loaded = eng.load(model, version)
    if not loaded.ready:
        log.error("model=%s version %d failed to load: %s", model, version, loaded.reason)


def rollback(ctx: UpdateContext, model: str, reason: str, *, quality: QualityReport | None = None) -> None:
    """Serve the committed version again, drop the new one, never retry this release."""
    ms = ctx.ms(model)
    p = ms.pending
    assert p is not None

    def because(_: ModelSync) -> None:
        p.reason = reason

    machine.move(ctx.store, ctx.state, model, "rollback", because)
    ctx.trials.pop(model, None)
    fault_point("rollback.before")
    ensure_serving(ctx, model, ms.current.version if ms.current else None)
    fault_point("rollback.loaded")
    keep = {r.version for r in (ms.current, ms.lkg) if r is not None}
    if p.version not in keep:
        ctx.repo.remove(model, p.version)
    ctx.repo.drop_staging(ctx.repo.staging_dir(model, p.version, p.release))

    def rejected(ms: ModelSync) -> None:
        if p.version in ms.installed and p.version not in keep:
            ms.installed.remove(p.version)
        ms.rejected[p.release] = reason
        trim(ms.rejected)

    machine.finish(ctx.store, ctx.state, model, rejected)
    ctx.baselines.pop(model, None)
    report.failure(
        ctx.client,
        model,
        "rolled-back",
        version=p.version,
        release=p.release,
        reason=reason,
        detail={"serving": ms.current.version if ms.current else None},
        quality=quality,
    )


def abandon(ctx: UpdateContext, model: str) -> None:
    """Drop an update that has not been activated (superseded, expired, refused)."""
    ms = ctx.ms(model)
    p = ms.pending
    if p is None:
        return
    ctx.repo.drop_staging(ctx.repo.staging_dir(model, p.version, p.release))
    keep = {r.version for r in (ms.current, ms.lkg) if r is not None}
    if p.step in ("install", "activate") and p.version not in keep:
        ctx.repo.remove(model, p.version)

    def dropped(ms: ModelSync) -> None:
        if p.version in ms.installed and p.version not in keep:
            ms.installed.remove(p.version)

    machine.finish(ctx.store, ctx.state, model, dropped)
    ctx.trials.pop(model, None)


def refuse(
    ctx: UpdateContext, model: str, release: int, version: int | None, reason: str, *, permanent: bool = False
) -> None:
    """Refuse a release: for good (``permanent``), or until a retry later, each time twice as late.

    A model with no saved entry gets none (the refusal is kept in memory): a release that fails its
    checks must not grow the state. The refusal and its report are saved with the poll's other changes:
    a crash that loses them only has the next poll refuse the release again.
    """
    ms = ctx.entry(model)
    ctx.download_reported.discard((model, release))  # a later attempt is a new download
    s = ctx.settings
    with ctx.store.lock:
        if permanent:
            ms.rejected[release] = reason
            trim(ms.rejected)
        else:
            ms.refused[release] = plan.next_refusal(
                ms.refused.get(release),
                reason,
                time.time(),
                poll_interval_s=s.poll_interval_s,
                retry_max_s=s.retry_max_s,
            )
            trim(ms.refused)
        ctx.store.save_later()
    report.failure(ctx.client, model, "failed", version=version, release=release, reason=reason, later=True)


def collect_garbage(ctx: UpdateContext, model: str) -> None:
    """Delete versions this agent installed that are neither current, last-known-good nor pending."""
    ms = ctx.ms(model)
    keep = ms.keep()
    for v in [v for v in ms.installed if v not in keep]:
        ctx.repo.remove(model, v)
        with ctx.store.lock:
            ms.installed.remove(v)
            ctx.store.save(ctx.state)


def to_last_known_good(ctx: UpdateContext, model: str, why: str) -> None:
    """A committed release must go: serve the last-known-good again (state and report saved together)."""
    ms = ctx.ms(model)
    cur, lkg = ms.current, ms.lkg
    assert cur is not None and lkg is not None
    with ctx.store.lock:
        ms.rejected[cur.release] = why
        trim(ms.rejected)
        ms.current, ms.lkg = lkg, None
        report.failure(
            ctx.client,
            model,
            "rolled-back",
            version=cur.version,
            release=cur.release,
            reason=why,
            detail={"serving": lkg.version, "from": "committed"},
        )  # saves the state too
    ensure_serving(ctx, model, lkg.version)
    collect_garbage(ctx, model)
