"""Registry operations on a database session, independent of HTTP.

The API layer authenticates and maps :class:`RegistryError` to status codes; everything
that decides what is stored or served lives here so that the CLI, the API and the
fleet-rollout code share one implementation.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from edged.errors import EdgedError, ErrorCode, format_validation_error
from edged.protocol.fleet.messages import (
    DesiredState,
    DeviceFactsUpdate,
    DeviceInfo,
    DeviceModelInfo,
    EnrollmentTokenRequest,
    EnrollmentTokenResponse,
    EnrollRequest,
    EnrollResponse,
    EventInfo,
    ModelInfo,
    ModelStatus,
    ReenrollRequest,
    RegistryStatus,
    ReleaseInfo,
    ReleaseStatus,
    VersionInfo,
)
from edged.protocol.fleet.release import FileEntry, ReleaseError, SignedRelease, TargetSelector, verify_release
from edged.protocol.names import MANIFEST_NAME, PIPELINE_NAME, valid_model_name
from edged.registry import desired
from edged.registry.auth import DEVICE_PREFIX, ENROLL_PREFIX, new_token, same_hash, token_hash
from edged.registry.blobs import BlobStore
from edged.registry.db import (
    BlobRow,
    DeviceEventRow,
    DeviceModelRow,
    DeviceRow,
    EnrollmentTokenRow,
    ModelRow,
    RegistryMetaRow,
    ReleaseRow,
    VersionFileRow,
    VersionRow,
)
from edged.repository.manifest import ModelManifest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_MANIFEST_TOML = 1 << 20


class RegistryError(EdgedError):
    """A request the registry refuses; ``status`` is the HTTP status the API answers with."""

    def __init__(self, message: str, status: int, code: ErrorCode) -> None:
        super().__init__(message, code=code)
        self.status = status


def not_found(what: str) -> RegistryError:
    return RegistryError(f"{what} not found", 404, ErrorCode.NOT_FOUND)


def invalid(message: str) -> RegistryError:
    return RegistryError(message, 400, ErrorCode.INVALID_ARGUMENT)


def conflict(message: str) -> RegistryError:
    return RegistryError(message, 409, ErrorCode.FAILED_PRECONDITION)


# ---- models, versions and blobs -----------------------------------------------------------------
def get_model(s: Session, name: str) -> ModelRow:
    row = s.scalar(select(ModelRow).where(ModelRow.name == name))
    if row is None:
        raise not_found(f"model {name!r}")
    return row


def ensure_model(s: Session, name: str) -> ModelRow:
    if not valid_model_name(name):
        raise invalid(f"{name!r} is not a valid model name")
    row = s.scalar(select(ModelRow).where(ModelRow.name == name))
    if row is None:
        try:
            with s.begin_nested():
                row = ModelRow(name=name)
                s.add(row)
        except IntegrityError:  # created concurrently by another registry process
            row = s.scalar(select(ModelRow).where(ModelRow.name == name))
            assert row is not None
    return row


def missing_blobs(s: Session, store: BlobStore, shas: Iterable[str]) -> list[str]:
    wanted = sorted(set(shas))
    for sha in wanted:
        store.path(sha)  # validates the format
    known = set(s.scalars(select(BlobRow.sha256).where(BlobRow.sha256.in_(wanted))).all()) if wanted else set()
    return [sha for sha in wanted if sha not in known or not store.exists(sha)]


def record_blob(s: Session, sha256: str, size: int) -> None:
    if s.get(BlobRow, sha256) is not None:
        return
    try:
        with s.begin_nested():
            s.add(BlobRow(sha256=sha256, size=size))
    except IntegrityError:
        pass  # the same content was uploaded concurrently


def _version_files(s: Session, version_id: int) -> list[FileEntry]:
    rows = s.scalars(select(VersionFileRow).where(VersionFileRow.version_id == version_id)
                     .order_by(VersionFileRow.path)).all()
    return [FileEntry(path=r.path, sha256=r.sha256, size=r.size) for r in rows]


def _version_info(s: Session, model: str, row: VersionRow, created: bool = False) -> VersionInfo:
    return VersionInfo(model=model, version=row.version, files=_version_files(s, row.id), total_size=row.total_size,
                       created_at=row.created_at, created=created)


def _check_manifest(toml_text: str, files: dict[str, FileEntry]) -> None:
    """The version's model.toml must parse and every file it names must be pushed with the same digest."""
    try:
        manifest = ModelManifest.model_validate(tomllib.loads(toml_text))
    except tomllib.TOMLDecodeError as e:
        raise invalid(f"{MANIFEST_NAME} is not valid TOML: {e}") from None
    except ValidationError as e:
        raise invalid(f"{MANIFEST_NAME}: " + "; ".join(format_validation_error(e))) from None
    for variant in manifest.variants:
        for art in [variant, *variant.extra_files]:
            f = files.get(art.file)
            if f is None:
                raise invalid(f"{MANIFEST_NAME} names {art.file}, which is not among the pushed files")
            if f.sha256 != art.sha256:
                raise invalid(f"{art.file}: sha256 in {MANIFEST_NAME} differs from the pushed file")
    ev = manifest.evaluation
    named = [manifest.warmup.file, manifest.warmup.expected, manifest.labels,
             *((ev.inputs, ev.labels) if ev is not None else ()),
             *(v.calibration_cache for v in manifest.variants)]
    for rel in named:
        if rel and rel not in files:
            raise invalid(f"{MANIFEST_NAME} names {rel}, which is not among the pushed files")


