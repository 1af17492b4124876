"""Group commit for device reports: one writer thread, many reports per transaction.

During a rollout thousands of devices report each step within seconds. One transaction
per request would serialise them on the database's write lock (SQLite) or on commits
(PostgreSQL), and with many request threads each writer also waits for the interpreter
lock between statements while holding the database's; the queue turns that into a
handful of transactions per second, each carrying every report that arrived meanwhile.
Each request still learns its own result: its reports are recorded in a savepoint of
their own, so one bad batch fails alone. Statements are SQLAlchemy Core (a handful per
request) rather than ORM units of work: this is the registry's busiest write path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from edged.protocol.fleet.messages import ReportEvent
from edged.registry.db import DeviceEventRow, DeviceModelRow, ModelRow, QualityScoreRow
from edged.registry.service import json_safe

log = logging.getLogger(__name__)


@dataclass
class _Item:
    device_id: str
    events: list[ReportEvent]
    done: Future[int]


class ReportWriter:
    def __init__(self, engine: Engine, *, max_batch: int = 500) -> None:
        self.engine, self.max_batch = engine, max_batch
        self._models: dict[str, int] = {}
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.transactions = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="registry-reports", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(30)
            self._thread = None

    def submit(self, device_id: str, events: list[ReportEvent]) -> Future[int]:
        """Queue a device's reports; the future gives how many were new once they are committed."""
        fut: Future[int] = Future()
        if self._thread is None:
            fut.set_exception(RuntimeError("the report writer is not running"))
            return fut
        self._q.put(_Item(device_id, events, fut))
        return fut

    def _loop(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            items = [first]
            stop = False
            while len(items) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                items.append(nxt)
            self._write(items)
            if stop:
                return

    def _write(self, items: list[_Item]) -> None:
        results: list[tuple[_Item, int | BaseException]] = []
        t = time.time()
        try:
            with self.engine.begin() as conn:
                models = self._model_ids(conn, {e.model for it in items for e in it.events})
                for it in items:
                    try:
                        with conn.begin_nested():
                            results.append((it, store_reports(conn, it.device_id, it.events, models, t)))
                    except IntegrityError:
                        results.append((it, 0))  # the same reports committed concurrently elsewhere: nothing new
                    except Exception as e:
                        results.append((it, e))
            self.transactions += 1
        except Exception as e:
            log.exception("storing %d report batch(es) failed", len(items))
            results = [(it, e) for it in items]
        for it, r in results:
            if isinstance(r, BaseException):
                it.done.set_exception(r)
            else:
                it.done.set_result(r)

    def _model_ids(self, conn: Connection, names: set[str]) -> dict[str, int]:
        missing = names - self._models.keys()
        if missing:
            self._models.update({n: i for n, i in conn.execute(select(ModelRow.name, ModelRow.id)
                                                                 .where(ModelRow.name.in_(missing)))})
        return self._models


def store_reports(conn: Connection, device_id: str, events: list[ReportEvent], model_ids: dict[str, int],
                  t: float) -> int:
    """New events of one device (a repeated sequence number is ignored) and its per-model latest state."""
    if not events:
        return 0
    seen = set(conn.execute(select(DeviceEventRow.seq).where(
        DeviceEventRow.device_id == device_id, DeviceEventRow.seq.in_(sorted({e.seq for e in events})))).scalars())
    new: list[ReportEvent] = []
    latest: dict[int, ReportEvent] = {}
    for e in sorted(events, key=lambda e: e.seq):
        if e.seq in seen:
            continue
        seen.add(e.seq)
        new.append(e)
        mid = model_ids.get(e.model)
        if mid is not None:
            latest[mid] = e  # sorted: the last one wins
    if not new:
        return 0
    conn.execute(insert(DeviceEventRow), [
        {"device_id": device_id, "seq": e.seq, "model": e.model, "step": e.step, "version": e.version,
         "release_number": e.release, "reason": e.reason,
         "detail": json_safe({**e.detail, "quality": e.quality.model_dump()} if e.quality else e.detail),
         "device_time": e.at,
         "received_at": t} for e in new])
    for e in new:
        mid = model_ids.get(e.model)
        q = e.quality
        if q is not None and mid is not None and e.release is not None and e.version is not None:
            _store_quality(conn, device_id, mid, e, t)
    for mid, e in latest.items():
        values = {"last_seq": e.seq, "state": e.step, "version": e.version, "release_number": e.release,
                  "reason": e.reason, "updated_at": t}
        moved = conn.execute(update(DeviceModelRow).where(
            DeviceModelRow.device_id == device_id, DeviceModelRow.model_id == mid,
            DeviceModelRow.last_seq < e.seq).values(**values))
        if moved.rowcount == 0 and conn.execute(select(DeviceModelRow.last_seq).where(
                DeviceModelRow.device_id == device_id, DeviceModelRow.model_id == mid)).first() is None:
            conn.execute(insert(DeviceModelRow).values(device_id=device_id, model_id=mid, pinned_release_id=None,
                                                       **values))
    return len(new)


def _store_quality(conn: Connection, device_id: str, model_id: int, e: ReportEvent, t: float) -> None:
    """One row per device and release: a repeated trial (after a restart) replaces the earlier scores."""
    q = e.quality
    assert q is not None and e.release is not None and e.version is not None
    key = (QualityScoreRow.device_id == device_id, QualityScoreRow.model_id == model_id,
           QualityScoreRow.release_number == e.release)
    values = {"version": e.version, "metric": q.metric, "samples": q.samples, "score": q.score,
              "baseline_version": q.baseline_version, "baseline_score": q.baseline_score, "received_at": t}
    if conn.execute(update(QualityScoreRow).where(*key).values(**values)).rowcount == 0:
        conn.execute(insert(QualityScoreRow).values(device_id=device_id, model_id=model_id,
                                                    release_number=e.release, **values))
