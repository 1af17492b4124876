"""Paced admission: a rollout step lets its new members in at a rate instead of all at once.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("admit_per_minute", sa.Double(), nullable=True))
        batch.add_column(sa.Column("admission", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("admission")
        batch.drop_column("admit_per_minute")
