"""Step "trial": the new version serves while its statistics are judged against the version it replaced.

A trial is a state with deadlines, not a loop: the sync loop visits each model on trial about
every :data:`TRIAL_TICK_S` (:func:`visit`), and other models' updates run in between. It ends
in a commit or a rollback; a restart begins it again (:func:`begin`).
"""

from __future__ import annotations

import logging
import time

from edged.errors import EdgedError
from edged.protocol.fleet.messages import QualityReport
from edged.sync.faults import fault_point
from edged.sync.settings import SyncSettings
from edged.sync.trial import SETTLE_FRACTION, SETTLE_MAX_S, judge
from edged.sync.update import commit, undo
from edged.sync.update.activate import evaluation
from edged.sync.update.context import TrialClock, UpdateContext

log = logging.getLogger(__name__)
TRIAL_TICK_S = 0.25


def _clock(s: SyncSettings, now: float) -> TrialClock:
    end = now + s.trial_s
    return TrialClock(
        start=now,
        end=end,
        cap=end + s.trial_extend_s,
        settle_at=now + min(SETTLE_MAX_S, s.trial_s * SETTLE_FRACTION),
        due=now,
    )


def begin(ctx: UpdateContext, model: str) -> TrialClock:
    """Start (or, after a restart, start over) the trial of the version pending for ``model``."""
    fault_point("trial.start")
    p = ctx.ms(model).pending
    assert p is not None and p.step == "trial"
    _rescore(ctx, model, p.version)
    clock = ctx.trials[model] = _clock(ctx.settings, time.monotonic())
    return clock


def _rescore(ctx: UpdateContext, model: str, version: int) -> None:
    """A trial resumed after a restart: score the evaluation set again (the replaced version is gone)."""
    ev = evaluation(ctx, model, version)
    if ev is None or model in ctx.quality:
        return
    try:
        got = ctx.engine.score(model, version, ctx.repo.version_dir(model, version), ev)
    except EdgedError as e:
        log.warning("model=%s version %d: evaluation set not scored on resuming the trial: %s", model, version, e)
        return
    ctx.quality[model] = QualityReport(metric=ev.metric, samples=got.samples, score=got.score)


def due(ctx: UpdateContext) -> float | None:
    """When (monotonic) the next trial wants a visit; None when no model is on trial."""
    return min((c.due for c in ctx.trials.values()), default=None)


def visit(ctx: UpdateContext, model: str) -> bool:
    """One look at a trial when it is due: judge it, and commit or roll back at its end. True when it ended."""
    p = ctx.ms(model).pending
    if p is None or p.step != "trial":
        ctx.trials.pop(model, None)
        return False
    if ctx.stop.is_set():
        return False  # the next start begins the trial again
    clock = ctx.trials.get(model) or begin(ctx, model)
    if time.monotonic() < clock.due:
        return False
    ended = _look(ctx, model, p.version, clock)
    if not ended:
        fault_point("trial.tick")
    return ended


def _look(ctx: UpdateContext, model: str, version: int, clock: TrialClock) -> bool:
    s, eng = ctx.settings, ctx.engine
    # The operator's mark is read on both sides of the sample: an unload sets it before the versions go
    # and a reload clears it after they are back, so a model found gone with the mark unset both times
    # really vanished on its own.
    marked = eng.operator_unloaded(model)
    new = eng.sample(model, version)
    now = time.monotonic()
    if new is None:
        return _gone(ctx, model, version, clock, marked=marked)
    if clock.paused:
        log.info("model=%s loaded again: the trial of version %d starts over", model, version)
        clock = ctx.trials[model] = _clock(s, now)
    if clock.settled is None and now >= clock.settle_at:
        clock.settled = new
    if now >= clock.end and clock.end < clock.cap and new.total < s.trial_min_requests and model not in ctx.quality:
        clock.end = min(clock.cap, now + TRIAL_TICK_S)  # too little traffic to judge, no evaluation set: wait on
    left = clock.end - now
    latency = new.since(clock.settled) if clock.settled else None
    reason = judge(new, ctx.baselines.get(model), s, final=left <= 0, latency=latency)
    if reason is not None:
        undo.rollback(ctx, model, f"trial failed: {reason}")
        return True
    if left <= 0:
        ctx.trials.pop(model, None)
        commit.run(ctx, model, new)
        return True
    clock.due = now + min(TRIAL_TICK_S, left)
    return False


def _gone(ctx: UpdateContext, model: str, version: int, clock: TrialClock, *, marked: bool) -> bool:
    """The version is not served: a failed trial, unless an operator unloaded the model (then it waits)."""
    if not marked and not ctx.engine.operator_unloaded(model):
        undo.rollback(ctx, model, f"trial failed: version {version} is no longer loaded")
        return True
    if not clock.paused:  # an operator's choice is not the release's failure: nothing is reported
        log.warning(
            "model=%s trial of version %d paused: an operator unloaded the model; the trial starts over "
            "once it is loaded again",
            model,
            version,
        )
        clock.paused = True
    clock.due = time.monotonic() + TRIAL_TICK_S
    return False
