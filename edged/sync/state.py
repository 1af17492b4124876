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
from edged.protocol.fleet.messages import MAX_COUNT, ReportEvent
from edged.protocol.fleet.release import SignedRelease

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
CREDENTIAL_FILE = "credential.json"
OUTBOX_MAX = 2000

PendingStep = Literal["download", "prepare", "install", "activate", "trial", "rollback"]
# Steps during which new model code runs in the process: a crash then counts towards a crash loop.
RISKY_STEPS: frozenset[str] = frozenset({"prepare", "activate", "trial"})
# A fresh state numbers its reports on from here at most: 2^40 reports below the protocol's bound (2^53).
SEQ_BASE_MAX = MAX_COUNT - 2**40


def fresh_seq(now: float | None = None) -> int:
    """Where a fresh state (first start, or the old one lost or moved aside) numbers its reports from.

    The registry ignores a sequence number it already holds for the device id and keeps a model's state
    from the highest one, so a device that starts over from 1 after losing its state (re-enrolled or not:
    a state moved aside keeps its credential) would have every report dropped. The wall clock in
    microseconds is above any number an earlier life used (one per report, counting from its own start)
    as long as the clock did not go back, and stays below the protocol's 2^53 until the year 2255.
    """
    t = time.time() if now is None else now
    return min(max(int(t * 1_000_000), 0), SEQ_BASE_MAX)


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
    """Loads and saves :class:`SyncState`; callers hold :attr:`lock` while they change it.

    :meth:`save` writes at once (a step of an update, which must survive a crash before the next one
    begins); :meth:`save_later` is for a change a crash may lose because the next poll redoes it (a
    refusal, a revert of a release never installed): written by the next :meth:`save` or :meth:`flush`,
    once for a whole poll. Reports are numbered in the state, so only those on disk may be sent
    (:attr:`saved_seq`): a number sent and then lost in a crash would be given to another report.
    """

    def __init__(self, sync_dir: Path) -> None:
        self.dir = sync_dir
        self.path = sync_dir / STATE_FILE
        self.lock = threading.RLock()
        self.dirty = False
        self.saved_seq = 0  # the highest report number on disk

    def load(self) -> SyncState:
        state = self._read()
        self.saved_seq, self.dirty = state.seq, False
        return state

    def _read(self) -> SyncState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return SyncState(seq=fresh_seq())
        try:
            return SyncState.model_validate_json(data)
        except ValidationError as e:
            # Written atomically, so this means outside interference; keep the evidence and start over.
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("sync state %s unreadable (%s); moved to %s and starting afresh", self.path,
                      e.error_count(), aside.name)
            return SyncState(seq=fresh_seq())

    def save(self, state: SyncState) -> None:
        if len(state.outbox) > OUTBOX_MAX:
            del state.outbox[: len(state.outbox) - OUTBOX_MAX]
        atomic_write_text(self.path, state.model_dump_json(), mode=0o600)
        self.saved_seq, self.dirty = state.seq, False

    def save_later(self) -> None:
        """A change the next poll would redo if a crash lost it: written with the next save or flush."""
        self.dirty = True

    def flush(self, state: SyncState) -> None:
        """Write the changes :meth:`save_later` kept, if any."""
        if self.dirty:
            self.save(state)

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
