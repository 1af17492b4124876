"""Step "activate": score both versions on the evaluation set, switch serving to the new one, start its trial."""

from __future__ import annotations

import logging
from pathlib import Path

from edged.errors import EdgedError
from edged.protocol.fleet.messages import QualityReport
from edged.protocol.fleet.release import ReleaseManifest
from edged.protocol.names import MANIFEST_NAME
from edged.repository.manifest import Evaluation, parse_manifest
from edged.sync.capped_http import SyncHttpError
from edged.sync.faults import fault_point
from edged.sync.trial import baseline
from edged.sync.update import machine, undo
from edged.sync.update.context import UpdateContext
from edged.sync.update.serving import serving

log = logging.getLogger(__name__)


def evaluation(ctx: UpdateContext, model: str, version: int) -> Evaluation | None:
    """The version's evaluation set, when its manifest names one."""
    try:
        return parse_manifest(
            ctx.repo.version_dir(model, version) / MANIFEST_NAME, model=model, version=version
        ).evaluation
    except EdgedError:
        return None  # it loaded moments ago; a manifest gone bad now fails the activation itself


def _score_previous(ctx: UpdateContext, model: str, cur_version: int, folder: Path, ev: Evaluation) -> float | None:
    """The replaced version on the new release's evaluation set, scored while it still serves."""
    try:
        return ctx.engine.score(model, cur_version, folder, ev).score
    except EdgedError as e:  # e.g. its inputs changed shape: the registry compares with other figures
        log.warning("model=%s version %d could not be scored on the new evaluation set: %s", model, cur_version, e)
        return None


def run(ctx: UpdateContext, model: str, m: ReleaseManifest, staged: Path) -> bool:
    """True when the new version serves and its trial began (the update moved on to "trial")."""
    s, eng = ctx.settings, ctx.engine
    ms = ctx.ms(model)
    cur = ms.current
    at_switch = eng.sample(model, cur.version) if cur is not None else None
    ctx.baselines[model] = baseline(ctx.run_up.pop(model, None), at_switch, s)
    folder = ctx.repo.version_dir(model, m.version)
    ev = evaluation(ctx, model, m.version)
    base_score = None
    if ev is not None and cur is not None and cur.version in eng.ready_versions(model):
        base_score = _score_previous(ctx, model, cur.version, folder, ev)
    ctx.quality.pop(model, None)
    fault_point("activate.before")
    eng.pin(model, m.version)
    loaded = eng.load(model, m.version)
    if not loaded.ready:
        undo.rollback(ctx, model, f"activation failed: {loaded.reason}")
        return False
    fault_point("activate.loaded")
    if ev is not None:
        try:
            got = eng.score(model, m.version, folder, ev)
        except EdgedError as e:
            undo.rollback(ctx, model, f"evaluation set failed: {e}")
            return False
        q = QualityReport(
            metric=ev.metric,
            samples=got.samples,
            score=got.score,
            baseline_version=cur.version if base_score is not None and cur else None,
            baseline_score=base_score,
        )
        log.info(
            "model=%s version %d scores %.4f on its evaluation set (%d samples); version %s: %s",
            model,
            m.version,
            got.score,
            got.samples,
            cur.version if cur else "-",
            f"{base_score:.4f}" if base_score is not None else "not scored",
        )
        if base_score is not None and cur is not None and base_score - got.score > s.trial_max_quality_drop:
            undo.rollback(
                ctx,
                model,
                f"evaluation set: version {m.version} scores {got.score:.4f}, version "
                f"{cur.version} {base_score:.4f} on the same {got.samples} samples (allowed "
                f"drop {s.trial_max_quality_drop:g})",
                quality=q,
            )
            return False
        ctx.quality[model] = q
    machine.move(ctx.store, ctx.state, model, "trial")
    ctx.client.outbox.report(
        model,
        "active-trial",
        version=m.version,
        release=m.release,
        detail={"engine": loaded.label, "trial_s": s.trial_s},
        quality=ctx.quality.get(model),
    )
    _send_facts(ctx)
    return True


def _send_facts(ctx: UpdateContext) -> None:
    """Clients get the new version from the trial's first moment on: the registry hears it now, not when
    the trial ends (the agent sends facts only after a round)."""
    try:
        ctx.client.facts.send(serving(ctx))
    except SyncHttpError as e:  # the registry hears them at the next round; the trial itself goes on
        log.info("model trial: facts not sent now (%s); sent at the next round", e)