def _check_pipeline_files(toml_text: str, files: dict[str, FileEntry]) -> None:
    """A pipeline version: every file its ``[[files]]`` lists must be pushed with the listed digest.

    The wiring is the device's to check (against the models it serves) when it prepares the release."""
    try:
        doc = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as e:
        raise invalid(f"{PIPELINE_NAME} is not valid TOML: {e}") from None
    listed = doc.get("files", [])
    if not isinstance(listed, list) or not all(isinstance(f, dict) for f in listed):
        raise invalid(f"{PIPELINE_NAME}: [[files]] must be a list of tables")
    for f in listed:
        rel, sha = f.get("file"), f.get("sha256")
        if not isinstance(rel, str) or not isinstance(sha, str):
            raise invalid(f"{PIPELINE_NAME}: each [[files]] entry needs a file and a sha256")
        pushed = files.get(rel)
        if pushed is None:
            raise invalid(f"{PIPELINE_NAME} lists {rel}, which is not among the pushed files")
        if pushed.sha256 != sha:
            raise invalid(f"{rel}: sha256 in {PIPELINE_NAME} differs from the pushed file")


def push_version(s: Session, store: BlobStore, model: str, version: int, files: list[FileEntry]) -> VersionInfo:
    """Create an immutable version from already-uploaded blobs; pushing identical content again is a no-op."""
    if version < 1:
        raise invalid("versions are integers >= 1")
    by_path = {f.path: f for f in files}
    if len(by_path) != len(files):
        raise invalid("files has duplicate paths")
    if (MANIFEST_NAME in by_path) == (PIPELINE_NAME in by_path):
        raise invalid(f"a version needs its {MANIFEST_NAME} (a model) or its {PIPELINE_NAME} (a pipeline), not both")
    missing = missing_blobs(s, store, (f.sha256 for f in files))
    if missing:
        raise conflict(f"{len(missing)} blob(s) not uploaded yet, first {missing[0]}")
    for f in files:
        size = store.size(f.sha256)
        if size != f.size:
            raise invalid(f"{f.path}: size {f.size} given, the stored blob has {size}")
    name = MANIFEST_NAME if MANIFEST_NAME in by_path else PIPELINE_NAME
    mf = by_path[name]
    if mf.size > MAX_MANIFEST_TOML:
        raise invalid(f"{name} is too large")
    toml_text = store.path(mf.sha256).read_text(encoding="utf-8", errors="replace")
    if name == MANIFEST_NAME:
        _check_manifest(toml_text, by_path)
    else:
        _check_pipeline_files(toml_text, by_path)
    m = ensure_model(s, model)
    existing = s.scalar(select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.version == version))
    if existing is not None:
        if sorted(_version_files(s, existing.id), key=lambda f: f.path) != sorted(files, key=lambda f: f.path):
            raise conflict(f"model {model!r} version {version} exists with different files; versions are "
                           "immutable, push a new version number")
        return _version_info(s, model, existing)
    row = VersionRow(model_id=m.id, version=version, manifest_toml=toml_text, total_size=sum(f.size for f in files))
    try:
        with s.begin_nested():
            s.add(row)
            s.flush()
            for f in files:
                s.add(VersionFileRow(version_id=row.id, path=f.path, sha256=f.sha256, size=f.size))
    except IntegrityError:
        raise conflict(f"model {model!r} version {version} was pushed concurrently") from None
    return _version_info(s, model, row, created=True)


