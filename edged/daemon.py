"""The daemon's start and stop order, and what it tells systemd along the way.

probe hardware -> match a device profile -> load the model repository -> self-test every
ready version -> start transports -> start services (fleet sync, telemetry) -> READY=1 -> serve
(WATCHDOG=1 while an end-to-end probe passes; SIGHUP reloads the config) -> SIGTERM: STOPPING=1
-> finish in-flight requests (bounded) -> stop services -> stop transports -> release engines -> exit 0.
A SIGTERM while models load (at start or on SIGHUP) does not wait for the load: see ``Daemon._unless_stopped``.

The daemon wires everything: it hands the probed facts, the profile, the config and one
``/metrics`` renderer to what it starts; nothing it starts reaches back up into it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from edged.config import Config, load_config
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState, ModelVersion
from edged.core.service import InferenceService
from edged.errors import ConfigError, EdgedError
from edged.fsutil import ensure_private_dir
from edged.hardware.facts import HardwareFacts
from edged.hardware.probe import probe
from edged.heap import HeapKeeper
from edged.logs import log_fields, set_level
from edged.membudget import MIB, MemoryBudget, default_memory_mb, tune_allocator
from edged.owner import StateOwner, claim_state_dir
from edged.profiles import DeviceProfile, ProfileMatch, load_profiles, match_profile, resolve_profile
from edged.repository.store import list_versions
from edged.systemd.health import Prober, self_test
from edged.systemd.notify import Notifier, watchdog_interval
from edged.threadplan import WorkerPool, engine_processes, install_worker_pool, plan_threads
from edged.transports.base import Transport

if TYPE_CHECKING:
    from edged.sync.settings import SyncSettings
    from edged.telemetry.prometheus import MetricsRenderer

log = logging.getLogger(__name__)

STOP_DRAIN_S = 20.0  # in-flight requests get this long after SIGTERM; the unit's TimeoutStopSec is 30
ABANDONED_GRACE_S = 1.0  # after the orderly stop, how long an abandoned load may take to give up by itself
LOAD_LOCK_WAIT_S = 2.0  # on stop, how long releasing the engines waits for a load (an API's or sync's) to end
SELF_TEST_TIMEOUT_S = 60.0
STATUS_INTERVAL_S = 10.0
# Config sections that only take effect at start; SIGHUP applies [models] and [logging] live.
RESTART_SECTIONS = ("device", "http", "grpc", "mqtt", "shm", "registry", "telemetry", "limits")


@dataclass
class Runtime:
    config: Config
    facts: HardwareFacts
    match: ProfileMatch
    manager: ModelManager
    service: InferenceService

    @property
    def profile(self) -> DeviceProfile:
        return self.match.profile


def choose_profile(cfg: Config, facts: HardwareFacts) -> ProfileMatch:
    dirs = [cfg.device.profiles_dir] if cfg.device.profiles_dir else []
    profiles = load_profiles(dirs)
    if cfg.device.profile:
        for p in profiles:
            if p.name == cfg.device.profile:
                return resolve_profile(p, facts, [f"forced by [device] profile = {p.name!r}"])
        raise ConfigError(f"device.profile: no profile named {cfg.device.profile!r} "
                          f"(known: {', '.join(p.name for p in profiles)})")
    return match_profile(facts, profiles)


def _serving_backends(rt: Runtime) -> list[str]:
    """The engines that serve a model now: known to work here, probed or not."""
    return sorted({mv.candidate.backend for mv in _ready(rt.service.versions()) if mv.candidate is not None})


def build_runtime(cfg: Config, *, load: bool = True, only: str | None = None, defer_choice: bool = False,
                  stop: Callable[[], bool] | None = None) -> Runtime:
    """Probe, pick the profile, and (unless ``load`` is False) load the repository or one model.

    ``defer_choice``: serve on the remembered or first engine and measure after READY (the daemon);
    otherwise engines are measured while loading (``edged models list`` without a daemon, tools).
    ``stop`` true: loads give up at their next step, now and for the manager's life (the daemon's SIGTERM).
    """
    facts = probe(Path("/"), engines=False)
    match = choose_profile(cfg, facts)
    profile = match.profile
    log.info("device profile %s: %s", profile.name, "; ".join(match.reasons))
    cache_dir = cfg.cache_dir
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
    from edged.repository.seed import serving_repository

    repo = serving_repository(cfg.device.model_repository, cfg.device.model_seed)
    _share_engine_pool(cfg, profile)
    manager = ModelManager(repo, cfg.models, profile.backends, cache_dir=cache_dir,
                           threads=cfg.limits.engine_threads or profile.threads,
                           memory_budget_mb=profile.effective_memory_budget_mb(facts),
                           select=profile.select, facts=facts, defer_choice=defer_choice,
                           processes=engine_processes(cfg.limits), stop=stop, spin_us=cfg.limits.engine_spin_us)
    if load:
        if only is not None:
            manager.load_model(only)
        else:
            manager.load_all()
    return Runtime(cfg, facts, match, manager, InferenceService(manager, request_budget(cfg, profile, facts)))


def _share_engine_pool(cfg: Config, profile: DeviceProfile) -> None:
    """[limits] engine_pool, before the manager makes any session: ONNX Runtime fixes it per process."""
    from edged.backends.onnxruntime import share_one_pool, shared_pool_threads

    if cfg.limits.engine_pool == "shared":  # the size any engine's own pool would have had
        share_one_pool(plan_threads(cfg.limits, profile.threads).engine)
    elif shared_pool_threads() is not None:
        log.warning("[limits] engine_pool = \"per_model\" applies after a restart: this process's ONNX Runtime "
                    "sessions already share one pool")


def request_budget(cfg: Config, profile: DeviceProfile, facts: HardwareFacts) -> MemoryBudget:
    """The one memory budget of every request in progress: ``[limits] memory_mb``, else a share of the profile's."""
    mb = cfg.limits.memory_mb or default_memory_mb(profile.effective_memory_budget_mb(facts))
    log.info("requests may hold %.0f MB together (%s)", mb,
             "[limits] memory_mb" if cfg.limits.memory_mb else f"a share of profile {profile.name}'s memory budget")
    return MemoryBudget(int(mb * MIB))


