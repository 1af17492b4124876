"""Fleet rollouts: the rollouts table, the registry revision counter, and an index for per-release counts.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("target", sa.JSON(), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("salt", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("cutoffs", sa.JSON(), nullable=False),
        sa.Column("step_members", sa.Integer(), nullable=False),
        sa.Column("step_started_at", sa.Double(), nullable=False),
        sa.Column("step_ready_at", sa.Double(), nullable=True),
        sa.Column("baseline_version", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("gate_state", sa.JSON(), nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_rollouts_model_id_models", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["release_id"], ["releases.id"], name="fk_rollouts_release_id_releases",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_model_id_state", "rollouts", ["model_id", "state"])
    op.create_index("ix_rollouts_release_id", "rollouts", ["release_id"])
    meta = op.create_table(
        "registry_meta",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_registry_meta"),
    )
    op.bulk_insert(meta, [{"id": 1, "revision": 1}])
    op.create_index("ix_device_models_model_id_release_number", "device_models", ["model_id", "release_number"])


def downgrade() -> None:
    op.drop_index("ix_device_models_model_id_release_number", "device_models")
    op.drop_table("registry_meta")
    op.drop_table("rollouts")
