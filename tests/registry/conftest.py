"""Fixtures shared by the registry and rollout tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.registry_helpers import PgCluster, pg_bin


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
