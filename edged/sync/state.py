"""What the device remembers about syncing, in one JSON file written atomically.

Per model: the highest release number ever accepted (the rollback-attack guard), the
committed version (``current``), the previous one kept as last-known-good (``lkg``), the
update in progress (``pending``, with the step it reached), and releases refused for good.
During a trial ``current`` still names the previous committed version: that is what a
rollback or a crash loop goes back to.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edged.fsutil import atomic_write_bytes, atomic_write_text
from edged.protocol.fleet.messages import ReportEvent
from edged.protocol.fleet.release import SignedRelease

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
CREDENTIAL_FILE = "credential.json"
OUTBOX_MAX = 2000

PendingStep = Literal["download", "prepare", "install", "activate", "trial", "rollback"]
# Steps during which new model code runs in the process: a crash then counts towards a crash loop.
RISKY_STEPS: frozenset[str] = frozenset({"prepare", "activate", "trial"})


class _State(BaseModel):
    model_config = ConfigDict(extra="ignore")


class VersionRef(_State):
    version: int
    release: int = Field(default=0, description="0: present in the repository before the first sync")


class Pending(_State):
    """The update in progress for one model."""

    release: int
    version: int
    step: PendingStep
    signed: SignedRelease
    reason: str | None = None
    fault: str | None = Field(default=None, description="the last attempt failed on local storage (the cause); "
                                                        "retried with back-off, cleared when a step completes")
    starts: list[float] = Field(default_factory=list, description="process starts during risky steps (wall time)")
    clean_stop: bool = False


class Refusal(_State):
    reason: str
    count: int = 1
    retry_at: float = 0.0


class ModelSync(_State):
    highest_release: int = 0
    current: VersionRef | None = None
    lkg: VersionRef | None = None
    pending: Pending | None = None
    rejected: dict[int, str] = Field(default_factory=dict, description="rolled back: never retried")
    refused: dict[int, Refusal] = Field(default_factory=dict, description="refused or failed: retried with back-off")
    installed: list[int] = Field(default_factory=list, description="versions this agent may delete")

    def keep(self) -> set[int]:
        out = {r.version for r in (self.current, self.lkg) if r is not None}
        if self.pending is not None:
            out.add(self.pending.version)
        return out


class SyncState(_State):
    models: dict[str, ModelSync] = Field(default_factory=dict)
    seq: int = 0
    outbox: list[ReportEvent] = Field(default_factory=list)

    def model(self, name: str) -> ModelSync:
        return self.models.setdefault(name, ModelSync())


class Credential(_State):
    device_id: str
    credential: str
    url: str


class StateStore:
    """Loads and saves :class:`SyncState`; callers hold :attr:`lock` while they change it."""

    def __init__(self, sync_dir: Path) -> None:
        self.dir = sync_dir
        self.path = sync_dir / STATE_FILE
        self.lock = threading.RLock()

    def load(self) -> SyncState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return SyncState()
        try:
            return SyncState.model_validate_json(data)
        except ValidationError as e:
            # Written atomically, so this means outside interference; keep the evidence and start over.
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("sync state %s unreadable (%s); moved to %s and starting afresh", self.path,
                      e.error_count(), aside.name)
            return SyncState()

    def save(self, state: SyncState) -> None:
        if len(state.outbox) > OUTBOX_MAX:
            del state.outbox[: len(state.outbox) - OUTBOX_MAX]
        atomic_write_text(self.path, state.model_dump_json(), mode=0o600)

    def load_credential(self) -> Credential | None:
        try:
            return Credential.model_validate_json((self.dir / CREDENTIAL_FILE).read_bytes())
        except (FileNotFoundError, ValidationError):
            return None

    def save_credential(self, cred: Credential) -> None:
        atomic_write_bytes(self.dir / CREDENTIAL_FILE, cred.model_dump_json().encode(), mode=0o600)

    def forget_credential(self) -> None:
        try:
            os.unlink(self.dir / CREDENTIAL_FILE)
        except FileNotFoundError:
            pass
