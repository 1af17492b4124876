"""The report writer's set-wise batches store exactly what writing each request on its own stores.

Against a real database (SQLite, and PostgreSQL where installed): the same requests, written as
one batch and one by one into two fresh databases, leave the same rows; a request that cannot be
stored fails alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from edged.protocol.fleet.messages import QualityReport, ReportEvent
from edged.registry.db import DeviceEventRow, DeviceModelRow, DeviceRow, ModelRow, QualityScoreRow, make_engine
from edged.registry.migrate import upgrade
from edged.registry.service import FactsWrite
from edged.registry.writer import ReportWriter, _Item
from tests.registry_helpers import PgCluster

DEVICES = ("dev-a", "dev-b", "dev-c")


@pytest.fixture(params=["sqlite", "postgresql"])
def engines(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, Engine]]:
    """Two fresh databases with the same devices and models."""
    urls = []
    for name in ("batch", "each"):
        if request.param == "sqlite":
            urls.append(f"sqlite:///{tmp_path / name}.db")
        else:
            cluster: PgCluster | None = request.getfixturevalue("pg_cluster")
            if cluster is None:
                pytest.skip("PostgreSQL is not installed (apt-get install postgresql); the SQLite run covers the rest")
            urls.append(cluster.new_database())
    made = []
    for url in urls:
        engine = make_engine(url)
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(DeviceRow.__table__.insert(), [
                {"id": d, "credential_hash": f"{i:064x}", "labels": {}, "admin_labels": {}, "facts": {"old": 1},
                 "serving": [], "enrolled_at": 0.0} for i, d in enumerate(DEVICES)])
            conn.execute(ModelRow.__table__.insert(), [{"name": "m1", "created_at": 0.0},
                                                       {"name": "m2", "created_at": 0.0}])
        made.append(engine)
    yield made[0], made[1]
    for engine in made:
        engine.dispose()


def ev(seq: int, step: str = "downloading", model: str = "m1", release: int = 2, **kw: Any) -> ReportEvent:
    return ReportEvent(seq=seq, model=model, step=step, version=release, release=release, at=1000.0 + seq, **kw)


def items() -> list[_Item]:
    quality = QualityReport(samples=30, score=0.9, baseline_version=1, baseline_score=0.95)

    def item(device: str, events: list[ReportEvent], facts: FactsWrite | None = None) -> _Item:
        return _Item(device, events, Future(), facts)

    return [
        item("dev-a", [ev(3, "prepared"), ev(1), ev(2, "verifying")]),  # out of order: the highest seq is the state
        item("dev-b", [ev(1), ev(1, model="m2", release=7)]),  # a repeated seq in one request counts once
        item("dev-a", [ev(2, "verifying"), ev(4, "active-trial", quality=quality)]),  # 2 again: only 4 is new
        item("dev-c", [], FactsWrite({"profile": "p"}, [{"model": "m1", "version": 2}])),
        item("dev-b", [ev(2, "committed", model="m2", release=7), ev(3, "failed", model="nope")]),
        item("dev-c", [ev(5, "failed", reason="disk full")]),
    ]


def rows(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {
            "events": sorted((r.device_id, r.seq, r.model, r.step, r.release_number, r.reason, r.detail)
                             for r in conn.execute(select(DeviceEventRow))),
            "models": sorted((r.device_id, r.model_id, r.last_seq, r.state, r.version, r.release_number, r.reason)
                             for r in conn.execute(select(DeviceModelRow))),
            "quality": sorted((r.device_id, r.release_number, r.score, r.baseline_score)
                              for r in conn.execute(select(QualityScoreRow))),
            "devices": sorted((r.id, r.facts, r.serving) for r in conn.execute(select(DeviceRow))),
        }


def results(its: list[_Item]) -> list[Any]:
    out = []
    for it in its:
        e = it.done.exception(timeout=5)
        out.append(type(e).__name__ if e is not None else it.done.result())
    return out


def test_a_batch_stores_what_one_request_at_a_time_stores(engines: tuple[Engine, Engine]) -> None:
    batch_db, each_db = engines
    batch, each = ReportWriter(batch_db), ReportWriter(each_db)
    a = items()
    batch._write(a)
    assert batch.transactions == 1  # one transaction: the set-wise path, no fallback
    b = items()
    one_by_one = [r for _, r in each._write_each(b, time.time())]
    assert results(a) == one_by_one == [3, 1, 1, 1, 2, 1]
    got = rows(batch_db)
    assert got == rows(each_db)  # the same rows, whichever way they were written
    assert [(d, f) for d, f, _ in got["devices"]] == [("dev-a", {"old": 1}), ("dev-b", {"old": 1}),
                                                       ("dev-c", {"profile": "p"})]
    states = {(r[0], r[1]): (r[2], r[3]) for r in got["models"]}
    assert states[("dev-a", 1)] == (4, "active-trial") and states[("dev-c", 1)] == (5, "failed")
    assert got["quality"] == [("dev-a", 2, 0.9, 0.95)]


def test_an_older_report_does_not_move_the_state_back(engines: tuple[Engine, Engine]) -> None:
    w = ReportWriter(engines[0])
    first = [_Item("dev-a", [ev(5, "committed")], Future())]
    w._write(first)
    late = [_Item("dev-a", [ev(4, "active-trial")], Future())]  # arrives after 5 (a resend from an outbox)
    w._write(late)
    assert results(first) == [1] and results(late) == [1]
    got = rows(engines[0])
    assert [(r[0], r[2], r[3]) for r in got["models"]] == [("dev-a", 5, "committed")]
    assert [r[1] for r in got["events"]] == [4, 5]


def test_a_request_that_cannot_be_stored_does_not_take_the_batch_with_it(engines: tuple[Engine, Engine]) -> None:
    w = ReportWriter(engines[0])
    its = [_Item("dev-a", [ev(1)], Future()), _Item("ghost", [ev(1)], Future()),  # deleted since it authenticated
           _Item("dev-b", [ev(1, "verifying")], Future())]
    w._write(its)
    assert results(its) == [1, 0, 1]  # the batch failed as a whole, then each request on its own
    assert [(r[0], r[3]) for r in rows(engines[0])["events"]] == [("dev-a", "downloading"), ("dev-b", "verifying")]