def get_version(s: Session, model: str, version: int) -> VersionInfo:
    m = get_model(s, model)
    row = s.scalar(select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.version == version))
    if row is None:
        raise not_found(f"model {model!r} version {version}")
    return _version_info(s, model, row)


def list_models(s: Session) -> list[ModelInfo]:
    out = []
    for m in s.scalars(select(ModelRow).order_by(ModelRow.name)).all():
        versions = list(s.scalars(select(VersionRow.version).where(VersionRow.model_id == m.id)
                                  .order_by(VersionRow.version)).all())
        latest = s.scalar(select(func.max(ReleaseRow.number)).where(ReleaseRow.model_id == m.id))
        out.append(ModelInfo(name=m.name, versions=versions, latest_release=latest))
    return out


# ---- releases -----------------------------------------------------------------------------------
def next_release_number(s: Session, model: str) -> int:
    m = s.scalar(select(ModelRow).where(ModelRow.name == model))
    if m is None:
        return 1
    top = s.scalar(select(func.max(ReleaseRow.number)).where(ReleaseRow.model_id == m.id))
    return (top or 0) + 1


def _release_info(s: Session, r: ReleaseRow, model: str | None = None, with_signed: bool = False) -> ReleaseInfo:
    if model is None:
        model = s.get_one(ModelRow, r.model_id).name
    version = s.get_one(VersionRow, r.version_id).version
    return ReleaseInfo(model=model, release=r.number, version=version, key_id=r.key_id,
                       selector=TargetSelector.model_validate(r.selector), issued_at=r.issued_at,
                       expires_at=r.expires_at, created_at=r.created_at, revoked=r.revoked_at is not None,
                       notes=r.notes, signed=_signed(r) if with_signed else None, restores=r.restores)


def _signed(r: ReleaseRow) -> SignedRelease:
    return SignedRelease(manifest=r.manifest_b64, signature=r.signature, key_id=r.key_id)


def create_release(s: Session, signed: SignedRelease, public_keys: list[str]) -> ReleaseInfo:
    """Store an operator-signed release after checking it as strictly as a device would."""
    try:
        manifest = verify_release(signed, public_keys)
    except ReleaseError as e:
        raise invalid(str(e)) from None
    if manifest.expires_at <= time.time():
        raise invalid("the release has already expired")
    m = get_model(s, manifest.model)
    vrow = s.scalar(select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.version == manifest.version))
    if vrow is None:
        raise not_found(f"model {manifest.model!r} version {manifest.version}")
    stored = sorted(_version_files(s, vrow.id), key=lambda f: f.path)
    if sorted(manifest.files, key=lambda f: f.path) != stored:
        raise invalid("the release's file list differs from the pushed version's files")
    top = s.scalar(select(func.max(ReleaseRow.number)).where(ReleaseRow.model_id == m.id)) or 0
    if manifest.release <= top:
        raise conflict(f"release number {manifest.release} is not above the latest ({top}) for model "
                       f"{manifest.model!r}; sign it again with {top + 1}")
    row = ReleaseRow(model_id=m.id, number=manifest.release, version_id=vrow.id, manifest_b64=signed.manifest,
                     signature=signed.signature, key_id=signed.key_id,
                     selector=manifest.selector.model_dump(mode="json"), issued_at=manifest.issued_at,
                     expires_at=manifest.expires_at, notes=manifest.notes)
    try:
        with s.begin_nested():
            s.add(row)
    except IntegrityError:
        raise conflict(f"release number {manifest.release} was taken concurrently; sign it again") from None
    bump_revision(s)
    return _release_info(s, row, manifest.model)


