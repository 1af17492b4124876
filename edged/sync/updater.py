"""Model updates, driven step by step: verify, download, prepare, install, activate, trial, commit or roll back.

Each step is a module of :mod:`edged.sync.update`; the moves between them are data
(:mod:`edged.sync.update.machine`), and each is recorded in the sync state before the next
step begins, so a process killed at any instant resumes where it was (downloads resume; a
trial restarts; a half-done rollback completes). Nothing reaches the repository before the
release's signature, number, expiry, sizes and digests have all been checked, and nothing is
served before the version loaded, warmed up and passed its golden check.

Runs in the sync worker thread. A trial does not hold that thread: :meth:`Updater.tick` visits
the models on trial when they are due, and other models' updates go on in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edged.protocol.fleet.messages import DesiredModel, ServingModel
from edged.protocol.fleet.release import ReleaseManifest, SignedRelease
from edged.sync import localfault, plan
from edged.sync.capped_http import RegistryHttp
from edged.sync.engine_port import EnginePort
from edged.sync.registry_client import DeviceClient
from edged.sync.repo import DeviceRepo, folder_matches
from edged.sync.settings import SyncSettings
from edged.sync.state import ModelSync, Pending, PendingStep, StateStore, SyncState, VersionRef
from edged.sync.update import activate, fetch, install, machine, prepare, report, revert, trial, undo
from edged.sync.update.context import UpdateContext
from edged.sync.update.serving import serving
from edged.sync.verify import RefusedError, check_release

log = logging.getLogger(__name__)

# The step each persisted step runs; True: it finished and the machine goes on to the next one.
StepRun = Callable[[UpdateContext, str, ReleaseManifest, Path], bool]
STEPS: dict[PendingStep, StepRun] = {
    "download": fetch.run,
    "prepare": prepare.run,
    "install": install.run,
    "activate": activate.run,
}


class Updater:
    def __init__(
        self,
        settings: SyncSettings,
        engine: EnginePort,
        *,
        store: StateStore,
        state: SyncState,
        client: DeviceClient,
        http: RegistryHttp,
        stop: threading.Event,
    ) -> None:
        self.s = settings
        self.state = state
        self.ctx = UpdateContext(
            settings=settings,
            store=store,
            state=state,
            client=client,
            http=http,
            engine=engine,
            stop=stop,
            repo=DeviceRepo(settings.repository),
        )

    def serving(self) -> list[ServingModel]:
        return serving(self.ctx)

    # ---- start-up ---------------------------------------------------------------------------
    def recover(self) -> None:
        """After a start: serve the pinned versions, finish local steps of interrupted updates, tidy up."""
        try:
            self._recover()
        finally:
            self.flush()

    def _recover(self) -> None:
        ctx = self.ctx
        with ctx.store.lock:
            models = list(self.state.models.items())
        keep_staging = set()
        for model, ms in models:
            p = ms.pending
            if p is not None and p.step in ("download", "prepare", "install"):
                keep_staging.add(ctx.repo.staging_dir(model, p.version, p.release))
        ctx.repo.clean_staging(keep_staging)
        for model, ms in models:
            p = ms.pending
            if p is not None and p.step == "trial":
                undo.ensure_serving(ctx, model, p.version)
            elif ms.current is not None:
                undo.ensure_serving(ctx, model, ms.current.version)
            elif p is not None and p.step in ("install", "activate", "rollback"):
                undo.ensure_serving(ctx, model, None)
            undo.collect_garbage(ctx, model)
        for model, ms in models:
            p = ms.pending
            if p is None:
                continue
            if p.step == "rollback":
                undo.rollback(ctx, model, p.reason or "interrupted rollback")
            elif p.step in ("prepare", "install", "activate", "trial"):
                try:
                    manifest = self._check(model, p.signed, p.release)
                except RefusedError as e:
                    if p.step in ("prepare", "install"):
                        undo.abandon(ctx, model)
                        undo.refuse(ctx, model, p.release, p.version, str(e), permanent=True)
                        continue
                    manifest = p.signed.unverified()  # already activated: finish the trial, expiry no longer matters
                try:
                    self._advance(model, manifest)
                except OSError as e:  # reported and kept in the state; the polls retry it with back-off
                    try:
                        self._local_fault(model, manifest, e)
                    except localfault.LocalFaultError as fault:
                        log.error("update blocked by a local fault: %s", fault)

    # ---- one desired model ------------------------------------------------------------------
    def process(self, dm: DesiredModel) -> None:
        """Start, resume or ignore the release the registry wants for one model (one step at a time)."""
        ctx, model = self.ctx, dm.model
        self._adopt(model)
        # No saved entry before the release passed its signed checks: a model this device never had is
        # looked at through an unsaved one, so that no name a registry sends grows the state.
        ms = ctx.entry(model)
        verdict = plan.decide(ms, dm.release, time.time())
        if verdict.abandon:
            assert ms.pending is not None
            log.info("model=%s release %d superseded by %d before activation", model, ms.pending.release, dm.release)
            undo.abandon(ctx, model)
        if verdict.action == "idle":
            return
        p = ms.pending
        try:
            manifest = self._check(model, dm.signed, ms.highest_release)
        except RefusedError as e:
            if p is not None:
                undo.abandon(ctx, model)
            undo.refuse(ctx, model, dm.release, dm.version, str(e), permanent=e.permanent)
            return
        ms = ctx.ms(model)
        if p is None:
            if self._already_serving(model, ms, manifest):
                return
            clash = install.replaces_kept(ctx, model, ms, manifest)
            if clash is not None:
                undo.refuse(ctx, model, manifest.release, manifest.version, clash, permanent=True)
                return
            pending = Pending(release=manifest.release, version=manifest.version, step="download", signed=dm.signed)
            machine.start(ctx.store, self.state, model, pending)
            ctx.run_up[model] = ctx.engine.sample(model, ms.current.version) if ms.current else None
        try:
            self._advance(model, manifest)
        except OSError as e:
            self._local_fault(model, manifest, e)

    def _check(self, model: str, signed: SignedRelease, highest: int) -> ReleaseManifest:
        s = self.s
        return check_release(
            signed,
            model=model,
            public_keys=s.public_keys,
            highest=highest,
            device_id=s.device_id,
            max_bytes=s.max_download_bytes,
        )

    def _advance(self, model: str, m: ReleaseManifest) -> None:
        """Run the update's steps until one waits (a trial, a refusal, a stop) or the update ends."""
        ctx = self.ctx
        staged = ctx.repo.staging_dir(model, m.version, m.release)
        while True:
            p = ctx.ms(model).pending
            if p is None or p.step == "rollback":
                return
            if p.step == "trial":
                if model not in ctx.trials:
                    trial.begin(ctx, model)
                return
            if not STEPS[p.step](ctx, model, m, staged):
                return

    # ---- trials -----------------------------------------------------------------------------
    def tick(self) -> bool:
        """Visit every model on trial that is due; True when a trial ended (committed or rolled back)."""
        ctx = self.ctx
        with ctx.store.lock:
            on_trial = [m for m, ms in self.state.models.items() if ms.pending and ms.pending.step == "trial"]
        ended = False
        for model in on_trial:
            try:
                ended = trial.visit(ctx, model) or ended
            except Exception:  # looked at again a tick later, never in a tight loop
                log.exception("model=%s trial step failed", model)
                clock = ctx.trials.get(model)
                if clock is not None:
                    clock.due = time.monotonic() + trial.TRIAL_TICK_S
        return ended

    def next_tick_in(self) -> float | None:
        """Seconds until a trial is due (0: now); None when no model is on trial."""
        due = trial.due(self.ctx)
        return None if due is None else max(0.0, due - time.monotonic())

    # ---- instructions from the registry ---------------------------------------------------------
    def revert(self, model: str, releases: list[int], reason: str) -> None:
        """Stop running, or never install, releases whose rollout the registry halted or rolled back."""
        revert.run(self.ctx, model, releases, reason)

    def flush(self) -> None:
        """Write what this poll changed without saving at once (refusals, reverts of releases never had)."""
        with self.ctx.store.lock:
            self.ctx.store.flush(self.state)

    # ---- helpers ----------------------------------------------------------------------------
    def _local_fault(self, model: str, m: ReleaseManifest, e: OSError) -> None:
        """Storage failed under a step: keep the step, say why (state, registry), let the agent back off."""
        ctx = self.ctx
        p = self.state.model(model).pending
        reason = localfault.describe(e, p.step if p is not None else "update")
        if p is not None:
            with ctx.store.lock:
                p.fault = reason
                ctx.store.save(self.state)
        report.failure(
            ctx.client,
            model,
            "failed",
            version=m.version,
            release=m.release,
            reason=reason,
            detail={"local_fault": True, "errno": e.errno},
            quiet=True,
        )
        raise localfault.LocalFaultError(f"model={model} release {m.release}: {reason}") from None

    def _adopt(self, model: str) -> None:
        """A model first seen by sync but already served from the repository: that version is the current one."""
        ms = self.ctx.known(model)
        if ms is not None and (ms.current is not None or ms.pending is not None):
            return
        ready = self.ctx.engine.ready_versions(model)
        if ready:  # an entry per model this device serves, whatever names the registry sends
            with self.ctx.store.lock:
                self.ctx.ms(model).current = VersionRef(version=max(ready), release=0)
                self.ctx.store.save(self.state)
            self.ctx.engine.pin(model, max(ready))

    def _already_serving(self, model: str, ms: ModelSync, m: ReleaseManifest) -> bool:
        ctx = self.ctx
        cur = ms.current
        if cur is None or cur.version != m.version or m.version not in ctx.engine.ready_versions(model):
            return False
        if not folder_matches(ctx.repo.version_dir(model, m.version), m.files):
            return False
        with ctx.store.lock:
            ms.highest_release = max(ms.highest_release, m.release)
            ms.current = VersionRef(version=m.version, release=m.release)
            ms.refused.pop(m.release, None)
            ctx.store.save(self.state)
        ctx.client.outbox.report(
            model,
            "committed",
            version=m.version,
            release=m.release,
            detail={"note": "this version was already serving"},
        )
        return True
