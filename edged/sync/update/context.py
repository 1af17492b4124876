"""What every step of an update works with: settings, state, registry client, repository, engines.

Also the in-memory side of updates in progress (statistics before the switch, evaluation-set
scores, trial clocks). None of it needs to survive a restart: a trial starts over after one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from edged.protocol.fleet.messages import QualityReport
from edged.sync.capped_http import RegistryHttp
from edged.sync.engine_port import EnginePort
from edged.sync.registry_client import DeviceClient
from edged.sync.repo import DeviceRepo
from edged.sync.settings import SyncSettings
from edged.sync.state import ModelSync, StateStore, SyncState
from edged.sync.trial import Sample

# Models the registry names that this device has no saved entry for, whose releases were refused: remembered
# (for the back-off) in memory only, so that no name a registry sends grows the saved state.
MAX_STRANGERS = 1024


@dataclass
class TrialClock:
    """One trial's deadlines (monotonic) and what it saw so far; the sync loop visits it at ``due``."""

    start: float
    end: float
    cap: float  # the latest end when too little traffic came to judge
    settle_at: float
    due: float
    settled: Sample | None = None  # the sample when the switch settled: latency is judged from there on
    last: Sample | None = None
    paused: bool = False  # an operator unloaded the model: the trial starts over once it is back


@dataclass
class UpdateContext:
    settings: SyncSettings
    store: StateStore
    state: SyncState
    client: DeviceClient
    http: RegistryHttp
    engine: EnginePort
    stop: threading.Event
    repo: DeviceRepo
    baselines: dict[str, Sample | None] = field(default_factory=dict)  # the replaced version, to judge against
    run_up: dict[str, Sample | None] = field(default_factory=dict)  # the previous version when the update began
    quality: dict[str, QualityReport] = field(default_factory=dict)  # per model: the trial's evaluation-set scores
    download_reported: set[tuple[str, int]] = field(default_factory=set)  # "downloading" sent for (model, release)
    trials: dict[str, TrialClock] = field(default_factory=dict)
    unrevertable: set[tuple[str, int]] = field(default_factory=set)  # reverts found impossible, reported once
    strangers: dict[str, ModelSync] = field(default_factory=dict)  # oldest first, see MAX_STRANGERS

    def ms(self, model: str) -> ModelSync:
        """The model's saved entry, made if need be: only once a release of it passed the signed checks, or
        the model serves here already."""
        with self.store.lock:
            self.strangers.pop(model, None)
            return self.state.model(model)

    def known(self, model: str) -> ModelSync | None:
        """The model's saved entry, if it has one."""
        with self.store.lock:
            return self.state.models.get(model)

    def entry(self, model: str) -> ModelSync:
        """The saved entry, else an unsaved one (kept in memory, the newest :data:`MAX_STRANGERS`)."""
        ms = self.known(model)
        if ms is not None:
            return ms
        ms = self.strangers.pop(model, None) or ModelSync()
        self.strangers[model] = ms
        while len(self.strangers) > MAX_STRANGERS:
            del self.strangers[next(iter(self.strangers))]
        return ms
