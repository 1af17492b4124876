"""Before the daemon loads any model: decide which version of each synced model it must serve.

This runs before the repository is loaded because a version that crashes the process
while loading or serving would otherwise be loaded again on every restart. It counts the
process starts that happen while an update is running new model code; N of them within M
seconds turn the update into a rollback, and the last-known-good is what gets loaded.
It pins each synced model to one version through the config's version policy (the object
the ModelManager reads), so no restart ever serves a version that is only staged,
rolled back or not yet activated.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from edged.config import Config, VersionPolicy
from edged.sync.repo import DeviceRepo
from edged.sync.settings import SyncSettings
from edged.sync.state import RISKY_STEPS, StateStore, SyncState

log = logging.getLogger(__name__)

_done: set[str] = set()
_done_lock = threading.Lock()


@dataclass
class BootResult:
    pins: dict[str, int | None] = field(default_factory=dict)  # model -> version served (None: not loaded)
    crash_loops: list[str] = field(default_factory=list)


def pinned_version(state: SyncState, model: str) -> int | bool | None:
    """What a start must serve: the trial version while on trial, else the committed one.

    None: nothing (a version is installed but not activated, or being rolled back, and
    there is no committed one); False: sync has no say over this model yet.
    """
    ms = state.models[model]
    p = ms.pending
    if p is not None and p.step == "trial":
        return p.version
    if ms.current is not None:
        return ms.current.version
    if p is not None and p.step in ("install", "activate", "rollback"):
        return None
    return False


def apply_pins(cfg: Config, state: SyncState) -> dict[str, int | None]:
    pins: dict[str, int | None] = {}
    for model in state.models:
        v = pinned_version(state, model)
        if v is False:
            continue
        if v is None or v is True:
            pins[model] = None
            if model not in cfg.models.disabled:
                cfg.models.disabled.append(model)
        else:
            pins[model] = v
            cfg.models.policies[model] = VersionPolicy(specific=[v])
            if model in cfg.models.disabled:
                cfg.models.disabled.remove(model)
    return pins


def count_start(state: SyncState, settings: SyncSettings, now: float) -> list[str]:
    """Record this start against every update running new code; return models now in a crash loop."""
    looping = []
    for model, ms in state.models.items():
        p = ms.pending
        if p is None or p.step not in RISKY_STEPS:
            continue
        if p.clean_stop:
            p.clean_stop = False  # an orderly stop (systemctl restart) is not a crash
            continue
        p.starts = [t for t in p.starts if 0 <= now - t <= settings.crash_loop_window_s] + [now]
        if len(p.starts) >= settings.crash_loop_restarts:
            p.step = "rollback"
            p.reason = (f"crash loop: {len(p.starts)} restarts within {settings.crash_loop_window_s / 60:g} min "
                        f"after activating version {p.version}")
            looping.append(model)
            log.error("model=%s %s; serving the last-known-good version", model, p.reason)
    return looping


def repin(cfg: Config, settings: SyncSettings | None = None) -> dict[str, int | None]:
    """Apply the current pins to a freshly loaded config (SIGHUP reload) without counting a start."""
    settings = settings or SyncSettings.from_config(cfg)
    store = StateStore(settings.sync_dir)
    with store.lock:
        return apply_pins(cfg, store.load())


def prepare_boot(cfg: Config, settings: SyncSettings | None = None) -> BootResult:
    """Idempotent per state folder and process: the first call counts the start and pins versions."""
    settings = settings or SyncSettings.from_config(cfg)
    store = StateStore(settings.sync_dir)
    key = str(settings.sync_dir.resolve())
    with _done_lock:
        first = key not in _done
        _done.add(key)
    with store.lock:
        state = store.load()
        result = BootResult()
        if first:
            DeviceRepo(settings.repository).empty_trash()
            result.crash_loops = count_start(state, settings, time.time())
            settings.sync_dir.mkdir(parents=True, exist_ok=True)
            store.save(state)
        result.pins = apply_pins(cfg, state)
    return result
