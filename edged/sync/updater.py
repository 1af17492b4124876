"""One model's update, step by step: verify, download, prepare, install, activate, trial, commit or roll back.

Each step is recorded in the sync state before the next begins, so a process killed at
any instant resumes where it was (downloads resume; a trial restarts; a half-done
rollback completes). Nothing reaches the repository before the release's signature,
number, expiry, sizes and digests have all been checked, and nothing is served before
the version loaded, warmed up and passed its golden check. Runs in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edged.config import Config, VersionPolicy
from edged.core.model_versions import ModelState
from edged.core.pipelines import load_pipeline_version
from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.protocol.fleet.messages import DesiredModel, QualityReport, ServingModel
from edged.protocol.fleet.release import ReleaseManifest
from edged.protocol.names import MANIFEST_NAME
from edged.repository.digests import DigestCache
from edged.repository.manifest import Evaluation, parse_manifest
from edged.repository.store import load_version
from edged.sync import localfault, plan, quality
from edged.sync.capped_http import RegistryHttp, StoppedError, SyncHttpError, TransferError
from edged.sync.download import fetch_release
from edged.sync.faults import fault_point
from edged.sync.registry_client import DeviceClient
from edged.sync.repo import DeviceRepo, folder_matches
from edged.sync.settings import SyncSettings
from edged.sync.state import ModelSync, Pending, PendingStep, StateStore, SyncState, VersionRef
from edged.sync.trial import SETTLE_FRACTION, SETTLE_MAX_S, Sample, baseline, judge, sample
from edged.sync.verify import RefusedError, check_release

log = logging.getLogger(__name__)
KEEP_REFUSALS = 20
TRIAL_TICK_S = 0.25
REVERT_PREFIX = "the registry asked to return to the last-known-good"


class Updater:
    def __init__(self, cfg: Config, service: InferenceService, settings: SyncSettings, *, store: StateStore,
                 state: SyncState, client: DeviceClient, http: RegistryHttp, stop: threading.Event) -> None:
        self.cfg, self.service, self.s = cfg, service, settings
        self.store, self.state, self.client, self.http = store, state, client, http
        self.repo = DeviceRepo(settings.repository)
        self.stop = stop
        self.baselines: dict[str, Sample | None] = {}
        self.run_up: dict[str, Sample | None] = {}  # the previous version's statistics when the update began
        # During a trial: asks the registry whether this release must be reverted (reason) or not (None).
        self.revert_check: Callable[[str, int], str | None] | None = None
        self._unrevertable: set[tuple[str, int]] = set()
        self.quality: dict[str, QualityReport] = {}  # per model: the trial's evaluation-set scores
        self._download_reported: set[tuple[str, int]] = set()  # "downloading" sent for (model, release)

    # ---- helpers ----------------------------------------------------------------------------
    def _ms(self, model: str) -> ModelSync:
        with self.store.lock:
            return self.state.model(model)

    def _pin(self, model: str, version: int | None) -> None:
        """Make the live version policy (the ModelManager's, replaced on SIGHUP) name exactly this version."""
        models = self.service.manager.models_cfg
        if version is None:
            if model not in models.disabled:
                models.disabled.append(model)
            return
        models.policies[model] = VersionPolicy(specific=[version])
        if model in models.disabled:
            models.disabled.remove(model)

    def _loaded(self, model: str) -> list[int]:
        return [mv.version for mv in self.service.manager.table.versions(model) if mv.state is ModelState.READY]

    def _ensure_serving(self, model: str, version: int | None) -> None:
        self._pin(model, version)
        if version is None:
            if self.service.manager.table.versions(model):
                with contextlib.suppress(EdgedError):
                    self.service.manager.unload_model(model)
            return
        if self._loaded(model) == [version] and len(self.service.manager.table.versions(model)) == 1:
            return
        if not self.repo.version_dir(model, version).is_dir():
            log.error("model=%s version %d should serve but is not in the repository", model, version)
            return
        results = self.service.manager.load_model(model, [version])
        if not results or results[0].state is not ModelState.READY:
            log.error("model=%s version %d failed to load: %s", model, version, results[0].reason if results else "?")

    def serving(self) -> list[ServingModel]:
        out = []
        with self.store.lock:
            for name, ms in sorted(self.state.models.items()):
                p = ms.pending
                if p is not None and p.step == "trial":
                    out.append(ServingModel(model=name, version=p.version, release=p.release, state="active-trial"))
                elif ms.current is not None:
                    out.append(ServingModel(model=name, version=ms.current.version, release=ms.current.release,
                                            state="committed" if ms.current.release else "local"))
        return out

    # ---- start-up ---------------------------------------------------------------------------
    def recover(self) -> None:
        """After a start: serve the pinned versions, finish local steps of interrupted updates, tidy up."""
        with self.store.lock:
            models = list(self.state.models.items())
        keep_staging = set()
        for model, ms in models:
            p = ms.pending
            if p is not None and p.step in ("download", "prepare", "install"):
                keep_staging.add(self.repo.staging_dir(model, p.version, p.release))
        self.repo.clean_staging(keep_staging)
        for model, ms in models:
            p = ms.pending
            if p is not None and p.step == "trial":
                self._ensure_serving(model, p.version)
            elif ms.current is not None:
                self._ensure_serving(model, ms.current.version)
            elif p is not None and p.step in ("install", "activate", "rollback"):
                self._ensure_serving(model, None)
            self._collect_garbage(model)
        for model, ms in models:
            p = ms.pending
            if p is None:
                continue
            if p.step == "rollback":
                self._rollback(model, p.reason or "interrupted rollback")
            elif p.step in ("prepare", "install", "activate", "trial"):
                try:
                    manifest = check_release(p.signed, model=model, public_keys=self.s.public_keys,
                                             highest=p.release, device_id=self.s.device_id,
                                             max_bytes=self.s.max_download_bytes)
                except RefusedError as e:
                    if p.step in ("prepare", "install"):
                        self._abandon(model)
                        self._refuse(model, p.release, p.version, str(e), permanent=True)
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
        model = dm.model
        ms = self._ms(model)
        self._adopt(model, ms)
        verdict = plan.decide(ms, dm.release, time.time())
        if verdict.abandon:
            assert ms.pending is not None
            log.info("model=%s release %d superseded by %d before activation", model, ms.pending.release, dm.release)
            self._abandon(model)
        if verdict.action == "idle":
            return
        p = ms.pending
        try:
            manifest = check_release(dm.signed, model=model, public_keys=self.s.public_keys,
                                     highest=ms.highest_release, device_id=self.s.device_id,
                                     max_bytes=self.s.max_download_bytes)
        except RefusedError as e:
            if p is not None:
                self._abandon(model)
            self._refuse(model, dm.release, dm.version, str(e), permanent=e.permanent)
            return
        if p is None:
            if self._already_serving(model, ms, manifest):
                return
            with self.store.lock:
                ms.highest_release = max(ms.highest_release, manifest.release)
                ms.pending = Pending(release=manifest.release, version=manifest.version, step="download",
                                     signed=dm.signed)
                self.store.save(self.state)
            self.run_up[model] = sample(self.service, model, ms.current.version) if ms.current else None
        try:
            self._advance(model, manifest)
        except OSError as e:
            self._local_fault(model, manifest, e)

    def _local_fault(self, model: str, m: ReleaseManifest, e: OSError) -> None:
        """Storage failed under a step: keep the step, say why (state, registry), let the agent back off."""
        p = self.state.model(model).pending
        reason = localfault.describe(e, p.step if p is not None else "update")
        if p is not None:
            with self.store.lock:
                p.fault = reason
                self.store.save(self.state)
        self.client.report(model, "failed", version=m.version, release=m.release, reason=reason,
                           detail={"local_fault": True, "errno": e.errno}, quiet=True)
        raise localfault.LocalFaultError(f"model={model} release {m.release}: {reason}") from None

    def _adopt(self, model: str, ms: ModelSync) -> None:
        """A model first seen by sync but already served from the repository: that version is the current one."""
        if ms.current is not None or ms.pending is not None:
            return
        ready = self._loaded(model)
        if ready:
            with self.store.lock:
                ms.current = VersionRef(version=max(ready), release=0)
                self.store.save(self.state)
            self._pin(model, max(ready))

    def _already_serving(self, model: str, ms: ModelSync, m: ReleaseManifest) -> bool:
        cur = ms.current
        if cur is None or cur.version != m.version or m.version not in self._loaded(model):
            return False
        if not folder_matches(self.repo.version_dir(model, m.version), m.files):
            return False
        with self.store.lock:
            ms.highest_release = max(ms.highest_release, m.release)
            ms.current = VersionRef(version=m.version, release=m.release)
            ms.refused.pop(m.release, None)
            self.store.save(self.state)
        self.client.report(model, "committed", version=m.version, release=m.release,
                           detail={"note": "this version was already serving"})
        return True

    # ---- the steps --------------------------------------------------------------------------
    def _advance(self, model: str, m: ReleaseManifest) -> None:
        ms = self._ms(model)
        p = ms.pending
        assert p is not None
        staged = self.repo.staging_dir(model, m.version, m.release)
        if p.step == "download" and not self._download(model, m, staged):
            return
        if p.step == "prepare" and not self._prepare(model, m, staged):
            return
        if p.step == "install":
            try:
                self.repo.install(model, m.version, staged, m.files)
            except FileNotFoundError:
                self._set_step(model, "download")  # the staged copy is gone and the repository has no good one
                return
            with self.store.lock:
                if m.version not in ms.installed:
                    ms.installed.append(m.version)
                p.step = "activate"
                self.store.save(self.state)
            fault_point("install.renamed")
        if p.step == "activate" and not self._activate(model, m):
            return
        if p.step == "trial":
            self._trial(model, m)

    def _download(self, model: str, m: ReleaseManifest, staged: Any) -> bool:
        if folder_matches(self.repo.version_dir(model, m.version), m.files):
            # e.g. going back to the last-known-good by a new release: the files are already here
            self.client.report(model, "verifying", version=m.version, release=m.release,
                               detail={"downloaded_bytes": 0, "note": "already in the repository"})
            self._set_step(model, "prepare")
            return True
        if (model, m.release) not in self._download_reported:  # once, not at every resumed attempt
            self._download_reported.add((model, m.release))
            self.client.report(model, "downloading", version=m.version, release=m.release,
                               detail={"bytes": m.total_size, "files": len(m.files)})
        try:
            stats = fetch_release(self.http, self.client.credential(), m, staged,
                                  chunk=self.s.download_chunk_kb * 1024, should_stop=self.stop.is_set)
        except StoppedError:
            return False
        except TransferError as e:
            self._refuse(model, m.release, m.version, f"download refused: {e}")
            return False
        except SyncHttpError as e:
            if e.status in (403, 404):
                self._refuse(model, m.release, m.version, f"download refused by the registry: {e}")
                return False
            raise
        self.client.report(model, "verifying", version=m.version, release=m.release,
                           detail={"downloaded_bytes": stats.bytes, "resumed_files": stats.resumed_files})
        self.repo.seal(staged)
        fault_point("verify.done")
        self._set_step(model, "prepare")
        return True

    def _set_step(self, model: str, step: PendingStep) -> None:
        with self.store.lock:
            ms = self.state.model(model)
            assert ms.pending is not None
            ms.pending.step = step
            ms.pending.fault = None
            ms.refused.pop(ms.pending.release, None)
            self.store.save(self.state)

    def _prepare(self, model: str, m: ReleaseManifest, staged: Any) -> bool:
        """Load, warm up and golden-check the staged copy for this device's profile, then let it go."""
        if folder_matches(staged, m.files):
            where = staged
        elif folder_matches(self.repo.version_dir(model, m.version), m.files):
            where = self.repo.version_dir(model, m.version)
        else:
            self._set_step(model, "download")  # staged files damaged (e.g. power loss): fetch again
            return False
        entry = load_version(model, m.version, where, DigestCache(None))
        reason = entry.error
        label = None
        if reason is None and entry.pipeline:
            # A pipeline has no engine: compiled against the models served now, its files checked.
            mv = load_pipeline_version(entry, self.service.manager.gateway, DigestCache(None))
            label, reason = ("pipeline", None) if mv.state is ModelState.READY else (None, mv.reason)
        elif reason is None:
            mv = self.service.manager.loader.load(entry)
            if mv.upgrade is not None:
                # A better engine is being built (e.g. TensorRT): let it finish now, so its cache is warm
                # when the version is activated, unless the agent is asked to stop.
                while not mv.upgrade.wait(1.0) and not self.stop.is_set():
                    pass
                mv.upgrade.cancel()
            if mv.state is ModelState.READY and mv.engine is not None:
                label = mv.candidate.label if mv.candidate else None
                mv.engine.unload()
                mv.engine = None
            else:
                reason = mv.reason or "did not load"
        if reason is not None:
            self._rollback(model, f"prepare failed: {reason}")
            return False
        fault_point("prepare.done")
        self._set_step(model, "install")
        self.client.report(model, "prepared", version=m.version, release=m.release, detail={"engine": label})
        return True

    def _evaluation(self, model: str, version: int) -> Evaluation | None:
        try:
            return parse_manifest(self.repo.version_dir(model, version) / MANIFEST_NAME, model=model,
                                  version=version).evaluation
        except EdgedError:
            return None  # it loaded moments ago; a manifest gone bad now fails the activation itself

    def _score_previous(self, model: str, cur_version: int, folder: Any, ev: Evaluation) -> float | None:
        """The replaced version on the new release's evaluation set, scored while it still serves."""
        try:
            return quality.score(self.service.model(model, cur_version), folder, ev).score
        except EdgedError as e:  # e.g. its inputs changed shape: the registry compares with other figures
            log.warning("model=%s version %d could not be scored on the new evaluation set: %s", model,
                        cur_version, e)
            return None

    def _activate(self, model: str, m: ReleaseManifest) -> bool:
        ms = self._ms(model)
        cur = ms.current
        at_switch = sample(self.service, model, cur.version) if cur is not None else None
        self.baselines[model] = baseline(self.run_up.pop(model, None), at_switch, self.s)
        folder = self.repo.version_dir(model, m.version)
        ev = self._evaluation(model, m.version)
        base_score = None
        if ev is not None and cur is not None and cur.version in self._loaded(model):
            base_score = self._score_previous(model, cur.version, folder, ev)
        self.quality.pop(model, None)
        fault_point("activate.before")
        self._pin(model, m.version)
        results = self.service.manager.load_model(model, [m.version])
        mv = results[0] if results else None
        if mv is None or mv.state is not ModelState.READY:
            self._rollback(model, f"activation failed: {mv.reason if mv else 'not loaded'}")
            return False
        fault_point("activate.loaded")
        if ev is not None:
            try:
                got = quality.score(mv, folder, ev)
            except EdgedError as e:
                self._rollback(model, f"evaluation set failed: {e}")
                return False
            q = QualityReport(metric=ev.metric, samples=got.samples, score=got.score,
                              baseline_version=cur.version if base_score is not None and cur else None,
                              baseline_score=base_score)
            log.info("model=%s version %d scores %.4f on its evaluation set (%d samples); version %s: %s", model,
                     m.version, got.score, got.samples, cur.version if cur else "-",
                     f"{base_score:.4f}" if base_score is not None else "not scored")
            if base_score is not None and cur is not None and base_score - got.score > self.s.trial_max_quality_drop:
                self._rollback(model, f"evaluation set: version {m.version} scores {got.score:.4f}, version "
                                      f"{cur.version} {base_score:.4f} on the same {got.samples} samples (allowed "
                                      f"drop {self.s.trial_max_quality_drop:g})", quality=q)
                return False
            self.quality[model] = q
        with self.store.lock:
            p = ms.pending
            assert p is not None
            p.step = "trial"
            self.store.save(self.state)
        self.client.report(model, "active-trial", version=m.version, release=m.release,
                           detail={"engine": mv.candidate.label if mv.candidate else None, "trial_s": self.s.trial_s},
                           quality=self.quality.get(model))
        self._send_facts()
        return True

    def _send_facts(self) -> None:
        """Clients get the new version from the trial's first moment on: the registry hears it now, not when
        the trial ends (the agent sends facts only between two rounds, and a trial lasts a whole round)."""
        try:
            self.client.send_facts(self.serving())
        except SyncHttpError as e:  # the registry hears them after the trial; the trial itself goes on
            log.info("model trial: facts not sent now (%s); sent after the trial", e)

    def _rescore(self, model: str, m: ReleaseManifest) -> None:
        """A trial resumed after a restart: score the evaluation set again (the replaced version is gone)."""
        ev = self._evaluation(model, m.version)
        if ev is None or model in self.quality:
            return
        try:
            got = quality.score(self.service.model(model, m.version), self.repo.version_dir(model, m.version), ev)
        except EdgedError as e:
            log.warning("model=%s version %d: evaluation set not scored on resuming the trial: %s", model,
                        m.version, e)
            return
        self.quality[model] = QualityReport(metric=ev.metric, samples=got.samples, score=got.score)

    def _trial(self, model: str, m: ReleaseManifest) -> None:
        fault_point("trial.start")
        self._rescore(model, m)
        base = self.baselines.get(model)
        start = time.monotonic()
        end = start + self.s.trial_s
        cap = end + self.s.trial_extend_s
        settle_at = start + min(SETTLE_MAX_S, self.s.trial_s * SETTLE_FRACTION)
        settled: Sample | None = None
        new: Sample | None = None
        next_check = start + max(self.s.poll_interval_s, TRIAL_TICK_S)
        paused = False
        left = end - start
        while True:
            if self.stop.is_set():
                return  # the next start continues the trial
            # The operator's mark is read on both sides of the sample: an unload sets it before the
            # versions go and a reload clears it after they are back, so a model found gone with the
            # mark unset both times really vanished on its own.
            unloaded = self.service.manager.operator_unloaded
            marked = model in unloaded
            new = sample(self.service, model, m.version)
            now = time.monotonic()
            if new is None:
                if not marked and model not in unloaded:
                    self._rollback(model, f"trial failed: version {m.version} is no longer loaded")
                    return
                if not paused:  # an operator's choice is not the release's failure: nothing is reported
                    log.warning("model=%s trial of version %d paused: an operator unloaded the model; the trial "
                                "starts over once it is loaded again", model, m.version)
                    paused = True
            else:
                if paused:
                    log.info("model=%s loaded again: the trial of version %d starts over", model, m.version)
                    paused, settled = False, None
                    start = now
                    end = start + self.s.trial_s
                    cap = end + self.s.trial_extend_s
                    settle_at = start + min(SETTLE_MAX_S, self.s.trial_s * SETTLE_FRACTION)
                if settled is None and now >= settle_at:
                    settled = new
                if now >= end and end < cap and new.total < self.s.trial_min_requests and model not in self.quality:
                    end = min(cap, now + TRIAL_TICK_S)  # too little traffic to judge, no evaluation set: wait on
                left = end - now
                reason = judge(new, base, self.s, final=left <= 0, latency=new.since(settled) if settled else None)
                if reason is not None:
                    self._rollback(model, f"trial failed: {reason}")
                    return
                if left <= 0:
                    break
            if self.revert_check is not None and now >= next_check:
                next_check = now + max(self.s.poll_interval_s, TRIAL_TICK_S)
                why = self.revert_check(model, m.release)
                if why is not None:
                    self._rollback(model, f"{REVERT_PREFIX}: {why}")
                    return
            self.stop.wait(TRIAL_TICK_S if paused else min(TRIAL_TICK_S, left))
            fault_point("trial.tick")
        self._commit(model, m, new)

    def _commit(self, model: str, m: ReleaseManifest, trial: Sample | None) -> None:
        fault_point("commit.before")
        ms = self._ms(model)
        with self.store.lock:
            ms.lkg = ms.current
            ms.current = VersionRef(version=m.version, release=m.release)
            ms.pending = None
            self.store.save(self.state)
        fault_point("commit.saved")
        self._collect_garbage(model)
        detail: dict[str, Any] = {}
        if trial is not None:
            # no request, no latency: a p99 of 0.0 ms would read as a measurement
            detail = {"requests": trial.total, "errors": trial.errors,
                      "p99_ms": trial.p99_s * 1000 if trial.total else None}
        detail.update(self._judged_on(model, m, trial))
        self.baselines.pop(model, None)
        self.client.report(model, "committed", version=m.version, release=m.release, detail=detail)

    def _judged_on(self, model: str, m: ReleaseManifest, trial: Sample | None) -> dict[str, Any]:
        """What the commit rests on, said in the report: live traffic, the evaluation set alone, or nothing."""
        n = self.s.trial_min_requests
        seen = trial.total if trial is not None else 0
        q = self.quality.pop(model, None)
        if seen >= n:
            return {"judged": "traffic"}
        if q is not None:
            return {"judged": "evaluation-set",
                    "note": f"{seen} of {n} requests in trial: committed on the evaluation set alone "
                            f"(score {q.score:.4f} over {q.samples} samples)"}
        note = (f"{seen} of {n} requests in trial (waited up to {self.s.trial_extend_s:g}s more) and no evaluation "
                "set: committed unjudged")
        log.warning("model=%s release %d: %s", model, m.release, note)
        return {"judged": "unjudged", "note": note}

    def _rollback(self, model: str, reason: str, *, quality: QualityReport | None = None) -> None:
        """Serve the committed version again, drop the new one, never retry this release."""
        ms = self._ms(model)
        with self.store.lock:
            p = ms.pending
            assert p is not None
            p.step, p.reason = "rollback", reason
            self.store.save(self.state)
        fault_point("rollback.before")
        self._ensure_serving(model, ms.current.version if ms.current else None)
        fault_point("rollback.loaded")
        keep = {r.version for r in (ms.current, ms.lkg) if r is not None}
        if p.version not in keep:
            self.repo.remove(model, p.version)
        self.repo.drop_staging(self.repo.staging_dir(model, p.version, p.release))
        with self.store.lock:
            if p.version in ms.installed and p.version not in keep:
                ms.installed.remove(p.version)
            ms.rejected[p.release] = reason
            _trim(ms.rejected)
            ms.pending = None
            self.store.save(self.state)
        self.client.report(model, "rolled-back", version=p.version, release=p.release, reason=reason,
                           detail={"serving": ms.current.version if ms.current else None}, quality=quality)

    # ---- instructions from the registry ---------------------------------------------------------
    def revert(self, model: str, releases: list[int], reason: str) -> None:
        """Stop running, or never install, releases whose rollout the registry halted or rolled back."""
        ms = self._ms(model)
        action, release = plan.revert_action(ms, releases)
        why = f"{REVERT_PREFIX}: {reason or 'rollout stopped'}"
        if action == "none" or release is None:
            return
        if action == "forget":
            with self.store.lock:
                for r in releases:
                    ms.rejected.setdefault(r, why)
                _trim(ms.rejected)
                self.store.save(self.state)
            return
        if action == "abandon":
            p = ms.pending
            assert p is not None
            self._abandon(model)
            with self.store.lock:
                ms.rejected[release] = why
                _trim(ms.rejected)
                self.client.report(model, "rolled-back", version=p.version, release=release, reason=why,
                                   detail={"serving": ms.current.version if ms.current else None, "step": p.step})
            return
        if action == "rollback":
            self._rollback(model, why)
            return
        lkg = ms.lkg
        if action == "to-lkg" and lkg is not None and self.repo.version_dir(model, lkg.version).is_dir():
            self._to_last_known_good(model, why)
            return
        if (model, release) not in self._unrevertable:
            self._unrevertable.add((model, release))
            self.client.report(model, "failed", version=ms.current.version if ms.current else None, release=release,
                               reason=f"{why}; but no last-known-good version is kept here, so it keeps serving")

    def _to_last_known_good(self, model: str, why: str) -> None:
        """A committed release must go: serve the last-known-good again (state and report saved together)."""
        ms = self._ms(model)
        cur, lkg = ms.current, ms.lkg
        assert cur is not None and lkg is not None
        with self.store.lock:
            ms.rejected[cur.release] = why
            _trim(ms.rejected)
            ms.current, ms.lkg = lkg, None
            self.client.report(model, "rolled-back", version=cur.version, release=cur.release, reason=why,
                               detail={"serving": lkg.version, "from": "committed"})  # saves the state too
        self._ensure_serving(model, lkg.version)
        self._collect_garbage(model)

    def _abandon(self, model: str) -> None:
        """Drop an update that has not been activated (superseded, expired, refused)."""
        ms = self._ms(model)
        p = ms.pending
        if p is None:
            return
        self.repo.drop_staging(self.repo.staging_dir(model, p.version, p.release))
        keep = {r.version for r in (ms.current, ms.lkg) if r is not None}
        if p.step in ("install", "activate") and p.version not in keep:
            self.repo.remove(model, p.version)
        with self.store.lock:
            if p.version in ms.installed and p.version not in keep:
                ms.installed.remove(p.version)
            ms.pending = None
            self.store.save(self.state)

    def _refuse(self, model: str, release: int, version: int | None, reason: str, *, permanent: bool = False) -> None:
        ms = self._ms(model)
        self._download_reported.discard((model, release))  # a later attempt is a new download
        with self.store.lock:
            if permanent:
                ms.rejected[release] = reason
                _trim(ms.rejected)
            else:
                ms.refused[release] = plan.next_refusal(ms.refused.get(release), reason, time.time(),
                                                        poll_interval_s=self.s.poll_interval_s,
                                                        retry_max_s=self.s.retry_max_s)
                _trim(ms.refused)
            self.store.save(self.state)
        self.client.report(model, "failed", version=version, release=release, reason=reason)

    def _collect_garbage(self, model: str) -> None:
        """Delete versions this agent installed that are neither current, last-known-good nor pending."""
        ms = self._ms(model)
        keep = ms.keep()
        for v in [v for v in ms.installed if v not in keep]:
            self.repo.remove(model, v)
            with self.store.lock:
                ms.installed.remove(v)
                self.store.save(self.state)


def _trim(d: dict[int, Any]) -> None:
    for k in sorted(d)[:-KEEP_REFUSALS]:
        del d[k]
