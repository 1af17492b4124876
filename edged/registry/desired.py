"""A device's desired state, computed per poll from a per-process snapshot of releases and rollouts.

The snapshot (every unrevoked release with its signed envelope pre-serialised, and the
latest rollout of each) is reloaded only when the registry revision in the database moved
(:class:`~edged.registry.db.RegistryMetaRow`), so a poll costs one indexed query (the
device, its per-model rows and the revision, joined) however many devices, releases and
rollouts there are, and no write: last-seen times are batched by
:mod:`edged.registry.lastseen`. The ETag is a digest of the decision (which release per
model, which releases to revert), not of the body, so a 304 is answered without
serialising anything. Processes sharing one database stay consistent because each checks
the revision on every poll.

Per model the device gets: its pinned release, else the highest unrevoked release whose
signed selector matches and which is live for it: a release without a rollout is live for
everyone it selects; one with a rollout only for the rollout's members (running, paused,
completed), for the members that already activated it (aborted), or for nobody, its
members being told to return to their last-known-good instead (halted, rolled back), or for nobody
yet (scheduled: its start time has not come). A step
that admits at a pace widens its membership with the clock (:class:`~edged.registry.targets.Ramp`),
so the snapshot stays valid while devices are let in one after another.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import Connection, bindparam, select

from edged.protocol.fleet.release import TargetSelector
from edged.registry.auth import same_hash
from edged.registry.db import (
    DeviceModelRow,
    DeviceRow,
    ModelRow,
    RegistryMetaRow,
    ReleaseRow,
    RolloutRow,
    VersionFileRow,
    VersionRow,
)
from edged.registry.rollout_wire import REVERT_STATES
from edged.registry.targets import Membership, Ramp, RolloutTarget, selector_matches

ACTIVATED_STEPS = frozenset({"active-trial", "committed"})


@dataclass(frozen=True)
class RolloutView:
    id: int
    state: str
    membership: Membership
    reason: str


@dataclass(frozen=True)
class ReleaseView:
    id: int
    model_id: int
    model: str
    number: int
    version: int
    version_id: int
    selector: TargetSelector
    fragment: bytes  # the DesiredModel JSON for this release
    rollout: RolloutView | None


@dataclass
class Snapshot:
    revision: int
    by_model: dict[int, list[ReleaseView]] = field(default_factory=dict)  # highest number first
    by_id: dict[int, ReleaseView] = field(default_factory=dict)
    active_rollouts: int = 0


@dataclass
class DeviceModelView:
    pinned_release_id: int | None
    state: str | None
    release_number: int | None


@dataclass
class DeviceView:
    id: str
    credential_hash: str
    labels: dict[str, Any]
    facts: dict[str, Any]
    last_seen_at: float | None
    models: dict[int, DeviceModelView]


@dataclass
class Desired:
    device_id: str
    releases: list[ReleaseView]
    revert: list[tuple[str, list[int], str]]  # model, release numbers, reason

    def etag(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.device_id.encode())
        for r in self.releases:
            h.update(b"\x00r%d" % r.id)
        for model, numbers, reason in self.revert:
            h.update(b"\x00v" + model.encode() + b"".join(b",%d" % n for n in numbers) + reason.encode())
        return f'"{h.hexdigest()}"'

    def body(self) -> bytes:
        revert = [{"model": m, "releases": n, "reason": why} for m, n, why in self.revert]
        return (b'{"device_id":' + orjson.dumps(self.device_id) + b',"models":['
                + b",".join(r.fragment for r in self.releases) + b'],"revert":' + orjson.dumps(revert) + b"}")


# ---- the snapshot ---------------------------------------------------------------------------------
_REVISION = select(RegistryMetaRow.revision).where(RegistryMetaRow.id == 1).scalar_subquery()


def current_revision(conn: Connection) -> int:
    return int(conn.execute(select(RegistryMetaRow.revision).where(RegistryMetaRow.id == 1)).scalar_one())


def load_snapshot(conn: Connection) -> Snapshot:
    """Read the revision first: data read after it is at least as new, so a cached snapshot is never stale."""
    snap = Snapshot(revision=current_revision(conn))
    latest: dict[int, Any] = {}
    ro: Any
    for ro in conn.execute(select(RolloutRow.id, RolloutRow.release_id, RolloutRow.state, RolloutRow.target,
                                  RolloutRow.salt, RolloutRow.steps, RolloutRow.cutoffs, RolloutRow.step,
                                  RolloutRow.reason, RolloutRow.admission).order_by(RolloutRow.id)):
        latest[ro.release_id] = ro  # the newest rollout of a release decides
    rows = conn.execute(
        select(ReleaseRow.id, ReleaseRow.model_id, ModelRow.name, ReleaseRow.number, VersionRow.version,
               ReleaseRow.version_id, ReleaseRow.selector, ReleaseRow.manifest_b64, ReleaseRow.signature,
               ReleaseRow.key_id)
        .join(ModelRow, ModelRow.id == ReleaseRow.model_id).join(VersionRow, VersionRow.id == ReleaseRow.version_id)
        .where(ReleaseRow.revoked_at.is_(None)).order_by(ReleaseRow.model_id, ReleaseRow.number.desc()))
    for r in rows:
        view = None
        ro = latest.get(r.id)
        if ro is not None:
            member = Membership.of(RolloutTarget.model_validate(ro.target), ro.salt, list(ro.steps),
                                   list(ro.cutoffs), ro.step if ro.state != "scheduled" else -1,  # nobody yet
                                   ramp=Ramp.load(ro.admission))
            view = RolloutView(ro.id, ro.state, member, ro.reason or f"rollout {ro.id} {ro.state}")
            if ro.state in ("running", "paused"):
                snap.active_rollouts += 1
        fragment = orjson.dumps({"model": r.name, "version": r.version, "release": r.number, "signed": {
            "manifest": r.manifest_b64, "signature": r.signature, "key_id": r.key_id}})
        rv = ReleaseView(r.id, r.model_id, r.name, r.number, r.version, r.version_id,
                         TargetSelector.model_validate(r.selector), fragment, view)
        snap.by_model.setdefault(r.model_id, []).append(rv)
        snap.by_id[r.id] = rv
    return snap


class SnapshotCache:
    """One snapshot per process, replaced when the database revision moves (one loader at a time)."""

    def __init__(self) -> None:
        self._snap: Snapshot | None = None
        self._lock = threading.Lock()
        self._files: dict[int, frozenset[str]] = {}
        self.loads = 0

    def get(self, conn: Connection, revision: int | None = None) -> Snapshot:
        if revision is None:
            revision = current_revision(conn)
        snap = self._snap
        if snap is not None and snap.revision >= revision:
            return snap
        with self._lock:
            snap = self._snap
            if snap is None or snap.revision < revision:
                snap = load_snapshot(conn)
                self._snap = snap
                self.loads += 1
            return snap

    def version_files(self, conn: Connection, version_id: int) -> frozenset[str]:
        """The digests of a version's files; versions are immutable, so this never goes stale."""
        files = self._files.get(version_id)
        if files is None:
            files = frozenset(conn.execute(select(VersionFileRow.sha256)
                                           .where(VersionFileRow.version_id == version_id)).scalars())
            self._files[version_id] = files
        return files


