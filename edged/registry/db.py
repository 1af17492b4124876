"""The registry's tables (SQLAlchemy 2) and engine set-up for SQLite (embedded, WAL) and PostgreSQL.

Times are Unix seconds in double-precision columns: portable across both databases and
free of time-zone handling. The schema itself is created and evolved by the Alembic
migrations in ``edged/registry/migrations``; these classes must match them (a test checks).
The whole schema, these tables and the telemetry tables, is :func:`edged.registry.schema.metadata`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from edged.fsutil import make_private_dir, private_file

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ModelRow(Base):
    __tablename__ = "models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[float] = mapped_column(Double, default=now)


class BlobRow(Base):
    """One content-addressed file in the blob store."""

    __tablename__ = "blobs"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Double, default=now)


class VersionRow(Base):
    """An immutable model version: its ``model.toml`` and the files it is made of."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version", name="uq_model_versions_model_version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    manifest_toml: Mapped[str] = mapped_column(Text)
    total_size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Double, default=now)


class VersionFileRow(Base):
    __tablename__ = "version_files"
    __table_args__ = (UniqueConstraint("version_id", "path", name="uq_version_files_version_path"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)


class ReleaseRow(Base):
    """A signed release envelope as the operator uploaded it, plus indexed copies of its fields."""

    __tablename__ = "releases"
    __table_args__ = (UniqueConstraint("model_id", "number", name="uq_releases_model_number"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"))
    manifest_b64: Mapped[str] = mapped_column(Text)
    signature: Mapped[str] = mapped_column(String(128))
    key_id: Mapped[str] = mapped_column(String(32))
    selector: Mapped[dict[str, Any]] = mapped_column(JSON)
    issued_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    notes: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Double, default=now)
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # a rollback release: the number of the earlier release whose version it brings back
    restores: Mapped[int | None] = mapped_column(Integer, nullable=True)


class DeviceRow(Base):
    __tablename__ = "devices"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    credential_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # What old devices reported about themselves; kept for reference, never used for targeting.
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    admin_labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # set by operators: the only labels
    facts: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    serving: Mapped[list[Any]] = mapped_column(JSON, default=list)
    enrolled_at: Mapped[float] = mapped_column(Double, default=now)
    last_seen_at: Mapped[float | None] = mapped_column(Double, nullable=True)

    def effective_labels(self) -> dict[str, str]:
        """Labels are operator-owned: a device cannot move itself into another rollout or release."""
        return dict(self.admin_labels)


class EnrollmentTokenRow(Base):
    __tablename__ = "enrollment_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    uses_left: Mapped[int] = mapped_column(Integer)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[float] = mapped_column(Double, default=now)
    expires_at: Mapped[float] = mapped_column(Double)
    # Set by an operator's re-enrollment: the token replaces this existing device's credential, nothing else.
    device_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class DeviceModelRow(Base):
    """Per device and model: the pinned desired release (if any) and the last reported state."""

    __tablename__ = "device_models"
    __table_args__ = (Index("ix_device_models_model_id_release_number", "model_id", "release_number"),)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), primary_key=True)
    pinned_release_id: Mapped[int | None] = mapped_column(ForeignKey("releases.id", ondelete="SET NULL"),
                                                          nullable=True)
    state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    release_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)


class QualityScoreRow(Base):
    """A device's evaluation-set score for a release at trial start, and its last-known-good's on the same set."""

    __tablename__ = "quality_scores"
    __table_args__ = (Index("ix_quality_scores_model_id_release_number", "model_id", "release_number"),)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), primary_key=True)
    release_number: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    metric: Mapped[str] = mapped_column(String(32))
    samples: Mapped[int] = mapped_column(Integer)
    score: Mapped[float] = mapped_column(Double)
    baseline_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    baseline_score: Mapped[float | None] = mapped_column(Double, nullable=True)
    received_at: Mapped[float] = mapped_column(Double, default=now)


class DeviceEventRow(Base):
    __tablename__ = "device_events"
    __table_args__ = (UniqueConstraint("device_id", "seq", name="uq_device_events_device_seq"),
                      Index("ix_device_events_device_id_id", "device_id", "id"))
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    model: Mapped[str] = mapped_column(String(128))
    step: Mapped[str] = mapped_column(String(32))
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    release_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    device_time: Mapped[float] = mapped_column(Double)
    received_at: Mapped[float] = mapped_column(Double, default=now)


