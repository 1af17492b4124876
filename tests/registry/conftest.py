"""Fixtures shared by the registry and rollout tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.registry_helpers import ADMIN_TOKEN, Keys, PgCluster, RegistryServer, pg_bin


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster | None]:
    """One PostgreSQL cluster for the session (each test environment makes its own database in it)."""
    if pg_bin() is None:
        yield None
        return
    cluster = PgCluster()
    try:
        cluster.start()
    except Exception as e:
        cluster.stop()
        pytest.skip(f"could not start a PostgreSQL cluster: {e}")
    yield cluster
    cluster.stop()


@dataclass
class Env:
    """A running registry on one database backend, with its signing keys."""

    backend: str
    tmp: Path
    keys: Keys
    server: RegistryServer
    database_url: str | None

    @property
    def url(self) -> str:
        return self.server.url

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def registry_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str,
                 extra_args: Sequence[str] = ()) -> Iterator[Env]:
    """The body of a module's ``env`` fixture parametrized over ``sqlite`` and ``postgresql``."""
    tmp = tmp_path_factory.mktemp(f"{name}-{request.param}")
    db_url = None
    if request.param == "postgresql":
        cluster = request.getfixturevalue("pg_cluster")
        if cluster is None:
            pytest.skip("PostgreSQL is not installed (apt-get install postgresql); the SQLite run covers the rest")
        db_url = cluster.new_database()
    keys = Keys.make(tmp)
    server = RegistryServer(tmp, [keys.public], database_url=db_url, extra_args=list(extra_args)).start()
    yield Env(request.param, tmp, keys, server, db_url)
    server.stop()
