"""Telemetry: uploaded samples, their per-model windows, per-device totals and drop accounting.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "telemetry_samples",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("buffer_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("run", sa.String(64), nullable=False),
        sa.Column("t", sa.Double(), nullable=False),
        sa.Column("window_s", sa.Double(), nullable=False),
        sa.Column("profile", sa.String(128), nullable=True),
        sa.Column("system", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name="fk_telemetry_samples_device_id_devices",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_telemetry_samples"),
        sa.UniqueConstraint("device_id", "buffer_id", "seq", name="uq_telemetry_samples_device_buffer_seq"),
    )
    op.create_index("ix_telemetry_samples_device_id_t", "telemetry_samples", ["device_id", "t"])
    op.create_index("ix_telemetry_samples_received_at", "telemetry_samples", ["received_at"])
    op.create_table(
        "telemetry_model_samples",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("sample_id", _ID, nullable=False),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("t", sa.Double(), nullable=False),
        sa.Column("window_s", sa.Double(), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("success", sa.BigInteger(), nullable=False),
        sa.Column("failures", sa.BigInteger(), nullable=False),
        sa.Column("failures_by_code", sa.JSON(), nullable=False),
        sa.Column("inferences", sa.BigInteger(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("latency_counts", sa.JSON(), nullable=False),
        sa.Column("latency_sum_s", sa.Double(), nullable=False),
        sa.Column("p50_s", sa.Double(), nullable=True),
        sa.Column("p99_s", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["sample_id"], ["telemetry_samples.id"],
                                name="fk_telemetry_model_samples_sample_id_telemetry_samples", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_telemetry_model_samples"),
    )
    op.create_index("ix_telemetry_model_samples_model_t", "telemetry_model_samples", ["model", "t"])
    op.create_index("ix_telemetry_model_samples_sample_id", "telemetry_model_samples", ["sample_id"])
    op.create_table(
        "telemetry_devices",
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("samples_total", sa.BigInteger(), nullable=False),
        sa.Column("buffer_id", sa.String(64), nullable=False),
        sa.Column("buffer_dropped", sa.BigInteger(), nullable=False),
        sa.Column("dropped_before", sa.BigInteger(), nullable=False),
        sa.Column("last_t", sa.Double(), nullable=True),
        sa.Column("last_received_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name="fk_telemetry_devices_device_id_devices",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("device_id", name="pk_telemetry_devices"),
    )


def downgrade() -> None:
    for table in ("telemetry_devices", "telemetry_model_samples", "telemetry_samples"):
        op.drop_table(table)