def _ready(mvs: list[ModelVersion]) -> list[ModelVersion]:
    return [mv for mv in mvs if mv.state is ModelState.READY]


class Service(Protocol):
    """What the daemon runs beside the transports (fleet sync, telemetry): started after them, stopped first."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: no more watchdog pings, systemd will restart edged", task.get_name(),
                  exc_info=task.exception())


T = TypeVar("T")


def _in_flight(rt: Runtime) -> int:
    """Requests queued or running (stats count both, the inline fast path included)."""
    return sum(mv.stats.in_flight for mv in rt.service.versions() if mv.stats is not None)


class Daemon:
    def __init__(self, cfg: Config, *, notifier: Notifier | None = None,
                 sync_settings: SyncSettings | None = None) -> None:
        """``sync_settings`` override what the sync agent reads from ``[registry]`` (``edged run --set``)."""
        self.cfg = cfg
        self.sync_settings = sync_settings
        self.runtime: Runtime | None = None
        self.transports: list[Transport] = []
        self.services: list[Service] = []
        self.notifier = notifier or Notifier()
        self._stop = asyncio.Event()
        # The same request for the blocking start-up and reload work on worker threads (the self-test).
        self._stop_token: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._wake = asyncio.Event()
        self._reload_requested = False
        self._tasks: list[asyncio.Task[None]] = []
        self.owner: StateOwner | None = None
        self.heap: HeapKeeper | None = None
        # Loads SIGTERM left inside an engine call: never joined (see _unless_stopped, exit_past_abandoned).
        self.abandoned: list[threading.Thread] = []
        # The loop's worker pool, where loads asked for over the repository API or by fleet sync run.
        self.pool: WorkerPool | None = None

    # ---- signals ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()
        if not self._stop_token.done():
            self._stop_token.set_result(None)
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    def _make_transports(self, rt: Runtime, metrics: MetricsRenderer) -> list[Transport]:
        # Transports are imported only when enabled: their libraries cost start-up time and memory.
        cfg = self.cfg
        out: list[Transport] = []
        from edged.descriptors import plan_for_daemon
        budget = plan_for_daemon(cfg)  # TCP listeners capped so shm, health and files keep a reserve
        if cfg.shm.enabled:
            from edged.transports.shm.transport import ShmTransport
            out.append(ShmTransport(cfg, rt.service))
        grpc = cfg.grpc is not None and cfg.grpc.enabled
        regions = None
        if cfg.http.enabled or grpc:
            # One set of Triton system shared memory regions for both v2 listeners, as in Triton.
            from edged.transports.http.transport import system_shm_regions
            regions = system_shm_regions(cfg)
        if cfg.http.enabled:
            from edged.transports.http.transport import HttpTransport
            out.append(HttpTransport(cfg, rt.service, shm=regions, metrics=metrics,
                                     max_connections=budget.http_connections, backlog=budget.http_backlog))
        if grpc:
            from edged.transports.grpc.server import GrpcTransport
            out.append(GrpcTransport(cfg, rt.service, shm=regions, max_connections=budget.grpc_connections))
        if cfg.mqtt.enabled:
            from edged.transports.mqtt.transport import MqttTransport
            out.append(MqttTransport(cfg, rt.service, rt.profile.name, metrics=metrics))
        return out

    def _make_services(self, rt: Runtime, metrics: MetricsRenderer) -> list[Service]:
        """Fleet sync (with [registry]) and telemetry, given what they need; made once the transports run."""
        out: list[Service] = []
        if self.cfg.registry.enabled:
            from edged.sync.agent import SyncAgent, device_facts
            out.append(SyncAgent(self.cfg, rt.service, settings=self.sync_settings,
                                 facts=device_facts(rt.facts, rt.profile.name, _serving_backends(rt))))
        # Always: with [telemetry] enabled = false the agent still keeps the status file `edged status` reads.
        out.append(self._telemetry_agent(rt, metrics))
        return out

    # ---- lifecycle ----------------------------------------------------------------------------
    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        try:
            if await self._start():
                await self._serve_until_stopped()
            await self._shutdown(drain=True)
        except BaseException as e:
            self.notifier.status(f"failed: {e}" if isinstance(e, EdgedError) else f"failed: {type(e).__name__}")
            await self._shutdown(drain=False)
            raise
        finally:
            if self.heap is not None:
                self.heap.stop()
                self.heap = None
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self.notifier.close()
            if self.owner is not None:
                self.owner.close()
                self.owner = None
            if self.pool is not None:  # the loop's closing shutdown of it must not wait out an engine call
                self.pool.stop_waiting_after(ABANDONED_GRACE_S)
        return 0

    async def _start(self) -> bool:
        """Everything before READY=1; False when a stop was asked for on the way."""
        t0 = time.monotonic()
        n = self.notifier
        self.pool = install_worker_pool(asyncio.get_running_loop(), self.cfg.limits)
        # Before anything reads or writes device state (crash-loop counter, pins, status file): a
        # refused second daemon must leave the first one's state exactly as it was.
        self.owner = await asyncio.to_thread(claim_state_dir, self.cfg.device.state_dir)
        tune_allocator()  # before any request: large request buffers go back to the system when freed
        log.info("edged starting: repository %s, state %s", self.cfg.device.model_repository, self.cfg.device.state_dir)
        if n.enabled:
            wd = watchdog_interval()
            log.info("service manager notifications via %s; watchdog %s", n.backend,
                     f"{wd:g}s (pinged every {wd / 2:g}s while every model answers a probe)" if wd else "off")
        # Sockets and the status file go there: refuse a folder someone else could swap things in.
        await asyncio.to_thread(ensure_private_dir, self.cfg.device.runtime_dir, "[device] runtime_dir")
        n.status("probing hardware and loading models")
        try:
            from edged.repository.seed import seed_repository
            await asyncio.to_thread(seed_repository, self.cfg.device.model_repository, self.cfg.device.model_seed)
        except OSError as e:  # serve what there is (maybe nothing) and say why; never crash-loop over it
            log.error("model repository %s could not be created from %s: %s", self.cfg.device.model_repository,
                      self.cfg.device.model_seed, e)
        if self.cfg.registry.enabled:
            # Crash-loop check and version pins must come before any model loads: a version that
            # crashes while loading would otherwise be loaded again on every start.
            from edged.sync.boot import prepare_boot
            await asyncio.to_thread(prepare_boot, self.cfg, self.sync_settings)
        stop = self._stop_token.done
        loaded = await self._unless_stopped("the model load", lambda: build_runtime(self.cfg, defer_choice=True,
                                                                                    stop=stop),
                                            release=lambda late: late.manager.shutdown(0.0))
        if loaded is None or self._stop.is_set():
            self.runtime = loaded
            return False
        self.runtime = rt = loaded
        from edged.backends.onnxruntime import shared_pool_threads
        log.info("%s", plan_threads(self.cfg.limits, rt.profile.threads, shared_pool_threads()).describe())
        ready = _ready(rt.service.versions())
        n.status(f"self-test of {len(ready)} model version(s) on profile {rt.profile.name}")
        failed = await asyncio.to_thread(self_test, rt.service, ready, SELF_TEST_TIMEOUT_S, self._stop_token)
        if self._stop.is_set():
            return False
        from edged.telemetry.prometheus import MetricsRenderer

        metrics = MetricsRenderer(rt.service)  # /metrics: served by HTTP, fed by telemetry and MQTT
        n.status("starting transports")
        for t in self._make_transports(rt, metrics):
            await t.start()
            self.transports.append(t)
        for s in self._make_services(rt, metrics):
            await s.start()
            self.services.append(s)
        # Start-up's objects are done changing: frozen, so that no full garbage collection walks them again.
        self.heap = HeapKeeper()
        frozen = self.heap.start()
        log.info("heap: %d start-up objects frozen; a full garbage collection took %.0f ms, now %.1f ms",
                 frozen.objects, frozen.full_ms, frozen.after_ms)
        all_mvs = rt.service.versions()
        log.info("edged ready in %.2fs: %d model version(s) serving, %d unavailable (%d failed the self-test), "
                 "profile %s", time.monotonic() - t0, len(_ready(all_mvs)), len(all_mvs) - len(_ready(all_mvs)),
                 len(failed), rt.profile.name)
        if self._stop.is_set():  # SIGTERM while the transports and services started: never READY=1
            return False
        n.ready(self.status_text())
        # Serve first, choose after: engines are measured (and re-measured as traffic changes) from now on.
        rt.manager.chooser.start()
        return True

    def _telemetry_agent(self, rt: Runtime, metrics: MetricsRenderer) -> Service:
        """Metrics sampling, the MQTT telemetry message, upload, and the status file `edged status` reads."""
        from edged.telemetry.agent import TelemetryAgent

        mqtt = next((t for t in self.transports if t.name == "mqtt"), None)
        publish: Callable[[str, bytes], bool] | None = None
        if mqtt is not None:
            def publish(topic: str, payload: bytes, _m: Any = mqtt) -> bool:
                return bool(_m.publish(topic, payload, qos=0))
        return TelemetryAgent(self.cfg, rt.service, publish=publish, profile=rt.profile.name,
                              mqtt_stats=getattr(mqtt, "stats", None), metrics=metrics)

    async def _unless_stopped(self, what: str, work: Callable[[], T],
                              release: Callable[[T], object] | None = None) -> T | None:
        """``work`` (loading models) on a thread of its own, awaited until it ends or SIGTERM comes: None then.

        A load can take minutes (an engine build, a big model's session, its warm-up) and systemd kills
        edged TimeoutStopSec after SIGTERM, so the stop does not wait for it. The loader gives up between
        engine calls (the stop token), but an engine's own native call cannot be interrupted: its thread is
        a daemon thread nobody joins, ``release`` frees what it still returns, and :meth:`exit_past_abandoned`
        ends the process without waiting for it.
        """
        if self._stop.is_set():
            return None
        loop = asyncio.get_running_loop()
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        finished = asyncio.Event()

        def run() -> None:
            try:
                outcome.set_result(work())
            except BaseException as e:  # handed to the awaiting coroutine, or logged when abandoned
                outcome.set_exception(e)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon stopped without this
                loop.call_soon_threadsafe(finished.set)

        thread = threading.Thread(target=run, name="edged-load", daemon=True)
        thread.start()
        waits = [asyncio.create_task(finished.wait()), asyncio.create_task(self._stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if outcome.done():
            return outcome.result()
        log.info("edged stopping: %s in progress is abandoned (an engine call cannot be interrupted)", what)
        self.abandoned.append(thread)
        outcome.add_done_callback(lambda f: _release_late(what, f, release))
        return None

    def exit_past_abandoned(self, code: int) -> None:
        """After the orderly stop: with a load still inside an engine call, exit now with ``code``.

        The load is one SIGTERM abandoned at start or reload, or one asked for over the repository API or
        by fleet sync, which runs in the loop's worker pool. A normal interpreter exit would join that
        load's pool threads (concurrent.futures) and run the engine library's static destructors under its
        running call; ``os._exit`` does neither.
        """
        end = time.monotonic() + ABANDONED_GRACE_S  # a load between engine calls gives up at once
        for t in self.abandoned:
            t.join(max(0.0, end - time.monotonic()))
        if not any(t.is_alive() for t in self.abandoned) and not (self.pool is not None and self.pool.busy()):
            return
        log.info("edged exits without waiting for the abandoned model load")
        logging.shutdown()
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    async def _serve_until_stopped(self) -> None:
        if self.notifier.enabled:
            task = asyncio.create_task(self._heartbeat(), name="edged-heartbeat")
            task.add_done_callback(_log_crash)
            self._tasks.append(task)
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._reload_requested and not self._stop.is_set():
                self._reload_requested = False
                await self._reload()

    async def _shutdown(self, *, drain: bool) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        rt = self.runtime
        if drain:
            in_flight = self.in_flight()
            log.info("edged stopping: finishing %d in-flight request(s) (at most %.0fs)", in_flight, STOP_DRAIN_S)
            self.notifier.stopping(f"stopping: finishing {in_flight} in-flight request(s)")
        drained = True
        if rt is not None:
            # Queues first, while the transports still run, so answers to in-flight requests still go out;
            # new requests are refused (UNAVAILABLE) from here on.
            drained = await asyncio.to_thread(self._drain_all, rt, STOP_DRAIN_S if drain else 0.0)
            if drain and not drained:
                log.warning("some requests did not finish within %.0fs; they were failed", STOP_DRAIN_S)
        for s in reversed(self.services):  # before the transports: telemetry's last message still goes out
            try:
                await s.stop()
            except Exception:
                log.exception("%s did not stop cleanly", s.name)
        self.services.clear()
        for t in reversed(self.transports):
            try:
                await t.stop()
            except Exception:
                log.exception("transport %s did not stop cleanly", t.name)
        self.transports.clear()
        if rt is not None and drained:
            # A load this daemon abandoned holds the manager's lock inside an engine call: no use waiting.
            wait = 0.0 if any(t.is_alive() for t in self.abandoned) else LOAD_LOCK_WAIT_S
            self.abandoned += await asyncio.to_thread(rt.manager.shutdown, 0.0, lock_wait_s=wait)
        self.runtime = None
        if drain:
            log.info("edged stopped")

    @staticmethod
    def _drain_all(rt: Runtime, budget_s: float) -> bool:
        end = time.monotonic() + budget_s
        ok = True
        for mv in rt.service.versions():
            if mv.scheduler is not None:
                ok = mv.scheduler.drain(max(0.0, end - time.monotonic())) and ok
        # Requests a transport runs inline on its own thread are not in any queue: wait for those too.
        while _in_flight(rt) and time.monotonic() < end:
            time.sleep(0.01)
        return ok and not _in_flight(rt)

    # ---- status and watchdog ------------------------------------------------------------------
    def in_flight(self) -> int:
        rt = self.runtime
        if rt is None:
            return 0
        return _in_flight(rt)

    def status_text(self) -> str:
        rt = self.runtime
        if rt is None:
            return "starting"
        mvs = rt.service.versions()
        ready = _ready(mvs)
        text = f"serving {len(ready)} model version(s)"
        if len(mvs) > len(ready):
            text += f" ({len(mvs) - len(ready)} unavailable)"
        names = ", ".join(t.name for t in self.transports)
        services = ", ".join(s.name for s in self.services)
        return f"{text} on profile {rt.profile.name}; transports: {names or 'none'}; services: {services or 'none'}"

    async def _heartbeat(self) -> None:
        """WATCHDOG=1 every half interval while the end-to-end probe passes; STATUS= when it changes.

        Runs on the event loop: if the loop hangs, the pings stop without any help.
        """
        assert self.runtime is not None
        interval = watchdog_interval()
        period = interval / 2 if interval else STATUS_INTERVAL_S
        prober = Prober(self.runtime.service)
        last_status, healthy = self.status_text(), True
        while True:
            t0 = time.monotonic()
            if interval:
                result = await prober.probe(timeout=period * 0.8)
                if result.ok:
                    self.notifier.watchdog()
                    if not healthy:
                        log.info("watchdog: every model answers its probe again; pinging resumed")
                else:
                    problems = "; ".join(f"{m} v{v}: {why}" for (m, v), why in sorted(result.problems.items()))
                    if healthy:
                        log.error("watchdog: not pinging systemd (it restarts edged after %.0fs without a ping): %s",
                                  interval, problems)
                    self.notifier.status(f"unhealthy: {problems}")
                    last_status = ""
                healthy = result.ok
            text = self.status_text()
            if healthy and text != last_status:
                self.notifier.status(text)
                last_status = text
            await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))

    # ---- reload -------------------------------------------------------------------------------
    async def _reload(self) -> None:
        """SIGHUP: re-read the config, apply [logging] and [models] live, say what needs a restart."""
        n = self.notifier
        source = self.cfg.source
        n.reloading(f"reloading {source}" if source else "reloading")
        try:
            if source is None:
                log.warning("SIGHUP: edged runs on built-in defaults (no config file); nothing to reload")
                return
            log.info("SIGHUP: reloading %s", source)
            try:
                new = await asyncio.to_thread(load_config, source)
            except ConfigError as e:
                log.error("reload refused, the running configuration stays: %s", "; ".join(e.problems))
                return
            if new.registry.enabled:
                # Keep the versions sync has pinned; the file's policy could revive a rolled-back one.
                from edged.sync.boot import repin
                await asyncio.to_thread(repin, new)
            old = self.cfg
            for section in RESTART_SECTIONS:
                was, now = getattr(old, section), getattr(new, section)  # [grpc] may be absent: None
                if (was and was.model_dump()) != (now and now.model_dump()):
                    log.warning("config [%s] changed: that needs a restart (systemctl restart edged)", section)
            if new.logging != old.logging:
                set_level(new.logging.level)
                log.info("logging level is now %s", new.logging.level)
            self.cfg = old.model_copy(update={"models": new.models, "logging": new.logging})
            rt = self.runtime
            if rt is not None:
                rt.config = self.cfg
                await self._unless_stopped("the reload's model load",
                                           lambda: self._reload_models(rt, new, self._stop_token))
        finally:
            if not self._stop.is_set():  # after SIGTERM: STOPPING=1 comes next, never READY=1
                n.ready(self.status_text())

    @staticmethod
    def _reload_models(rt: Runtime, new: Config, stop: concurrent.futures.Future[None] | None = None) -> None:
        """Load what the new [models] section and the repository select; unload what they no longer do.

        ``stop`` done (SIGTERM): nothing more is loaded or self-tested, so that the stop is not held up
        (a load under way gives up at its next step: the manager's loader shares the token)."""
        manager = rt.manager
        manager.models_cfg = new.models
        repo = manager.repository
        on_disk = sorted(p.name for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if repo.is_dir() else []
        wanted_names = [m for m in on_disk if m not in new.models.disabled]
        for name in manager.table.names():
            if name not in wanted_names:
                log.info("model %s: unloading, disabled or gone from the repository", name, extra=log_fields(name))
                manager.unload_model(name)
        for name in wanted_names:
            if stop is not None and stop.done():
                log.info("reload cut short: edged is stopping")
                return
            wanted = new.models.policy_for(name).select(list_versions(repo / name))
            current = sorted(mv.version for mv in manager.table.versions(name))
            if wanted == current and all(mv.state is ModelState.READY for mv in manager.table.versions(name)):
                continue
            log.info("model %s: loading version(s) %s (was %s)", name, ",".join(map(str, wanted)) or "-",
                     ",".join(map(str, current)) or "-", extra=log_fields(name))
            try:
                loaded = manager.load_model(name)
            except EdgedError as e:
                log.error("model %s: reload failed: %s", name, e, extra=log_fields(name))
                continue
            self_test(rt.service, _ready(loaded), SELF_TEST_TIMEOUT_S, stop)


def run(cfg: Config, sync_overrides: dict[str, str] | None = None) -> int:
    """The daemon until SIGTERM; ``sync_overrides`` are ``edged run --set`` sync settings (the fault tests')."""
    settings = None
    if sync_overrides and cfg.registry.enabled:
        from edged.sync.settings import SyncSettings

        settings = SyncSettings.from_config(cfg, sync_overrides)  # the daemon runs the boot checks with them
    daemon = Daemon(cfg, sync_settings=settings)
    code = asyncio.run(daemon.serve())
    daemon.exit_past_abandoned(code)
    return code


def _release_late(what: str, outcome: concurrent.futures.Future[T], release: Callable[[T], object] | None) -> None:
    """What an abandoned load returned once its engine call ended: released, or its error logged."""
    try:
        result = outcome.result()
        if release is not None:
            release(result)
    except Exception:
        log.debug("%s, abandoned at SIGTERM, ended with an error", what, exc_info=True)
