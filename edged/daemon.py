"""The daemon's start and stop order.

probe hardware -> match a device profile -> load the model repository -> start
transports -> serve until SIGINT/SIGTERM -> stop transports -> drain models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from edged.config import Config
from edged.core.manager import ModelManager
from edged.core.models import ModelState
from edged.core.service import InferenceService
from edged.errors import ConfigError
from edged.hardware.facts import HardwareFacts
from edged.hardware.probe import probe
from edged.profiles import DeviceProfile, ProfileMatch, load_profiles, match_profile
from edged.transports.base import Transport

log = logging.getLogger(__name__)


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
                return ProfileMatch(profile=p, reasons=[f"forced by [device] profile = {p.name!r}"], rejected=[])
        raise ConfigError(f"device.profile: no profile named {cfg.device.profile!r} "
                          f"(known: {', '.join(p.name for p in profiles)})")
    return match_profile(facts, profiles)


def build_runtime(cfg: Config, *, load: bool = True, only: str | None = None) -> Runtime:
    """Probe, pick the profile, and (unless ``load`` is False) load the repository or one model."""
    facts = probe(Path("/"), engines=False)
    match = choose_profile(cfg, facts)
    profile = match.profile
    log.info("device profile %s: %s", profile.name, "; ".join(match.reasons))
    cache_dir = cfg.cache_dir
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
    manager = ModelManager(cfg.device.model_repository, cfg.models, profile.backends, cache_dir=cache_dir,
                           threads=profile.threads, memory_budget_mb=profile.effective_memory_budget_mb(facts))
    if load:
        if only is not None:
            manager.load_model(only)
        else:
            manager.load_all()
    return Runtime(cfg, facts, match, manager, InferenceService(manager))


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.runtime: Runtime | None = None
        self.transports: list[Transport] = []
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def _make_transports(self, rt: Runtime) -> list[Transport]:
        # Transports are imported only when enabled: their libraries cost start-up time and memory.
        cfg = self.cfg
        out: list[Transport] = []
        if cfg.shm.enabled:
            from edged.transports.shm import ShmTransport
            out.append(ShmTransport(cfg, rt.service))
        if cfg.http.enabled:
            from edged.transports.http import HttpTransport
            out.append(HttpTransport(cfg, rt.service))
        if cfg.mqtt.enabled:
            from edged.transports.mqtt import MqttTransport
            out.append(MqttTransport(cfg, rt.service, rt.profile.name))
        return out

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        t0 = time.monotonic()
        log.info("edged starting: repository %s, state %s", self.cfg.device.model_repository, self.cfg.device.state_dir)
        self.runtime = rt = await asyncio.to_thread(build_runtime, self.cfg)
        ready = [mv for mv in rt.manager.table.all() if mv.state is ModelState.READY]
        broken = [mv for mv in rt.manager.table.all() if mv.state is not ModelState.READY]
        for t in self._make_transports(rt):
            await t.start()
            self.transports.append(t)
        log.info("edged ready in %.2fs: %d model version(s) serving, %d unavailable, profile %s",
                 time.monotonic() - t0, len(ready), len(broken), rt.profile.name)
        await self._stop.wait()
        log.info("edged stopping")
        for t in reversed(self.transports):
            try:
                await t.stop()
            except Exception:
                log.exception("transport %s did not stop cleanly", t.name)
        await asyncio.to_thread(rt.manager.shutdown)
        log.info("edged stopped")
        return 0


def run(cfg: Config) -> int:
    return asyncio.run(Daemon(cfg).serve())