def list_releases(s: Session, model: str, with_signed: bool = False) -> list[ReleaseInfo]:
    m = get_model(s, model)
    rows = s.scalars(select(ReleaseRow).where(ReleaseRow.model_id == m.id).order_by(ReleaseRow.number)).all()
    return [_release_info(s, r, model, with_signed) for r in rows]


def revoke_release(s: Session, model: str, number: int) -> ReleaseInfo:
    m = get_model(s, model)
    row = s.scalar(select(ReleaseRow).where(ReleaseRow.model_id == m.id, ReleaseRow.number == number))
    if row is None:
        raise not_found(f"release {number} of model {model!r}")
    if row.revoked_at is None:
        row.revoked_at = time.time()
        bump_revision(s)
    return _release_info(s, row, model)


# ---- enrollment ---------------------------------------------------------------------------------
def create_enrollment_token(s: Session, req: EnrollmentTokenRequest) -> EnrollmentTokenResponse:
    token = new_token(ENROLL_PREFIX)
    expires = time.time() + req.ttl_s
    s.add(EnrollmentTokenRow(token_hash=token_hash(token), uses_left=req.uses, labels=dict(req.labels),
                             expires_at=expires))
    return EnrollmentTokenResponse(token=token, uses=req.uses, expires_at=expires)


def enroll(s: Session, req: EnrollRequest) -> EnrollResponse:
    """Spend one use of an enrollment token and bind a new device id to a fresh credential.

    An enrollment token binds new ids only: taking over an enrolled id needs a token an operator
    issued for that very device (``devices reenroll``), so a leaked fleet token cannot lock a
    real device out. Labels are the operator's: a device may only repeat those its token carries.
    """
    h = token_hash(req.token)
    tok = s.scalar(select(EnrollmentTokenRow).where(EnrollmentTokenRow.token_hash == h))
    refused = RegistryError("enrollment token is invalid, used up or expired", 401, ErrorCode.UNAUTHENTICATED)
    if tok is None or not same_hash(tok.token_hash, h) or tok.expires_at <= time.time():
        raise refused
    if tok.device_id is not None and tok.device_id != req.device_id:
        raise RegistryError(f"device_id: this enrollment token re-enrolls device {tok.device_id!r} only", 403,
                            ErrorCode.PERMISSION_DENIED)
    foreign = sorted(k for k, v in req.labels.items() if tok.labels.get(k) != v)
    if foreign:
        raise RegistryError(f"labels: a device cannot choose its own labels ({', '.join(foreign)} not given by its "
                            "enrollment token); operators set them with `edged-registry devices label` or "
                            "`edged-registry enrollment-token --label`", 403, ErrorCode.PERMISSION_DENIED)
    dev = s.get(DeviceRow, req.device_id)
    if dev is not None and tok.device_id is None:
        raise already_enrolled(req.device_id)
    # Conditional decrement: two devices racing for the last use cannot both win.
    spent = s.execute(update(EnrollmentTokenRow).where(EnrollmentTokenRow.id == tok.id,
                                                       EnrollmentTokenRow.uses_left > 0)
                      .values(uses_left=EnrollmentTokenRow.uses_left - 1))
    if getattr(spent, "rowcount", 0) != 1:
        raise refused
    credential = new_token(DEVICE_PREFIX)
    if dev is None:
        s.add(DeviceRow(id=req.device_id, credential_hash=token_hash(credential), labels={},
                        admin_labels=dict(tok.labels), facts=json_safe(req.facts), serving=[],
                        last_seen_at=time.time()))
        try:
            s.flush()
        except IntegrityError:  # another enrollment of the same new id won the race
            raise already_enrolled(req.device_id) from None
    else:
        dev.credential_hash = token_hash(credential)
        dev.admin_labels = {**dev.admin_labels, **tok.labels}
        dev.facts = json_safe(req.facts)
        dev.last_seen_at = time.time()
    return EnrollResponse(device_id=req.device_id, credential=credential)


