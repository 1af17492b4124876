"""One simulated device: the real sync decisions, checks and reports, with a simulated engine.

What is real: the desired-state poll with ETag, the release checks of
:func:`edged.sync.verify.check_release` (Ed25519 signature, release number, expiry,
target, size), the decisions of :mod:`edged.sync.plan` (start, resume, supersede, refuse
with back-off, never retry a rolled-back release, return to the last-known-good when the
registry says so), the sync state objects, the report events with their sequence numbers,
downloads of the release's files checked against their digests, and the trial verdict of
:func:`edged.sync.trial.judge`. What is simulated: loading and serving the model — a
version's behaviour (:class:`Behaviour`) says how often its golden check fails and what
error rate and latency its live traffic shows, which is what the trial judges and what
the telemetry uploads carry.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from bench.sim.http_pool import Answer, HttpPool, SimHttpError
from edged.latency_buckets import LATENCY_BUCKETS_S
from edged.protocol.fleet.messages import API_PREFIX, DesiredModel, DesiredState, RevertModel
from edged.protocol.fleet.release import ReleaseManifest
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.sync import plan
from edged.sync.outbox import FLUSH_RETRY_S, REPORT_BATCH, retry_after_s
from edged.sync.plan import REVERT_PREFIX
from edged.sync.settings import SyncSettings
from edged.sync.state import ModelSync, Pending, SyncState, VersionRef
from edged.sync.trial import Sample, judge
from edged.sync.verify import RefusedError, check_release

TRIAL_REQUESTS = 600  # requests a device serves during a trial (enough for the p99 judgement)
KINDS = ("poll", "report", "facts", "blob", "telemetry", "enroll")


class SimBusyError(SimHttpError):
    """The registry shed the request (503 + Retry-After): not a failure, a time to come back."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"the registry is busy; back in {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Behaviour:
    """How a model version behaves on the simulated devices."""

    prepare_fail: float = 0.0  # share of devices whose golden check fails (rolled back before serving)
    trial_fail: float = 0.0  # share of devices whose live traffic goes bad in the trial
    error_rate: float = 0.001  # share of requests that fail in normal operation
    p99_ms: float = 8.0


@dataclass
class Stats:
    """What the fleet did, for the status file and the benchmark."""

    started: float = field(default_factory=time.monotonic)
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)  # wall t, kind, status, latency s
    steps: Counter[str] = field(default_factory=Counter)  # "<release>:<step>" -> devices that reported it
    activated: Counter[int] = field(default_factory=Counter)
    downloads: Counter[int] = field(default_factory=Counter)
    reverted: Counter[int] = field(default_factory=Counter)
    cycle_failures: int = 0

    def record(self, kind: str, status: int, latency: float) -> None:
        self.requests[kind] += 1
        if status == 0 or status >= 400:
            self.errors[kind] += 1
        self.samples.append((time.time(), KINDS.index(kind), status, latency))


@dataclass
class FleetContext:
    http: HttpPool
    public_keys: list[str]
    poll_s: float
    behaviours: dict[int, Behaviour]
    stats: Stats
    settings: SyncSettings  # thresholds of the trial verdict, as a device would have them
    trial_s: float = 5.0
    prepare_s: float = 0.5
    facts_s: float = 300.0
    telemetry_s: float = 0.0
    download: bool = True
    max_bytes: int = 2048 << 20
    blob_pools: dict[str, HttpPool] = field(default_factory=dict)  # blob servers the registry redirects to

    def behaviour(self, version: int) -> Behaviour:
        return self.behaviours.get(version, Behaviour())

    def blob_pool(self, origin: str) -> HttpPool:
        pool = self.blob_pools.get(origin)
        if pool is None:
            pool = self.blob_pools[origin] = HttpPool(origin, limit=self.http.limit, timeout=self.http.timeout)
        return pool

    def close(self) -> None:
        self.http.close()
        for pool in self.blob_pools.values():
            pool.close()


def sim_settings(trial_s: float) -> SyncSettings:
    return SyncSettings(url="http://simulated", device_id="sim", enrollment_token=None, public_keys=[],
                        poll_interval_s=30.0, labels={}, state_dir=Path("/nonexistent"),
                        repository=Path("/nonexistent"), trial_s=trial_s)


