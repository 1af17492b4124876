"""Initial registry schema: models, versions, blobs, signed releases, devices, enrollment, reports.

Revision ID: 0001
Revises:
Create Date: 2026-05-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_models"),
        sa.UniqueConstraint("name", name="uq_models_name"),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name="pk_blobs"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("manifest_toml", sa.Text(), nullable=False),
        sa.Column("total_size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_model_versions_model_id_models",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_model_versions"),
        sa.UniqueConstraint("model_id", "version", name="uq_model_versions_model_version"),
    )
    op.create_table(
        "version_files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["sha256"], ["blobs.sha256"], name="fk_version_files_sha256_blobs"),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"],
                                name="fk_version_files_version_id_model_versions", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_version_files"),
        sa.UniqueConstraint("version_id", "path", name="uq_version_files_version_path"),
    )
    op.create_index("ix_version_files_version_id", "version_files", ["version_id"])
    op.create_index("ix_version_files_sha256", "version_files", ["sha256"])
    op.create_table(
        "releases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("manifest_b64", sa.Text(), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("issued_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_releases_model_id_models", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"], name="fk_releases_version_id_model_versions"),
        sa.PrimaryKeyConstraint("id", name="pk_releases"),
        sa.UniqueConstraint("model_id", "number", name="uq_releases_model_number"),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("credential_hash", sa.String(64), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("admin_labels", sa.JSON(), nullable=False),
        sa.Column("facts", sa.JSON(), nullable=False),
        sa.Column("serving", sa.JSON(), nullable=False),
        sa.Column("enrolled_at", sa.Double(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_devices"),
        sa.UniqueConstraint("credential_hash", name="uq_devices_credential_hash"),
    )
    op.create_table(
        "enrollment_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("uses_left", sa.Integer(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_enrollment_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_enrollment_tokens_token_hash"),
    )
    op.create_table(
        "device_models",
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("pinned_release_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(32), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("release_number", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=True),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name="fk_device_models_device_id_devices",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_device_models_model_id_models",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["pinned_release_id"], ["releases.id"],
                                name="fk_device_models_pinned_release_id_releases", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("device_id", "model_id", name="pk_device_models"),
    )
    op.create_table(
        "device_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("step", sa.String(32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("release_number", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("device_time", sa.Double(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name="fk_device_events_device_id_devices",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_device_events"),
        sa.UniqueConstraint("device_id", "seq", name="uq_device_events_device_seq"),
    )
    op.create_index("ix_device_events_device_id_id", "device_events", ["device_id", "id"])


def downgrade() -> None:
    for table in ("device_events", "device_models", "enrollment_tokens", "devices", "releases",
                  "version_files", "model_versions", "blobs", "models"):
        op.drop_table(table)
