"""Fleet rollbacks and the output-quality gate: which release a rollback release restores, and
the evaluation-set scores devices report at trial start.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.add_column(sa.Column("restores", sa.Integer(), nullable=True))
    op.create_table(
        "quality_scores",
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("release_number", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(32), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("score", sa.Double(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=True),
        sa.Column("baseline_score", sa.Double(), nullable=True),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name="fk_quality_scores_device_id_devices",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_quality_scores_model_id_models",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("device_id", "model_id", "release_number", name="pk_quality_scores"),
    )
    op.create_index("ix_quality_scores_model_id_release_number", "quality_scores", ["model_id", "release_number"])


def downgrade() -> None:
    op.drop_index("ix_quality_scores_model_id_release_number", "quality_scores")
    op.drop_table("quality_scores")
    with op.batch_alter_table("releases") as batch:
        batch.drop_column("restores")
