"""What a poll costs the registry, counted in SQL statements on a real (migrated) SQLite database.

A device poll must cost the same however large the fleet and however many releases and
rollouts there are: one read-only statement once the process has its snapshot, no write
(last-seen times are batched). Listing devices must not make a query per device.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session

from edged.registry import desired, service
from edged.registry.auth import token_hash
from edged.registry.db import (
    DeviceModelRow,
    DeviceRow,
    ModelRow,
    ReleaseRow,
    RolloutRow,
    VersionRow,
    make_engine,
    make_sessionmaker,
    readonly,
)
from edged.registry.lastseen import LastSeen
from edged.registry.migrate import upgrade


class Statements:
    def __init__(self, engine: Engine) -> None:
        self.sql: list[str] = []
        event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.sql.append(statement)

    def take(self) -> list[str]:
        out, self.sql = self.sql, []
        return out


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def populate(engine: Engine, devices: int, releases: int = 3) -> None:
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        for name in ("alpha", "beta"):
            m = ModelRow(name=name)
            s.add(m)
            s.flush()
            for n in range(1, releases + 1):
                v = VersionRow(model_id=m.id, version=n, manifest_toml="", total_size=1)
                s.add(v)
                s.flush()
                r = ReleaseRow(model_id=m.id, number=n, version_id=v.id,
                               manifest_b64=base64.b64encode(b"{}").decode(), signature="c2ln", key_id="k",
                               selector={"labels": {}, "devices": []}, issued_at=0, expires_at=2**40, notes="")
                s.add(r)
                s.flush()
            if name == "alpha":  # the newest alpha release is in a rollout at 50 %
                s.add(RolloutRow(model_id=m.id, release_id=r.id, state="running", target={}, steps=[{"percent": 50}],
                                 gates={}, salt="alpha", step=0, cutoffs=[0.5], step_members=0,
                                 step_started_at=time.time(), gate_state={}, notes=""))
        for i in range(devices):
            s.add(DeviceRow(id=f"dev-{i}", credential_hash=token_hash(f"cred-{i}"), labels={"site": "a"},
                            admin_labels={}, facts={"profile": "x86-64-cpu"}, serving=[], last_seen_at=None))
        s.flush()
        for i in range(devices):
            s.add(DeviceModelRow(device_id=f"dev-{i}", model_id=1, state="committed", version=2, release_number=2,
                                 last_seq=1))
        service.bump_revision(s)


def poll(engine: Engine, cache: desired.SnapshotCache, seen: LastSeen, i: int) -> desired.Desired:
    with readonly(engine).connect() as conn:
        view, rev = desired.lookup_credential(conn, token_hash(f"cred-{i}"))
        assert view is not None
        out = desired.decide(cache.get(conn, rev), view)
    seen.note(view.id, view.last_seen_at)
    return out


@pytest.mark.parametrize("devices", [5, 200])
def test_a_poll_is_one_read_whatever_the_fleet(db: Engine, devices: int) -> None:
    populate(db, devices)
    count = Statements(db)
    cache = desired.SnapshotCache()
    seen = LastSeen(db)
    poll(db, cache, seen, 0)
    assert cache.loads == 1
    count.take()
    answers = [poll(db, cache, seen, i) for i in range(devices)]
    sql = [q for q in count.take() if q not in ("BEGIN", "ROLLBACK", "COMMIT")]
    assert len(sql) == devices, sql[:5]  # one statement per poll, nothing else
    assert all(q.lstrip().upper().startswith("SELECT") for q in sql)
    assert {a.releases[0].model for a in answers} == {"alpha"}
    # half the fleet is in the rollout of alpha's release 3 (stable hashing), the rest stays on 2
    on3 = sum(1 for a in answers if a.releases[0].number == 3)
    assert 0 < on3 < devices or devices < 10
    assert all(a.releases[1].number == 3 for a in answers)  # beta has no rollout: its newest release
    # the ETag depends only on the decision
    assert poll(db, cache, seen, 1).etag() == answers[1].etag()
    # a change anywhere in releases or rollouts moves the revision: the next poll reloads the snapshot once
    with make_sessionmaker(db)() as s, s.begin():
        service.bump_revision(s)
    poll(db, cache, seen, 0)
    poll(db, cache, seen, 1)
    assert cache.loads == 2
    # last-seen times: one batched write for every device polled
    count.take()
    assert seen.flush() == devices
    writes = [q for q in count.take() if q.lstrip().upper().startswith("UPDATE")]
    assert len(writes) == 1
    with Session(db) as s:
        assert all(t is not None for t in s.scalars(select(DeviceRow.last_seen_at)))
    seen.note("dev-0", time.time())  # seen a moment ago: nothing to write
    assert seen.flush() == 0


@pytest.mark.parametrize("devices", [5, 200])
def test_listing_devices_does_not_query_per_device(db: Engine, devices: int) -> None:
    populate(db, devices)
    count = Statements(db)
    with make_sessionmaker(db)() as s:
        count.take()
        listed = service.list_devices(s)
        assert len(listed) == devices and listed[0].models[0].state == "committed"
        assert len([q for q in count.take() if q.lstrip().upper().startswith("SELECT")]) <= 2


def test_a_postgresql_poll_is_one_statement_in_autocommit_without_a_ping(pg_cluster: Any) -> None:
    """PostgreSQL: device reads run on a pool of their own, in autocommit and without a ping at checkout, so a
    poll is one round trip to the server (a transaction's BEGIN and ROLLBACK and a ping were three more)."""
    if pg_cluster is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    engine = make_engine(pg_cluster.new_database())
    upgrade(engine)
    populate(engine, 20)
    ro = readonly(engine)
    try:
        assert ro.pool is not engine.pool and not ro.pool._pre_ping  # type: ignore[attr-defined]
        count = Statements(ro)
        cache = desired.SnapshotCache()
        answers = []
        for i in range(20):
            with ro.connect() as conn:
                assert conn.connection.dbapi_connection.autocommit  # type: ignore[union-attr]
                view, rev = desired.lookup_credential(conn, token_hash(f"cred-{i}"))
                assert view is not None and view.id == f"dev-{i}"
                answers.append(desired.decide(cache.get(conn, rev), view))
        sql = count.take()
        assert cache.loads == 1 and len(sql) == 20 + 3, sql  # the snapshot's three reads, then one per poll
        assert all(q.lstrip().upper().startswith("SELECT") for q in sql)
        assert {a.releases[0].model for a in answers} == {"alpha"}
    finally:
        ro.dispose()
        engine.dispose()