def retry_after(a: Answer | None) -> float:
    """How long the daemon waits after this answer (its Retry-After, else the outbox's own retry)."""
    return retry_after_s(a.headers) if a is not None else FLUSH_RETRY_S


def _bucket(seconds: float) -> int:
    for i, bound in enumerate(LATENCY_BUCKETS_S):
        if seconds <= bound:
            return i
    return len(LATENCY_BUCKETS_S)


def latency_counts(n: int, p99_ms: float) -> list[int]:
    """A histogram whose p99 falls in the bucket of ``p99_ms`` (most requests at a third of it)."""
    counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
    slow = max(1, n // 50)
    counts[_bucket(p99_ms / 3000.0)] += n - slow
    counts[_bucket(p99_ms / 1000.0)] += slow
    return counts


class SimDevice:
    def __init__(self, ctx: FleetContext, device_id: str, *, labels: dict[str, str], facts: dict[str, Any],
                 seed: int) -> None:
        self.ctx, self.id, self.labels, self.facts = ctx, device_id, labels, facts
        self.rng = random.Random(seed)
        self.credential: str | None = None
        self.etag: str | None = None
        self.desired: DesiredState | None = None
        self.state = SyncState()
        self.facts_at = -1e9
        self.facts_due = True
        self.run = uuid.uuid4().hex[:16]
        self.telemetry_seq = 0
        self.failures = 0
        self.outbox: list[dict[str, Any]] = []  # reports not yet taken by the registry (as the daemon's)
        self._flusher: asyncio.Task[None] | None = None
        self.download_reported: set[int] = set()
        self.fetched: set[tuple[int, str]] = set()  # (release, sha256) of files already downloaded and checked

    # ---- http -------------------------------------------------------------------------------
    async def call(self, kind: str, method: str, path: str, *, body: Any = None,
                   headers: dict[str, str] | None = None) -> Answer:
        h = dict(headers or {})
        if self.credential:
            h["Authorization"] = f"Bearer {self.credential}"
        data = orjson.dumps(body) if body is not None else None
        t0 = time.perf_counter()
        try:
            a = await self.ctx.http.request(method, path, body=data, headers=h)
        except SimHttpError:
            self.ctx.stats.record(kind, 0, time.perf_counter() - t0)
            raise
        self.ctx.stats.record(kind, a.status, time.perf_counter() - t0)
        return a

    async def follow(self, location: str) -> Answer:
        """A download the registry sent to its blob server (signed URL): fetched without the credential."""
        parts = urlsplit(location)
        if parts.scheme != "http" or not parts.hostname:
            raise SimHttpError(f"blob redirect to {location!r}: the simulator follows http:// only")
        pool = self.ctx.blob_pool(f"http://{parts.netloc}")
        t0 = time.perf_counter()
        try:
            a = await pool.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
        except SimHttpError:
            self.ctx.stats.record("blob", 0, time.perf_counter() - t0)
            raise
        self.ctx.stats.record("blob", a.status, time.perf_counter() - t0)
        return a

    async def enroll(self, token: str) -> None:
        a = await self.call("enroll", "POST", f"{API_PREFIX}/enroll", body={
            "token": token, "device_id": self.id, "labels": self.labels, "facts": self.facts})
        if a.status != 200:
            raise SimHttpError(f"enrollment of {self.id} refused: {a.status} {a.body[:200]!r}")
        self.credential = orjson.loads(a.body)["credential"]

    # ---- the agent's loop -------------------------------------------------------------------
    async def run_forever(self, first_delay: float) -> None:
        await asyncio.sleep(first_delay)
        telemetry = asyncio.get_running_loop().create_task(self._telemetry_loop()) if self.ctx.telemetry_s > 0 \
            else None
        try:
            while True:
                try:
                    await self.cycle()
                    self.failures = 0
                    delay = self.ctx.poll_s * self.rng.uniform(0.8, 1.2)
                except SimBusyError as e:
                    delay = e.retry_after_s * self.rng.uniform(1.0, 1.5)
                except SimHttpError:
                    self.failures += 1
                    self.ctx.stats.cycle_failures += 1
                    delay = min(300.0, max(1.0, min(self.ctx.poll_s, 5.0)) * 2 ** (self.failures - 1))
                    delay *= self.rng.uniform(0.5, 1.0)
                await asyncio.sleep(delay)
        finally:
            if telemetry is not None:
                telemetry.cancel()

    async def poll(self) -> bool:
        headers = {"If-None-Match": self.etag} if self.etag and self.desired is not None else None
        a = await self.call("poll", "GET", f"{API_PREFIX}/device/desired-state", headers=headers)
        if a.status == 304:
            return False
        if a.status != 200:
            raise SimHttpError(f"desired state: {a.status}")
        self.desired = DesiredState.model_validate_json(a.body)
        self.etag = a.headers.get("etag")
        return True

    async def cycle(self) -> None:
        changed = await self.poll()
        d = self.desired
        for rv in d.revert if d is not None else []:
            await self.revert(rv)
        for dm in d.models if d is not None else []:
            await self.process(dm)
        if changed:
            self.facts_due = True
        if self.facts_due or time.monotonic() - self.facts_at > self.ctx.facts_s:
            a = await self.call("facts", "PUT", f"{API_PREFIX}/device/facts", body={
                "facts": self.facts, "serving": self.serving()})
            if a.status == 200:  # a busy registry (503) hears them at the next poll
                self.facts_at, self.facts_due = time.monotonic(), False

    def serving(self) -> list[dict[str, Any]]:
        out = []
        for name, ms in sorted(self.state.models.items()):
            p = ms.pending
            if p is not None and p.step == "trial":
                out.append({"model": name, "version": p.version, "release": p.release, "state": "active-trial"})
            elif ms.current is not None:
                out.append({"model": name, "version": ms.current.version, "release": ms.current.release,
                            "state": "committed"})
        return out

    async def report(self, model: str, step: str, *, version: int | None, release: int | None,
                     reason: str | None = None, detail: dict[str, Any] | None = None) -> None:
        """Queue a report; a task sends the outbox (as the daemon's sender thread), so a busy registry
        delays reports, never the update itself."""
        self.state.seq += 1
        self.outbox.append({"seq": self.state.seq, "model": model, "step": step, "version": version,
                            "release": release, "reason": reason, "detail": detail or {}, "at": time.time()})
        self.ctx.stats.steps[f"{release}:{step}"] += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self.outbox:
            batch = self.outbox[:REPORT_BATCH]
            try:
                a = await self.call("report", "POST", f"{API_PREFIX}/device/reports", body={"events": batch})
            except SimHttpError:
                a = None
            if a is not None and a.status == 200:
                sent = batch[-1]["seq"]
                self.outbox = [e for e in self.outbox if e["seq"] > sent]
                continue
            await asyncio.sleep(retry_after(a) * self.rng.uniform(1.0, 1.5))

    # ---- one desired model (as Updater.process) ---------------------------------------------
    async def process(self, dm: DesiredModel) -> None:
        ms = self.state.model(dm.model)
        verdict = plan.decide(ms, dm.release, time.time())
        if verdict.abandon:
            ms.pending = None
        if verdict.action == "idle":
            return
        p = ms.pending
        try:
            manifest = check_release(dm.signed, model=dm.model, public_keys=self.ctx.public_keys,
                                     highest=ms.highest_release, device_id=self.id, max_bytes=self.ctx.max_bytes)
        except RefusedError as e:
            ms.pending = None
            await self.refuse(dm.model, ms, dm.release, dm.version, str(e), permanent=e.permanent)
            return
        if p is None:
            ms.highest_release = max(ms.highest_release, manifest.release)
            ms.pending = Pending(release=manifest.release, version=manifest.version, step="download",
                                 signed=dm.signed)
        await self.advance(dm.model, ms, manifest)

    async def refuse(self, model: str, ms: ModelSync, release: int, version: int | None, reason: str, *,
                     permanent: bool) -> None:
        self.download_reported.discard(release)
        if permanent:
            ms.rejected[release] = reason
        else:
            ms.refused[release] = plan.next_refusal(ms.refused.get(release), reason, time.time(),
                                                    poll_interval_s=self.ctx.poll_s, retry_max_s=300.0)
        await self.report(model, "failed", version=version, release=release, reason=reason)

    async def advance(self, model: str, ms: ModelSync, m: ReleaseManifest) -> None:
        p = ms.pending
        assert p is not None
        beh = self.ctx.behaviour(m.version)
        if p.step == "download":
            if m.release not in self.download_reported:  # once, not at every attempt (as the daemon)
                self.download_reported.add(m.release)
                await self.report(model, "downloading", version=m.version, release=m.release,
                                  detail={"bytes": m.total_size, "files": len(m.files)})
                self.ctx.stats.downloads[m.release] += 1
            if self.ctx.download:
                for f in m.files:
                    if (m.release, f.sha256) in self.fetched:  # kept from an earlier attempt (as the daemon's staging)
                        continue
                    a = await self.call("blob", "GET", f"{API_PREFIX}/blobs/{f.sha256}")
                    if a.status in (301, 302, 303, 307, 308):
                        a = await self.follow(a.headers.get("location", ""))
                    if a.status == 503:  # busy: the daemon's cycle ends and comes back after Retry-After
                        raise SimBusyError(retry_after(a))
                    if a.status != 200 or len(a.body) != f.size or hashlib.sha256(a.body).hexdigest() != f.sha256:
                        ms.pending = None
                        await self.refuse(model, ms, m.release, m.version,
                                          f"download refused: {f.path} answered {a.status}", permanent=False)
                        return
                    self.fetched.add((m.release, f.sha256))
            await self.report(model, "verifying", version=m.version, release=m.release,
                              detail={"downloaded_bytes": m.total_size})
            p.step = "prepare"
        if p.step == "prepare":
            await asyncio.sleep(self.ctx.prepare_s)
            if self.rng.random() < beh.prepare_fail:
                await self.rollback(model, ms, "prepare failed: the golden check failed (simulated)")
                return
            p.step = "install"
            await self.report(model, "prepared", version=m.version, release=m.release, detail={"engine": "sim"})
        if p.step in ("install", "activate"):
            p.step = "trial"
            self.ctx.stats.activated[m.release] += 1
            await self.report(model, "active-trial", version=m.version, release=m.release,
                              detail={"engine": "sim", "trial_s": self.ctx.trial_s})
        if p.step == "trial":
            await self.trial(model, ms, m, beh)

    async def trial(self, model: str, ms: ModelSync, m: ReleaseManifest, beh: Behaviour) -> None:
        end = time.monotonic() + self.ctx.trial_s
        next_poll = time.monotonic() + self.ctx.poll_s
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, max(0.0, next_poll - time.monotonic())))
            if time.monotonic() >= next_poll and time.monotonic() < end:
                next_poll += self.ctx.poll_s
                with_revert = await self._revert_reason(model, m.release)
                if with_revert is not None:
                    await self.rollback(model, ms, f"{REVERT_PREFIX}: {with_revert}")
                    return
        bad = self.rng.random() < beh.trial_fail
        new = self._traffic(TRIAL_REQUESTS, 0.2 if bad else beh.error_rate, beh.p99_ms * (5 if bad else 1))
        cur = ms.current
        prev = self.ctx.behaviour(cur.version) if cur is not None else Behaviour()
        base = self._traffic(TRIAL_REQUESTS, prev.error_rate, prev.p99_ms) if cur is not None else None
        reason = judge(new, base, self.ctx.settings, final=True, latency=new)
        if reason is not None:
            await self.rollback(model, ms, f"trial failed: {reason}")
            return
        ms.lkg, ms.current, ms.pending = ms.current, VersionRef(version=m.version, release=m.release), None
        await self.report(model, "committed", version=m.version, release=m.release,
                          detail={"requests": new.total, "errors": new.errors, "p99_ms": new.p99_s * 1000})

    def _traffic(self, n: int, error_rate: float, p99_ms: float) -> Sample:
        errors = sum(1 for _ in range(n) if self.rng.random() < error_rate)
        return Sample(ok=n - errors, errors=errors, latency_counts=tuple(latency_counts(n - errors, p99_ms)))

    async def _revert_reason(self, model: str, release: int) -> str | None:
        try:
            await self.poll()
        except SimHttpError:
            return None
        for rv in self.desired.revert if self.desired is not None else []:
            if rv.model == model and release in rv.releases:
                return rv.reason or "rollout stopped"
        return None

    async def rollback(self, model: str, ms: ModelSync, reason: str) -> None:
        p = ms.pending
        assert p is not None
        ms.rejected[p.release] = reason
        ms.pending = None
        await self.report(model, "rolled-back", version=p.version, release=p.release, reason=reason,
                          detail={"serving": ms.current.version if ms.current else None})

    # ---- instructions from the registry (as Updater.revert) ---------------------------------
    async def revert(self, rv: RevertModel) -> None:
        ms = self.state.model(rv.model)
        action, release = plan.revert_action(ms, rv.releases)
        why = f"{REVERT_PREFIX}: {rv.reason or 'rollout stopped'}"
        if action == "none" or release is None:
            return
        if action == "forget":
            for r in rv.releases:
                ms.rejected.setdefault(r, why)
        elif action in ("abandon", "rollback"):
            await self.rollback(rv.model, ms, why)
        elif action == "to-lkg" and ms.current is not None and ms.lkg is not None:
            cur = ms.current
            ms.rejected[cur.release] = why
            ms.current, ms.lkg = ms.lkg, None
            self.ctx.stats.reverted[cur.release] += 1
            await self.report(rv.model, "rolled-back", version=cur.version, release=cur.release, reason=why,
                              detail={"serving": ms.current.version, "from": "committed"})
        elif action == "no-lkg" and release not in ms.rejected:
            ms.rejected[release] = why
            await self.report(rv.model, "failed", version=None, release=release,
                              reason=f"{why}; but no last-known-good version is kept here")

    # ---- telemetry --------------------------------------------------------------------------
    async def _telemetry_loop(self) -> None:
        period = self.ctx.telemetry_s
        await asyncio.sleep(self.rng.uniform(0, period))
        while True:
            try:
                await self.upload_telemetry(period)
            except SimHttpError:
                pass
            await asyncio.sleep(period * self.rng.uniform(0.9, 1.1))

    async def upload_telemetry(self, window_s: float) -> None:
        windows = []
        for s in self.serving():
            beh = self.ctx.behaviour(s["version"])
            n = int(window_s * 2)  # two requests a second
            errors = sum(1 for _ in range(n) if self.rng.random() < beh.error_rate)
            windows.append({"model": s["model"], "version": s["version"], "backend": "sim", "success": n - errors,
                            "failures": {"internal": errors} if errors else {},
                            "latency": {"counts": latency_counts(n - errors, beh.p99_ms),
                                        "sum_s": (n - errors) * beh.p99_ms / 3000.0}})
        self.telemetry_seq += 1
        sample = {"device": self.id, "seq": self.telemetry_seq, "run": self.run, "t": time.time(),
                  "window_s": window_s, "uptime_s": time.monotonic() - self.ctx.stats.started,
                  "profile": self.facts.get("profile"), "models": windows}
        await self.call("telemetry", "POST", INGEST_PATH, body={"buffer_id": self.run, "items": [sample]})

    # ---- seen from outside ------------------------------------------------------------------
    def where(self, model: str) -> tuple[int | None, str | None]:
        """(committed release, step of the update in progress) for the status file."""
        ms = self.state.models.get(model)
        if ms is None:
            return None, None
        return (ms.current.release if ms.current else None), (ms.pending.step if ms.pending else None)

    def adopt(self, model: str, version: int, release: int) -> None:
        """Start as a device that synced this release earlier (what a fleet runs before a rollout)."""
        ms = self.state.model(model)
        ms.current = VersionRef(version=version, release=release)
        ms.highest_release = max(ms.highest_release, release)
