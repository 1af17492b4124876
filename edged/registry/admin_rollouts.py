"""Rollouts, for the operator client: start (with a release signed here), watch, act on, roll back."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import TypeAdapter

from edged.protocol.fleet.release import SignedRelease, TargetSelector
from edged.registry.admin_http import RegistryClientError
from edged.registry.admin_releases import ReleasesApi
from edged.registry.rollout_wire import (
    RollbackPlan,
    RollbackRequest,
    RollbackResult,
    RolloutAction,
    RolloutCreate,
    RolloutInfo,
    RolloutStatus,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


class RolloutsApi(ReleasesApi):
    def create_rollout(self, req: RolloutCreate) -> RolloutInfo:
        r = self._send("POST", "/rollouts", req)
        return RolloutInfo.model_validate_json(r.content)

    def release_with_rollout(  # noqa: PLR0913  a release's fields (as release()) plus the rollout's spec
            self, key: Ed25519PrivateKey, model: str, version: int, spec: RolloutCreate, *,
            expires_in_s: float, selector: TargetSelector | None = None, notes: str = "",
            number: int | None = None, check_folder: Path | None = None) -> RolloutInfo:
        """Sign a new release of a pushed version here and start its rollout with it, in one request.

        ``spec`` gives target, steps and gates; its ``release``/``signed`` are replaced.
        """
        info = self.version(model, version)
        if check_folder is not None:
            self._check_folder(check_folder, info)

        def post(signed: SignedRelease) -> RolloutInfo:
            return self.create_rollout(spec.model_copy(update={"model": model, "release": None, "signed": signed}))

        return self._sign_and_post(key, info, expires_in_s=expires_in_s, selector=selector, notes=notes,
                                   number=number, post=post)

    def rollouts(self, model: str | None = None, state: str | None = None) -> list[RolloutInfo]:
        params = {k: v for k, v in (("model", model), ("state", state)) if v is not None}
        return TypeAdapter(list[RolloutInfo]).validate_json(self._call("GET", "/rollouts", params=params).content)

    def rollout(self, rollout_id: int, *, members: bool = False) -> RolloutStatus:
        r = self._call("GET", f"/rollouts/{rollout_id}", params={"members": "true"} if members else None)
        return RolloutStatus.model_validate_json(r.content)

    def rollout_action(self, rollout_id: int, action: str, reason: str = "") -> RolloutInfo:
        r = self._send("POST", f"/rollouts/{rollout_id}/{action}", RolloutAction(reason=reason))
        return RolloutInfo.model_validate_json(r.content)

    def rollback_plan(self, model: str, to: str = "previous") -> RollbackPlan:
        return RollbackPlan.model_validate_json(self._call("GET", f"/models/{model}/rollback",
                                                           params={"to": to}).content)

    def rollback(self, key: Ed25519PrivateKey, model: str, to: str = "previous", *, reason: str = "",
                 expires_in_s: float, selector: TargetSelector | None = None) -> RollbackResult:
        """Sign, here, a new release of the version ``to`` names (a release number or "previous") and post it
        as the model's rollback; retries when another release took the number meanwhile."""
        for _attempt in range(5):
            plan = self.rollback_plan(model, to)
            info = self.version(model, plan.version)
            notes = f"rollback to release {plan.to_release}" + (f": {reason}" if reason else "")

            def post(signed: SignedRelease, plan: RollbackPlan = plan) -> RollbackResult:
                body = RollbackRequest(to_release=plan.to_release, signed=signed, reason=reason)
                r = self._send("POST", f"/models/{model}/rollback", body)
                return RollbackResult.model_validate_json(r.content)

            try:
                return self._sign_and_post(key, info, expires_in_s=expires_in_s, selector=selector or plan.selector,
                                           notes=notes[:4096], number=plan.next_release, post=post)
            except RegistryClientError as e:
                if e.status == 409 and "release number" in str(e):
                    continue  # "previous" may name another release now: plan again
                raise
        raise RegistryClientError("could not get a release number after 5 attempts (concurrent releases?)")

    def evaluate_rollouts(self) -> dict[str, str]:
        out: dict[str, str] = self._call("POST", "/rollouts/evaluate").json()
        return out