def already_enrolled(device_id: str) -> RegistryError:
    return RegistryError(f"device_id: {device_id!r} is already enrolled; an enrollment token only enrolls new "
                         "devices (rotate with the current credential, or an operator runs "
                         f"`edged-registry devices reenroll {device_id}`)", 409, ErrorCode.FAILED_PRECONDITION)


def rotate_credential(dev: DeviceRow) -> EnrollResponse:
    """A fresh credential for a device that proves it holds the current one; the old one stops working."""
    credential = new_token(DEVICE_PREFIX)
    dev.credential_hash = token_hash(credential)
    return EnrollResponse(device_id=dev.id, credential=credential)


def reenroll_token(s: Session, device_id: str, req: ReenrollRequest) -> EnrollmentTokenResponse:
    """The operator's re-enrollment: revoke the device's credential now, and issue a single-use token that
    enrolls this id (and no other) again, e.g. after the device lost its state or its key leaked."""
    dev = s.get(DeviceRow, device_id)
    if dev is None:
        raise not_found(f"device {device_id!r}")
    dev.credential_hash = token_hash(new_token(DEVICE_PREFIX))  # nobody knows this one
    token = new_token(ENROLL_PREFIX)
    expires = time.time() + req.ttl_s
    s.add(EnrollmentTokenRow(token_hash=token_hash(token), uses_left=1, labels={}, expires_at=expires,
                             device_id=device_id))
    return EnrollmentTokenResponse(token=token, uses=1, expires_at=expires)


def device_for_credential(s: Session, credential: str) -> DeviceRow | None:
    h = token_hash(credential)
    dev = s.scalar(select(DeviceRow).where(DeviceRow.credential_hash == h))
    if dev is None or not same_hash(dev.credential_hash, h):
        return None
    return dev


def touch(dev: DeviceRow, resolution_s: float) -> None:
    t = time.time()
    if dev.last_seen_at is None or t - dev.last_seen_at >= resolution_s:
        dev.last_seen_at = t


# ---- desired state ------------------------------------------------------------------------------
def bump_revision(s: Session) -> None:
    """Tell every registry process that releases or rollouts changed (their cached snapshot is stale)."""
    s.execute(update(RegistryMetaRow).where(RegistryMetaRow.id == 1).values(revision=RegistryMetaRow.revision + 1))


def desired_state(s: Session, dev: DeviceRow) -> tuple[DesiredState, str]:
    """The desired state and its ETag, without the per-process cache (the API's poll path uses one)."""
    conn = s.connection()
    view, _rev = desired.lookup_device(conn, dev.id)
    if view is None:
        raise not_found(f"device {dev.id!r}")
    d = desired.decide(desired.load_snapshot(conn), view)
    return DesiredState.model_validate_json(d.body()), d.etag()


def blob_allowed(s: Session, dev: DeviceRow, sha256: str) -> bool:
    """A device may download only files of the releases it is meant to install."""
    conn = s.connection()
    view, _rev = desired.lookup_device(conn, dev.id)
    if view is None:
        return False
    return desired.blob_allowed(conn, desired.decide(desired.load_snapshot(conn), view), sha256)


