"""Enrollment tokens an operator issues to re-enroll one existing device (``devices reenroll``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("enrollment_tokens") as batch:
        batch.add_column(sa.Column("device_id", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("enrollment_tokens") as batch:
        batch.drop_column("device_id")
