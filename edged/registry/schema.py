"""The registry's whole schema: every module that declares tables, named here so the metadata is complete.

Alembic's environment and the schema check read :func:`metadata`; code that only queries imports
the table module it needs. A new table module is added to ``TABLE_MODULES``.
"""

from __future__ import annotations

from sqlalchemy import MetaData

from edged.registry import access_tables, db, telemetry_tables

# Each declares its tables on db.Base's one metadata when imported.
TABLE_MODULES = (db, telemetry_tables, access_tables)


def metadata() -> MetaData:
    """The metadata of every registry table (the core tables and the telemetry tables)."""
    return db.Base.metadata
