"""Alembic environment: runs on the connection handed over by :func:`edged.registry.migrate.upgrade`."""

from __future__ import annotations

from alembic import context

from edged.registry.schema import metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reached when someone runs the alembic CLI directly
    raise RuntimeError("run migrations with `edged-registry migrate`, which supplies the database connection")

context.configure(connection=connection, target_metadata=metadata(), render_as_batch=True,
                  compare_type=True)
with context.begin_transaction():
    context.run_migrations()
