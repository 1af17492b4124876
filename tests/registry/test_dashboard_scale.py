"""What the dashboard's reads cost and what the fleet page's filters keep, on a real (migrated) SQLite database.

The fleet page reads the whole fleet in a fixed number of statements however many devices
there are, and every open page shares one such read per period (views.FleetCache); the
models page's read does not grow with the fleet either. The browser test
(test_dashboard.py) shows the same filters on the page; bench/dashboard_cost.py measures
the time at 10,000 devices.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from edged.registry import desired, service
from edged.registry.db import DeviceModelRow, DeviceRow, make_engine, make_sessionmaker
from edged.registry.lastseen import LastSeen
from edged.registry.migrate import upgrade
from edged.registry.settings import RegistrySettings
from edged.registry.web import views
from tests.registry.test_rollout_scale import Statements, populate

ONLINE_S = 60.0


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def read(engine: Engine, cache: desired.SnapshotCache) -> views.FleetRows:
    with make_sessionmaker(engine)() as s, s.begin():
        return views.fleet_rows(s, cache.get(s.connection()), online_s=ONLINE_S)


def sql_of(count: Statements) -> list[str]:
    return [q for q in count.take() if q.split(" ")[0] not in ("BEGIN", "ROLLBACK", "COMMIT")]


def test_the_fleet_read_does_not_grow_with_the_fleet(tmp_path: Path) -> None:
    made = []
    for n in (5, 300):
        engine = make_engine(f"sqlite:///{tmp_path / f'r{n}.db'}")
        upgrade(engine)
        populate(engine, n)
        cache = desired.SnapshotCache()
        read(engine, cache)  # the snapshot is loaded once per process, as in the server
        count = Statements(engine)
        rows = read(engine, cache)
        made.append((len(rows.rows), sql_of(count)))
        count.take()
        with make_sessionmaker(engine)() as s, s.begin():
            views.models(s, time.time() - 900, bucket_s=10)
        made.append((n, sql_of(count)))
        engine.dispose()
    (n5, fleet5), (_, models5), (n300, fleet300), (_, models300) = made
    assert (n5, n300) == (5, 300)
    assert len(fleet5) == len(fleet300) <= 6, fleet300  # revision, models, devices, their models, engines x 2 models
    assert all(q.lstrip().upper().startswith("SELECT") for q in fleet300)
    assert len(models5) == len(models300), models300


def test_fleet_counts_and_filters(db: Engine) -> None:
    populate(db, 40)
    now = time.time()
    with make_sessionmaker(db)() as s, s.begin():
        # dev-0..9 at site b on a Jetson profile; even devices called recently; dev-3 rolled back with a reason
        s.execute(update(DeviceRow).where(DeviceRow.id.in_([f"dev-{i}" for i in range(10)]))
                  .values(admin_labels={"site": "b"}, facts={"profile": "jetson-orin", "jetson.module": "Orin NX"}))
        s.execute(update(DeviceRow).where(DeviceRow.id.in_([f"dev-{i}" for i in range(0, 40, 2)]))
                  .values(last_seen_at=now))
        s.execute(update(DeviceRow).where(DeviceRow.id == "dev-5").values(serving=[
            {"model": "alpha", "version": 2, "release": 2, "state": "committed"}]))
        s.execute(update(DeviceModelRow).where(DeviceModelRow.device_id == "dev-3")
                  .values(state="rolled-back", reason="trial failed: error rate 0.4 > 0.05", updated_at=now))
        service.bump_revision(s)
    every = read(db, desired.SnapshotCache())

    def shown(**kw: str) -> list[str]:
        return [r.id for r in views.fleet(every, views.FleetFilter(**kw), limit=1000).rows]

    page = views.fleet(every, views.FleetFilter(), limit=15, offset=30)
    assert page.counts["devices"] == 40 and page.counts["online"] == 20 and page.counts["offline"] == 20
    assert page.counts["error"] == 1
    assert page.matching == 40 and len(page.rows) == 10 and page.shown_from == 30
    assert page.profiles == ["jetson-orin", "x86-64-cpu"] and page.label_keys == ["site"]
    assert sorted(shown(label="site=b"), key=lambda d: int(d[4:])) == [f"dev-{i}" for i in range(10)]
    assert shown(label="site = b") == shown(label="site=b")
    assert shown(label="site=nowhere") == []
    assert set(shown(profile="jetson-orin")) == set(shown(label="site=b"))
    assert all(int(d[4:]) % 2 == 0 for d in shown(state="online")) and len(shown(state="online")) == 20
    assert len(shown(state="offline")) == 20
    assert shown(state="error") == ["dev-3"]
    row = next(r for r in every.rows if r.id == "dev-3")
    assert row.last_error == "alpha: trial failed: error rate 0.4 > 0.05"
    assert next(r for r in every.rows if r.id == "dev-1").accelerator == "Jetson Orin NX"
    # dev-5 reports alpha release 2 while the registry would give it 2 or 3 (half the fleet is in alpha's
    # rollout to 3): the off-target filter keeps exactly those whose report differs from the decision
    off = set(shown(state="off-target"))
    assert off == {r.id for r in every.rows if any(sv.release != sv.want_release and sv.want_release is not None
                                                   for sv in r.serving)}
    assert len(off) == page.counts["off-target"] and "dev-0" in off  # dev-0 serves nothing it should
    # a model filter keeps devices with a line for that model (reported or expected)
    assert len(shown(model="alpha")) == 40 and len(shown(model="gamma")) == 0
    # filters combine
    assert set(shown(label="site=b", state="online")) == {f"dev-{i}" for i in range(0, 10, 2)}


def test_open_pages_share_one_fleet_read(db: Engine) -> None:
    populate(db, 20)
    snaps = desired.SnapshotCache()
    cache = views.FleetCache(ttl_s=60)
    count = Statements(db)
    sessions = make_sessionmaker(db)

    def get() -> views.FleetRows:
        with sessions() as s, s.begin():
            return cache.get(s, snaps.get(s.connection()), online_s=ONLINE_S)

    first = get()
    count.take()
    for _ in range(5):
        assert get() is first
    assert cache.reads == 1
    # only the revision check each time, never the fleet again
    assert all("registry_meta" in q for q in sql_of(count))
    with sessions() as s, s.begin():  # a release or rollout change: the next page read sees it
        service.bump_revision(s)
    assert get() is not first and cache.reads == 2
    # the period stretches with the read's cost: 0 s asked, but never more often than 1e6 x its last duration
    slow = views.FleetCache(ttl_s=0, cost_factor=1e6)
    with sessions() as s, s.begin():
        a = slow.get(s, snaps.get(s.connection()), online_s=ONLINE_S)
        assert slow.get(s, snaps.get(s.connection()), online_s=ONLINE_S) is a
    fresh = views.FleetCache(ttl_s=0, cost_factor=0)
    with Session(db) as s:
        a = fresh.get(s, snaps.get(s.connection()), online_s=ONLINE_S)
        assert fresh.get(s, snaps.get(s.connection()), online_s=ONLINE_S) is not a


def test_shared_reads_are_per_key_and_revision() -> None:
    """The models page shares its read per chart window the same way (router: models_read)."""
    shared: views.SharedRead[list[str]] = views.SharedRead(ttl_s=60)
    calls: list[str] = []

    def read(what: str) -> list[str]:
        calls.append(what)
        return [what]

    a = shared.get("15m", 1, lambda: read("15m"))
    assert shared.get("15m", 1, lambda: read("again")) is a
    assert shared.get("1h", 1, lambda: read("1h")) == ["1h"]
    assert shared.get("15m", 2, lambda: read("15m new")) == ["15m new"]  # a release or rollout changed
    assert calls == ["15m", "1h", "15m new"] and shared.reads == 3


@pytest.mark.parametrize(("online_s", "flush_s"), [(10.0, 0.5), (10.0, 5.0), (180.0, 5.0)])
def test_a_device_that_keeps_calling_is_online_at_every_moment(db: Engine, online_s: float, flush_s: float) -> None:
    """Polls only note last-seen times, written coarsely and in batches; however short the online
    window, a device polling every second is never shown offline between two writes (a 10 s window
    with the former fixed 60 s resolution showed the whole fleet offline for 50 s of every minute)."""
    populate(db, 1)
    settings = RegistrySettings(dashboard_online_s=online_s, last_seen_flush_s=flush_s)
    seen = LastSeen(db, flush_s=flush_s, resolution_s=settings.last_seen_resolution_s)
    cache = desired.SnapshotCache()
    sessions = make_sessionmaker(db)
    t0, offline, next_flush = time.time(), [], flush_s
    for step in range(int(4 * online_s)):  # four windows of a poll a second, on a simulated clock
        t = t0 + step
        with sessions() as s:
            dev = s.get(DeviceRow, "dev-0")
            assert dev is not None
            seen.note("dev-0", dev.last_seen_at, now=t)
        if step >= next_flush:
            seen.flush()
            next_flush += flush_s
        with sessions() as s, s.begin():
            row = views.fleet_rows(s, cache.get(s.connection()), online_s=online_s, now=t).rows[0]
        if step > flush_s and not row.online:  # the first call is written at the first flush
            offline.append(step)
    assert offline == [], f"shown offline at seconds {offline} while polling every second"
    assert seen.written < 4 * online_s / 2, "a last-seen write for (nearly) every poll"


def test_a_flush_period_as_long_as_the_online_window_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"last_seen_flush_s .* must be below dashboard_online_s"):
        RegistrySettings(dashboard_online_s=5.0, last_seen_flush_s=5.0)
