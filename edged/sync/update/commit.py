"""The end of a passed trial: the new version becomes the committed one, the old one last-known-good."""

from __future__ import annotations

import logging
from typing import Any

from edged.sync.faults import fault_point
from edged.sync.state import ModelSync, VersionRef
from edged.sync.trial import Sample
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext

log = logging.getLogger(__name__)


def run(ctx: UpdateContext, model: str, trial: Sample | None) -> None:
    fault_point("commit.before")
    p = ctx.ms(model).pending
    assert p is not None
    now = VersionRef(version=p.version, release=p.release)

    def committed(ms: ModelSync) -> None:
        ms.lkg = ms.current
        ms.current = now

    machine.finish(ctx.store, ctx.state, model, committed)
    fault_point("commit.saved")
    undo.collect_garbage(ctx, model)
    detail: dict[str, Any] = {}
    if trial is not None:
        # no request, no latency: a p99 of 0.0 ms would read as a measurement
        detail = {
            "requests": trial.total,
            "errors": trial.errors,
            "p99_ms": trial.p99_s * 1000 if trial.total else None,
        }
    detail.update(_judged_on(ctx, model, p.release, trial))
    ctx.baselines.pop(model, None)
    ctx.client.outbox.report(model, "committed", version=p.version, release=p.release, detail=detail)


def _judged_on(ctx: UpdateContext, model: str, release: int, trial: Sample | None) -> dict[str, Any]:
    """What the commit rests on, said in the report: live traffic, the evaluation set alone, or nothing."""
    s = ctx.settings
    n = s.trial_min_requests
    seen = trial.total if trial is not None else 0
    q = ctx.quality.pop(model, None)
    if seen >= n:
        return {"judged": "traffic"}
    if q is not None:
        return {
            "judged": "evaluation-set",
            "note": f"{seen} of {n} requests in trial: committed on the evaluation set alone "
            f"(score {q.score:.4f} over {q.samples} samples)",
        }
    note = (
        f"{seen} of {n} requests in trial (waited up to {s.trial_extend_s:g}s more) and no evaluation "
        "set: committed unjudged"
    )
    log.warning("model=%s release %d: %s", model, release, note)
    return {"judged": "unjudged", "note": note}