# ---- one device -----------------------------------------------------------------------------------
_DEVICE_QUERY = (
    select(DeviceRow.id, DeviceRow.credential_hash, DeviceRow.admin_labels, DeviceRow.facts,
           DeviceRow.last_seen_at, DeviceModelRow.model_id, DeviceModelRow.pinned_release_id, DeviceModelRow.state,
           DeviceModelRow.release_number, _REVISION.label("revision"))
    .select_from(DeviceRow).outerjoin(DeviceModelRow, DeviceModelRow.device_id == DeviceRow.id))
BY_CREDENTIAL = _DEVICE_QUERY.where(DeviceRow.credential_hash == bindparam("h"))
BY_ID = _DEVICE_QUERY.where(DeviceRow.id == bindparam("id"))


def device_view(rows: Sequence[Any]) -> tuple[DeviceView | None, int]:
    """The joined rows of one device (one per model row, or one with nulls) -> its view and the revision."""
    if not rows:
        return None, 0
    first = rows[0]
    dev = DeviceView(id=first.id, credential_hash=first.credential_hash,
                     labels=dict(first.admin_labels or {}), facts=first.facts or {},
                     last_seen_at=first.last_seen_at, models={})
    for r in rows:
        if r.model_id is not None:
            dev.models[r.model_id] = DeviceModelView(r.pinned_release_id, r.state, r.release_number)
    return dev, int(first.revision)


