"""Operators' rollouts: start one, list, watch, evaluate now, pause/resume/abort/roll back."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from edged.protocol.fleet.messages import API_PREFIX
from edged.registry import audit, rollback, rollouts
from edged.registry.access import Actor
from edged.registry.deps import AppContext, PathNumber
from edged.registry.evaluator import tick
from edged.registry.rollout_wire import (
    RollbackPlan,
    RollbackRequest,
    RollbackResult,
    RolloutAction,
    RolloutCreate,
    RolloutInfo,
    RolloutStatus,
)

log = logging.getLogger(__name__)


def rollouts_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["admin", "rollouts"])

    @router.post(f"{API_PREFIX}/rollouts", response_model=RolloutInfo, status_code=201)
    def create_rollout(req: RolloutCreate, who: Actor) -> RolloutInfo:
        with ctx.tx() as s:
            info = rollouts.create_rollout(s, req, ctx.settings.public_keys,
                                           admit_per_minute=ctx.settings.rollout_admit_per_minute)
            audit.record(s, who, "rollout.create", f"rollout {info.id}",
                         f"model {info.model} release {info.release}, {len(info.steps)} step(s)")
        log.info("rollout %d of model %s release %d (version %d) started: %d step(s), %d device(s) in the first",
                 info.id, info.model, info.release, info.version, len(info.steps), info.members)
        ctx.nudge({"model": info.model, "release": info.release, "rollout": info.id})
        return info

    @router.get(f"{API_PREFIX}/rollouts", response_model=list[RolloutInfo])
    def list_rollouts(model: str | None = None, state: str | None = None) -> list[RolloutInfo]:
        with ctx.rtx() as s:
            return rollouts.list_rollouts(s, model, state)

    @router.get(f"{API_PREFIX}/rollouts/{{rollout_id}}", response_model=RolloutStatus)
    def rollout_status(rollout_id: PathNumber, members: bool = False) -> RolloutStatus:
        with ctx.rtx() as s:
            return rollouts.rollout_status(s, rollout_id, with_members=members)

    @router.get(f"{API_PREFIX}/models/{{model}}/rollback", response_model=RollbackPlan)
    def rollback_plan(model: str, to: str = rollback.PREVIOUS) -> RollbackPlan:
        """Which release ``to`` names (a number, or ``previous``) and the number the signed release must carry."""
        with ctx.rtx() as s:
            return rollback.plan(s, model, to)

    @router.post(f"{API_PREFIX}/models/{{model}}/rollback", response_model=RollbackResult, status_code=201)
    def rollback_to(model: str, req: RollbackRequest, who: Actor) -> RollbackResult:
        """Store the operator-signed release that brings an earlier version back to the fleet."""
        with ctx.tx() as s:
            out = rollback.rollback(s, model, req, ctx.settings.public_keys)
            audit.record(s, who, "model.rollback", f"model {model} release {out.release}",
                         f"restores release {out.restores}" + (f": {req.reason}" if req.reason else ""))
        log.info("model %s rolled back to release %d (version %d) as release %d; rollouts stopped: %s", model,
                 out.restores, out.version, out.release, out.stopped_rollouts or "none")
        ctx.nudge({"model": model, "release": out.release, "rollback": out.restores})
        return out

    @router.post(f"{API_PREFIX}/rollouts/evaluate")
    def evaluate_rollouts(who: Actor) -> dict[str, str]:
        """Evaluate every running rollout now (the registry also does it every ``rollout_tick_s``)."""
        changes = tick(ctx.sessions, read_sessions=ctx.read_sessions)
        if changes:  # what the evaluator does every tick anyway: logged when it changed something
            with ctx.tx() as s:
                audit.record(s, who, "rollouts.evaluate", ", ".join(f"rollout {k}: {v}" for k, v in changes.items()))
        ctx.rollout_changed(changes)
        return {str(k): v for k, v in changes.items()}

    @router.post(f"{API_PREFIX}/rollouts/{{rollout_id}}/{{action}}", response_model=RolloutInfo)
    def rollout_action(rollout_id: PathNumber, action: str, who: Actor,
                       req: RolloutAction | None = None) -> RolloutInfo:
        with ctx.tx() as s:
            info = rollouts.act(s, rollout_id, action, req.reason if req else "")
            audit.record(s, who, f"rollout.{action}", f"rollout {rollout_id}", req.reason if req else "")
        log.info("rollout %d: %s by an operator (now %s)", rollout_id, action, info.state)
        ctx.nudge({"rollout": rollout_id, "change": info.state})
        return info

    return router