class RolloutRow(Base):
    """A release going out to a target in steps, with health gates (see :mod:`edged.registry.rollouts`).

    ``cutoffs`` holds, per step reached, the stable-hash rank under which a device is a member
    (percent steps) or null (group steps); it only grows, so no device flips out of a rollout.
    ``admission``, while a percent step still lets its new members in at ``admit_per_minute``,
    is the ramp of its cutoff (see :class:`edged.registry.targets.Ramp`); null once all are in.
    A ``scheduled`` rollout has no step yet: the evaluator starts it at ``start_at``.
    """

    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_model_id_state", "model_id", "state"),
                      Index("ix_rollouts_release_id", "release_id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    release_id: Mapped[int] = mapped_column(ForeignKey("releases.id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16))
    target: Mapped[dict[str, Any]] = mapped_column(JSON)
    steps: Mapped[list[Any]] = mapped_column(JSON)
    gates: Mapped[dict[str, Any]] = mapped_column(JSON)
    salt: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(Integer, default=0)
    cutoffs: Mapped[list[Any]] = mapped_column(JSON, default=list)
    step_members: Mapped[int] = mapped_column(Integer, default=0)
    step_started_at: Mapped[float] = mapped_column(Double)
    step_ready_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    baseline_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    gate_state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    notes: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Double, default=now)
    updated_at: Mapped[float] = mapped_column(Double, default=now)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    admit_per_minute: Mapped[float | None] = mapped_column(Double, nullable=True)
    admission: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    start_at: Mapped[float | None] = mapped_column(Double, nullable=True)  # when it starts (or started)


class DashboardSessionRow(Base):
    """A dashboard session that is still open: signing out deletes it, so its cookie stops working at once in
    every registry process (the cookie's MAC alone could only expire). Keyed by the nonce's sha256."""

    __tablename__ = "dashboard_sessions"
    __table_args__ = (Index("ix_dashboard_sessions_expires_at", "expires_at"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    who: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[float] = mapped_column(Double)
    created_at: Mapped[float] = mapped_column(Double, default=now)


class RegistryMetaRow(Base):
    """One row: ``revision`` grows with every change to releases or rollouts.

    Each process caches what every device poll needs (releases, rollouts) and reloads it
    only when this number moved, so a poll costs one indexed query however large the fleet.
    """

    __tablename__ = "registry_meta"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, default=0)


READONLY = "edged_readonly"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (see _WriteGate.begin)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes, fast commits
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


class _WriteGate:
    """One writer at a time per process, queued on a Python lock instead of SQLite's busy handler.

    SQLite's busy handler sleeps in growing steps (up to 100 ms) while another connection holds
    the write lock, so under many concurrent writers the lock sits idle between them and
    throughput collapses. Queuing writers of this process on a lock hands it over at once;
    ``BEGIN IMMEDIATE`` then waits only for other processes.
    """

    KEY = "edged_write_gate"

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def begin(self, conn: Any) -> None:
        # Take the write lock up front: a deferred transaction that reads and then writes fails at
        # once with SQLITE_BUSY when another process committed in between, instead of waiting.
        # Read-only work (device polls) runs on ``readonly(engine)`` and never takes it: in WAL
        # mode readers neither wait for nor block the writer.
        if conn.get_execution_options().get(READONLY):
            conn.exec_driver_sql("BEGIN")
            return
        self.lock.acquire()
        conn.info[self.KEY] = conn.info.get(self.KEY, 0) + 1
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            self.end(conn)
            raise

    def end(self, conn: Any) -> None:
        self._release(conn.info)

    def checkin(self, _dbapi_conn: Any, record: Any) -> None:
        self._release(record.info)  # a connection returned without commit or rollback (should not happen)

    def _release(self, info: dict[str, Any]) -> None:
        n = info.pop(self.KEY, 0)
        try:
            for _ in range(n):
                self.lock.release()
        except RuntimeError:  # released from another thread than the one that began: never expected
            logging.getLogger(__name__).error("SQLite write gate released by a foreign thread")


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for ``sqlite:///path`` or ``postgresql+psycopg://...``.

    A SQLite file is made 0600 (its folder 0700) before SQLite opens it, whatever the umask;
    SQLite gives its -wal and -shm files the database file's mode.
    """
    if url.startswith("sqlite"):
        db = make_url(url).database
        if db and db != ":memory:" and not db.startswith("file:"):
            make_private_dir(Path(db).parent)
            private_file(Path(db))
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False, "timeout": 10},
                               pool_size=16, max_overflow=48)
        event.listen(engine, "connect", _sqlite_pragmas)
        gate = _WriteGate()
        event.listen(engine, "begin", gate.begin)
        event.listen(engine, "commit", gate.end)
        event.listen(engine, "rollback", gate.end)
        event.listen(engine.pool, "checkin", gate.checkin)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20)


def readonly(engine: Engine) -> Engine:
    """An engine for work that only reads: device polls, and operators' pages.

    SQLite: the same engine and pool, in transactions that never take the write lock.
    PostgreSQL: a pool of its own in autocommit and without a ping at checkout. A device's poll
    is one SELECT; the BEGIN, the ROLLBACK and the ping around it were three more round trips to
    the server, each waiting on a busy machine for the server process to be scheduled while the
    event loop stood still. Reads lose nothing by it (READ COMMITTED gives every statement its
    own snapshot either way); a connection the server dropped fails one read, and the pool is
    renewed then.
    """
    if engine.dialect.name != "postgresql":
        return engine.execution_options(**{READONLY: True})
    return create_engine(engine.url, pool_size=10, max_overflow=20,
                         isolation_level="AUTOCOMMIT").execution_options(**{READONLY: True})


def make_sessionmaker(engine: Engine) -> sessionmaker[Any]:
    return sessionmaker(engine, expire_on_commit=False)