# ---- reports (stored by edged.registry.writer) --------------------------------------------------
def _plain(x: Any, depth: int = 0) -> Any:
    """``x`` with what JSON columns cannot hold made harmless: integers beyond 64 bits as text, NaN and
    infinities as null, nesting beyond 32 levels as text."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x if -(2**63) <= x < 2**63 else str(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if depth >= 32:
        return str(x)[:256]
    if isinstance(x, dict):
        return {str(k): _plain(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, depth + 1) for v in x]
    return str(x)


EVENT_LOGS = "logs"  # in DeviceEventRow.detail: the device's last log lines before a failure (ReportEvent.logs)


def event_info(e: DeviceEventRow) -> EventInfo:
    detail = dict(e.detail or {})
    logs = detail.pop(EVENT_LOGS, None)
    return EventInfo(seq=e.seq, model=e.model, step=e.step, version=e.version, release=e.release_number,
                     reason=e.reason, detail=detail, at=e.device_time, received_at=e.received_at,
                     logs=[str(x) for x in logs] if isinstance(logs, list) else [])


def json_safe(d: dict[str, Any]) -> dict[str, Any]:
    """JSON with anything unusual stringified, at most 16 KiB (else a marker)."""
    try:
        data = orjson.dumps(d, default=str)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, or nesting too deep for orjson
        data = orjson.dumps(_plain(d), default=str)
    if len(data) > 16384:
        return {"truncated": True}
    out: dict[str, Any] = orjson.loads(data)
    return out


@dataclass(frozen=True)
class FactsWrite:
    """What a device says about itself, made JSON-safe; stored with ``last_seen_at`` (report writer)."""

    facts: dict[str, Any]
    serving: list[Any]


def facts_write(upd: DeviceFactsUpdate) -> FactsWrite:
    """The update as stored: facts made JSON-safe, serving entries as JSON."""
    return FactsWrite(json_safe(upd.facts), [m.model_dump(mode="json") for m in upd.serving])


def refuse_self_labels(upd: DeviceFactsUpdate) -> None:
    if upd.labels:
        raise RegistryError(f"labels: a device cannot set its own labels ({', '.join(sorted(upd.labels))}); "
                            "operators set them with `edged-registry devices label`", 403,
                            ErrorCode.PERMISSION_DENIED)


# ---- devices (admin) ----------------------------------------------------------------------------
def _device_models(s: Session, dev_ids: list[str]) -> dict[str, list[DeviceModelInfo]]:
    """Per device, its per-model rows: one query for any number of devices."""
    out: dict[str, list[DeviceModelInfo]] = {d: [] for d in dev_ids}
    if not dev_ids:
        return out
    pinned = aliased(ReleaseRow)
    q = (select(DeviceModelRow, ModelRow.name, pinned.number)
         .join(ModelRow, ModelRow.id == DeviceModelRow.model_id)
         .outerjoin(pinned, pinned.id == DeviceModelRow.pinned_release_id)
         .order_by(DeviceModelRow.device_id, ModelRow.name))
    # a fleet-wide listing reads every row once instead of binding thousands of ids
    q = q.where(DeviceModelRow.device_id.in_(dev_ids)) if len(dev_ids) <= 500 else q
    for dm, name, pin_number in s.execute(q).all():
        rows = out.get(dm.device_id)
        if rows is not None:
            rows.append(DeviceModelInfo(model=name, state=dm.state, version=dm.version, release=dm.release_number,
                                        reason=dm.reason, updated_at=dm.updated_at, pinned_release=pin_number))
    return out


def _device_info(s: Session, dev: DeviceRow, events: int = 0,
                 models: list[DeviceModelInfo] | None = None) -> DeviceInfo:
    info = DeviceInfo(device_id=dev.id, labels=dev.effective_labels(), facts=dev.facts, enrolled_at=dev.enrolled_at,
                      last_seen_at=dev.last_seen_at,
                      models=models if models is not None else _device_models(s, [dev.id])[dev.id])
    if events:
        q = (select(DeviceEventRow).where(DeviceEventRow.device_id == dev.id)
             .order_by(DeviceEventRow.seq.desc()).limit(events))
        info.events = [event_info(e) for e in reversed(s.scalars(q).all())]
    return info


def list_devices(s: Session, label: dict[str, str] | None = None) -> list[DeviceInfo]:
    """Every device (matching ``label``) with its models: two queries whatever the fleet size."""
    devs = s.scalars(select(DeviceRow).order_by(DeviceRow.id)).all()
    sel = TargetSelector(labels=label or {})
    devs = [d for d in devs if sel.matches(d.id, d.effective_labels())]
    models = _device_models(s, [d.id for d in devs])
    return [_device_info(s, d, models=models[d.id]) for d in devs]


def get_device(s: Session, device_id: str, events: int = 50) -> DeviceInfo:
    dev = s.get(DeviceRow, device_id)
    if dev is None:
        raise not_found(f"device {device_id!r}")
    return _device_info(s, dev, events)


def set_admin_labels(s: Session, device_id: str, labels: dict[str, str | None]) -> DeviceInfo:
    dev = s.get(DeviceRow, device_id)
    if dev is None:
        raise not_found(f"device {device_id!r}")
    merged = dict(dev.admin_labels)
    for k, v in labels.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    dev.admin_labels = merged
    return _device_info(s, dev)


def pin_release(s: Session, device_id: str, model: str, number: int | None) -> DeviceInfo:
    dev = s.get(DeviceRow, device_id)
    if dev is None:
        raise not_found(f"device {device_id!r}")
    m = get_model(s, model)
    rid = None
    if number is not None:
        r = s.scalar(select(ReleaseRow).where(ReleaseRow.model_id == m.id, ReleaseRow.number == number))
        if r is None:
            raise not_found(f"release {number} of model {model!r}")
        rid = r.id
    dm = s.get(DeviceModelRow, (device_id, m.id))
    if dm is None:
        dm = DeviceModelRow(device_id=device_id, model_id=m.id, last_seq=0)
        s.add(dm)
    dm.pinned_release_id = rid
    s.flush()
    return _device_info(s, dev)


def registry_status(s: Session, model: str | None = None) -> RegistryStatus:
    total = s.scalar(select(func.count()).select_from(DeviceRow)) or 0
    models = [get_model(s, model)] if model else list(s.scalars(select(ModelRow).order_by(ModelRow.name)).all())
    out = []
    for m in models:
        counts: dict[int, dict[str, int]] = {}
        for number, state, n in s.execute(
                select(DeviceModelRow.release_number, DeviceModelRow.state, func.count())
                .where(DeviceModelRow.model_id == m.id, DeviceModelRow.state.is_not(None))
                .group_by(DeviceModelRow.release_number, DeviceModelRow.state)).all():
            if number is not None and state is not None:
                counts.setdefault(number, {})[state] = n
        ever = {number: n for number, n in s.execute(
            select(DeviceEventRow.release_number, func.count(func.distinct(DeviceEventRow.device_id)))
            .where(DeviceEventRow.model == m.name, DeviceEventRow.step == "committed")
            .group_by(DeviceEventRow.release_number)).all()}
        rels = []
        for r, version in s.execute(select(ReleaseRow, VersionRow.version)
                                    .join(VersionRow, VersionRow.id == ReleaseRow.version_id)
                                    .where(ReleaseRow.model_id == m.id).order_by(ReleaseRow.number)).all():
            rels.append(ReleaseStatus(release=r.number, version=version, revoked=r.revoked_at is not None,
                                      expires_at=r.expires_at, devices=counts.get(r.number, {}),
                                      committed_ever=int(ever.get(r.number, 0))))
        out.append(ModelStatus(model=m.name, releases=rels))
    return RegistryStatus(devices=total, models=out)