def lookup_credential(conn: Connection, credential_hash: str) -> tuple[DeviceView | None, int]:
    dev, rev = device_view(conn.execute(BY_CREDENTIAL, {"h": credential_hash}).all())
    if dev is not None and not same_hash(dev.credential_hash, credential_hash):
        return None, rev
    return dev, rev


def lookup_device(conn: Connection, device_id: str) -> tuple[DeviceView | None, int]:
    return device_view(conn.execute(BY_ID, {"id": device_id}).all())


def decide(snap: Snapshot, dev: DeviceView) -> Desired:
    chosen: list[ReleaseView] = []
    revert: list[tuple[str, list[int], str]] = []
    for model_id, releases in snap.by_model.items():
        dm = dev.models.get(model_id)
        pin = snap.by_id.get(dm.pinned_release_id) if dm is not None and dm.pinned_release_id else None
        pick: ReleaseView | None = None
        back: list[int] = []
        why = ""
        for r in releases:
            if pin is not None and r.number <= pin.number:
                break
            if not selector_matches(r.selector, dev.id, dev.labels):
                continue
            ro = r.rollout
            if ro is None:
                pick = r
                break
            if not ro.membership.member(dev.id, dev.labels, dev.facts):
                continue
            if ro.state in REVERT_STATES:
                back.append(r.number)
                why = why or ro.reason
                continue
            if ro.state == "aborted" and not (dm is not None and dm.release_number == r.number
                                              and dm.state in ACTIVATED_STEPS):
                continue
            pick = r
            break
        pick = pin or pick
        if pick is not None:
            chosen.append(pick)
            trial = _trial_to_stop(releases, pick, dev, dm)
            if trial is not None:
                back.append(trial.number)
                why = why or (trial.rollout.reason if trial.rollout else "")
        if back:
            revert.append((releases[0].model, sorted(back), why))
    chosen.sort(key=lambda r: r.model)
    revert.sort()
    return Desired(dev.id, chosen, revert)


def _trial_to_stop(releases: list[ReleaseView], pick: ReleaseView, dev: DeviceView,
                   dm: DeviceModelView | None) -> ReleaseView | None:
    """A release below the one offered that this device is on trial with, whose rollout was halted or rolled
    back (e.g. by a fleet rollback, whose new release is higher): the trial stops now instead of committing it
    first. Devices that committed it simply move on to the offered release."""
    if dm is None or dm.state != "active-trial" or dm.release_number is None or dm.release_number >= pick.number:
        return None
    for r in releases:
        if r.number == dm.release_number:
            ro = r.rollout
            if ro is not None and ro.state in REVERT_STATES and ro.membership.member(dev.id, dev.labels, dev.facts):
                return r
            return None
    return None


def blob_allowed(conn: Connection, desired: Desired, sha256: str, cache: SnapshotCache | None = None) -> bool:
    """A device may download only files of the releases it is meant to install."""
    if cache is not None:
        return any(sha256 in cache.version_files(conn, r.version_id) for r in desired.releases)
    version_ids = [r.version_id for r in desired.releases]
    if not version_ids:
        return False
    hit = conn.execute(select(VersionFileRow.id).where(VersionFileRow.version_id.in_(version_ids),
                                                       VersionFileRow.sha256 == sha256).limit(1)).first()
    return hit is not None
