"""The sync agent: the daemon's link to the registry, started and stopped like a transport.

It polls the registry for the device's desired state (with ETag, every
``poll_interval_s`` with +-20% jitter, sooner after an MQTT nudge), and hands each model
to the :class:`~edged.sync.updater.Updater`. All blocking work (HTTP, hashing, loading
models, judging trials) runs in a worker thread, one cycle at a time, never on the event loop.
Between two polls the loop wakes for the models on trial when they are due a look, so a
trial never holds the worker for its whole length and other models update meanwhile.
Offline, it keeps serving what it has and retries with exponential back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from edged import logring
from edged.backoff import Backoff
from edged.config import Config
from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.hardware.facts import HardwareFacts
from edged.protocol.fleet.messages import DesiredState
from edged.sync.boot import prepare_boot
from edged.sync.capped_http import RegistryHttp, StoppedError, SyncHttpError, TransferError
from edged.sync.desired import DesiredStateError
from edged.sync.engine_port import ServiceEngine
from edged.sync.localfault import LocalFaultError
from edged.sync.registry_client import DeviceClient
from edged.sync.settings import SyncSettings
from edged.sync.state import RISKY_STEPS, StateStore
from edged.sync.update import report
from edged.sync.updater import Updater

log = logging.getLogger(__name__)
STOP_WAIT_S = 30.0
# A nudge brings the next poll forward, but never closer than this to the last poll, nor before a back-off
# or the registry's Retry-After ends: anyone who may publish on the nudge topic can send nudges, and a
# fleet answering each at once would poll its registry back to back.
NUDGE_SPACING_S = 5.0


def device_facts(facts: HardwareFacts, profile: str, serving_backends: Iterable[str] = ()) -> dict[str, Any]:
    """The device profile and the hardware facts rollouts may target (scalars only, dotted keys).

    The daemon passes in what it probed and chose at start: sync never probes or picks a profile itself.
    The daemon does not try the engine libraries at start (``engines.probed`` false): their unprobed
    defaults (``available: false``) are not sent as facts, and an engine the daemon serves a model on
    is reported available (``serving_backends``), so a rollout targeted on it matches the devices using it.
    """
    flat = {k: v for k, v in facts.flat().items() if isinstance(v, (str, int, float, bool)) and k != "root"}
    if not facts.engines.probed:
        flat = {k: v for k, v in flat.items() if not k.startswith("engines.") or k == "engines.probed"}
        flat.update({f"engines.{b}.available": True for b in sorted(set(serving_backends)) if b})
    return {"profile": profile, **flat}


class SyncAgent:
    name = "sync"

    def __init__(self, cfg: Config, service: InferenceService, *, settings: SyncSettings | None = None,
                 facts: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.service = service
        self.facts = dict(facts or {})
        self.settings = settings or SyncSettings.from_config(cfg)
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._nudge: Any = None
        self._store = StateStore(self.settings.sync_dir)
        self.updater: Updater | None = None
        self.client: DeviceClient | None = None
        self.cycles = 0
        self._facts_at = 0.0
        self._facts_due = True  # changed since the registry last took them (it may answer 503 when busy)
        self._retry: Backoff | None = None
        self._not_before = 0.0  # monotonic: no nudge brings a poll before this (spacing, back-off)

    async def start(self) -> None:
        s = self.settings
        await asyncio.to_thread(prepare_boot, self.cfg, s)  # no-op when the daemon already ran it before loading
        state = await asyncio.to_thread(self._store.load)
        http = RegistryHttp(s.url, timeout=s.request_timeout_s, ca_file=s.ca_file, client_cert=s.client_cert,
                            client_key=s.client_key)
        self.client = DeviceClient(s, http, self._store, state, extra_facts=self.facts)
        self.client.log_tail = logring.install().tail  # a failed update's report carries the last log lines
        self.client.start()
        self.updater = Updater(s, ServiceEngine(self.service), store=self._store, state=state, client=self.client,
                               http=http, stop=self._stop)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="edged-sync")
        if s.mqtt_nudge and self.cfg.mqtt.enabled:
            from edged.sync.nudge import NudgeListener

            loop = asyncio.get_running_loop()

            def nudged() -> None:
                loop.call_soon_threadsafe(self.nudge)

            self._nudge = NudgeListener(self.cfg, nudged)
            self._nudge.start()
        log.info("sync agent started: registry %s, device %s, poll every %gs", s.url, s.device_id,
                 s.poll_interval_s)

    def nudge(self) -> None:
        """Poll soon (called on the event loop)."""
        if self._wake is not None:
            self._wake.set()

    async def stop(self) -> None:
        self._stop.set()
        if self._wake is not None:
            self._wake.set()
        await asyncio.to_thread(self._mark_clean_stop)
        if self._nudge is not None:
            await asyncio.to_thread(self._nudge.stop)
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("sync worker still busy after %.0fs; leaving it", STOP_WAIT_S)
            except asyncio.CancelledError:
                pass
        if self.client is not None:
            await asyncio.to_thread(self.client.stop)
            self.client.http.close()

    def _mark_clean_stop(self) -> None:
        """An orderly stop during a trial is not a crash: the next start must not count it."""
        with self._store.lock:
            if self.updater is None:
                return
            changed = False
            for ms in self.updater.state.models.values():
                if ms.pending is not None and ms.pending.step in RISKY_STEPS:
                    ms.pending.clean_stop = True
                    changed = True
            if changed:
                self._store.save(self.updater.state)

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self.updater is not None and self._wake is not None
        try:
            await asyncio.to_thread(self.updater.recover)
        except Exception:
            log.exception("sync recovery failed; continuing with polling")
        # A fleet that powers up together should not poll in lockstep.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), random.uniform(0, min(self.settings.poll_interval_s, 5.0)))
        next_poll = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_poll:
                delay = await self._round()
                if delay is None:
                    break
                next_poll = time.monotonic() + delay
                self.cycles += 1
            else:
                await asyncio.to_thread(self._trials)
            if self._stop.is_set():
                break
            # Sleep until the next poll, or until a model on trial is due a look (trials never hold the loop).
            wait = next_poll - time.monotonic()
            trial_in = self.updater.next_tick_in()
            if trial_in is not None:
                wait = min(wait, trial_in)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wait))
            if self._wake.is_set() and not self._stop.is_set():
                self._wake.clear()
                jitter = random.uniform(0, min(1.0, self.settings.poll_interval_s))
                next_poll = min(next_poll, max(time.monotonic() + jitter, self._not_before))

    async def _round(self) -> float | None:
        """One poll round; the seconds until the next one (None: stopping)."""
        retry = self.retry
        try:
            await asyncio.to_thread(self._cycle)
            retry.reset()
            self._not_before = time.monotonic() + NUDGE_SPACING_S
            return self.settings.poll_interval_s * random.uniform(0.8, 1.2)
        except StoppedError:
            return None
        except (SyncHttpError, TransferError) as e:
            busy = e.retry_after_s if isinstance(e, SyncHttpError) else None
            if busy is not None:  # not a failure: the registry is shedding load and said when to return
                delay = busy * random.uniform(1.0, 1.5)
                log.info("registry busy (%s); retry in %.1fs", e, delay)
            elif isinstance(e, DesiredStateError):
                delay = retry.next_delay()
                log.error("%s; keeping the current versions, retry in %.1fs", e, delay)
            else:
                delay = retry.next_delay()
                log.warning("registry not reachable (%s); keeping the current versions, retry in %.1fs", e, delay)
        except LocalFaultError as e:  # reported to the registry and kept in the state: one line, no traceback
            delay = retry.next_delay()
            log.error("update blocked by a local fault: %s; retry in %.1fs", e, delay)
        except EdgedError as e:
            delay = retry.next_delay()
            log.error("sync cycle failed: %s; retry in %.1fs", e, delay)
        except Exception:
            delay = retry.next_delay()
            log.exception("sync cycle failed; retry in %.1fs", delay)
        self._not_before = time.monotonic() + max(delay, NUDGE_SPACING_S)
        return delay

    def _trials(self) -> None:
        """Between two polls: look at the models on trial; one that ended changes what the registry is told."""
        assert self.client is not None and self.updater is not None
        if not self.updater.tick():
            return
        self._facts_due = True
        try:
            if self.client.facts.send(self.updater.serving()):
                self._facts_at, self._facts_due = time.monotonic(), False
        except EdgedError as e:  # the registry is unreachable or refuses: the next poll round sends them
            log.debug("facts not sent after a trial (%s); sent at the next poll", e)

    @property
    def retry(self) -> Backoff:
        """The documented back-off (edged/backoff.py): from min(poll, 5 s), at least 1 s, doubling to retry_max_s."""
        if self._retry is None:
            self._retry = Backoff(max(1.0, min(self.settings.poll_interval_s, 5.0)), self.settings.retry_max_s)
        return self._retry

    def _cycle(self) -> None:
        assert self.client is not None and self.updater is not None
        c, u = self.client, self.updater
        c.auth.credential()
        c.outbox.flush()
        changed = c.desired.poll() is not None
        try:
            faults = self._apply(c.desired.last)
        finally:
            u.flush()  # the refusals and reverts of this poll, in one write (StateStore.save_later)
        if u.tick() or changed:
            self._facts_due = True
        due = self._facts_due or time.monotonic() - self._facts_at > self.settings.facts_interval_s
        if due and c.facts.send(u.serving()):
            self._facts_at, self._facts_due = time.monotonic(), False
        c.outbox.flush()
        if faults:
            raise LocalFaultError("; ".join(str(e) for e in faults))

    def _apply(self, desired: DesiredState | None) -> list[LocalFaultError]:
        """Act on the desired state: the reverts, then each model's release; the local faults met."""
        assert self.client is not None and self.updater is not None
        c, u = self.client, self.updater
        for rv in (desired.revert if desired is not None else []):
            try:
                u.revert(rv.model, rv.releases, rv.reason)
            except (SyncHttpError, StoppedError):
                raise
            except Exception:
                log.exception("model=%s returning to the last-known-good failed", rv.model)
        faults: list[LocalFaultError] = []
        for dm in (desired.models if desired is not None else []):
            if self._stop.is_set():
                raise StoppedError("stopping")
            try:
                u.process(dm)
            except (SyncHttpError, StoppedError):
                raise
            except LocalFaultError as e:  # the other models still get their turn
                faults.append(e)
            except Exception as e:
                log.exception("model=%s update failed", dm.model)
                with contextlib.suppress(Exception):
                    report.failure(c, dm.model, "failed", version=dm.version, release=dm.release,
                                   reason=f"internal error: {type(e).__name__}")
        return faults
