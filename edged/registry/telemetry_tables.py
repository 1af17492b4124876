"""The registry's telemetry tables (SQLAlchemy 2, on the registry's declarative base).

Kept apart from the router so the registry can register them whenever its metadata is
loaded (``edged/registry/db.py`` imports this module at its end): Alembic's
autogenerate and the schema check then see the same tables the ``0002_telemetry``
migration creates, with or without the API being imported.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from edged.registry.db import Base, now

_ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only an INTEGER primary key


class TelemetrySampleRow(Base):
    """One uploaded sample: its identity, window and the device-wide part (as JSON)."""

    __tablename__ = "telemetry_samples"
    __table_args__ = (UniqueConstraint("device_id", "buffer_id", "seq", name="uq_telemetry_samples_device_buffer_seq"),
                      Index("ix_telemetry_samples_device_id_t", "device_id", "t"),
                      Index("ix_telemetry_samples_received_at", "received_at"))
    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    buffer_id: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(BigInteger)
    run: Mapped[str] = mapped_column(String(64))
    t: Mapped[float] = mapped_column(Double)
    window_s: Mapped[float] = mapped_column(Double)
    profile: Mapped[str | None] = mapped_column(String(128), nullable=True)
    system: Mapped[dict[str, Any]] = mapped_column(JSON)
    received_at: Mapped[float] = mapped_column(Double, default=now)


class TelemetryModelRow(Base):
    """One model version's window within a sample (device and time copied for the per-model queries)."""

    __tablename__ = "telemetry_model_samples"
    __table_args__ = (Index("ix_telemetry_model_samples_model_t", "model", "t"),
                      Index("ix_telemetry_model_samples_sample_id", "sample_id"))
    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    sample_id: Mapped[int] = mapped_column(ForeignKey("telemetry_samples.id", ondelete="CASCADE"))
    device_id: Mapped[str] = mapped_column(String(128))
    t: Mapped[float] = mapped_column(Double)
    window_s: Mapped[float] = mapped_column(Double)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(64))
    success: Mapped[int] = mapped_column(BigInteger)
    failures: Mapped[int] = mapped_column(BigInteger)
    failures_by_code: Mapped[dict[str, Any]] = mapped_column(JSON)
    inferences: Mapped[int] = mapped_column(BigInteger)
    in_flight: Mapped[int] = mapped_column(Integer)
    latency_counts: Mapped[list[Any]] = mapped_column(JSON)
    latency_sum_s: Mapped[float] = mapped_column(Double)
    p50_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    p99_s: Mapped[float | None] = mapped_column(Double, nullable=True)


class TelemetryDeviceRow(Base):
    """Per device: totals, and drop accounting from the device's per-buffer running count."""

    __tablename__ = "telemetry_devices"
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True)
    samples_total: Mapped[int] = mapped_column(BigInteger, default=0)
    buffer_id: Mapped[str] = mapped_column(String(64), default="")
    buffer_dropped: Mapped[int] = mapped_column(BigInteger, default=0)  # the current buffer's running total
    dropped_before: Mapped[int] = mapped_column(BigInteger, default=0)  # totals of earlier buffers
    last_t: Mapped[float | None] = mapped_column(Double, nullable=True)
    last_received_at: Mapped[float | None] = mapped_column(Double, nullable=True)
