"""Bring a database to the newest schema with Alembic, safely when several registry processes start at once.

PostgreSQL: a session advisory lock serialises concurrent upgrades. SQLite: a lock file
beside the database does (SQLite's own locking would let two processes both see an empty
schema and both try to create it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, text

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_PG_LOCK_KEY = 0x65646764  # "edgd"


def _alembic_config(conn: Connection) -> object:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def sqlite_path(engine: Engine) -> Path | None:
    db = engine.url.database
    return Path(db) if engine.dialect.name == "sqlite" and db and db != ":memory:" else None


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if (db := sqlite_path(engine)) is not None:
        lock = _file_lock(db.with_name(db.name + ".migrate-lock"))
    with lock, engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.commit()
        try:
            command.upgrade(_alembic_config(conn), revision)  # type: ignore[arg-type]
            conn.commit()
        finally:
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(_MIGRATIONS)).get_current_head()
