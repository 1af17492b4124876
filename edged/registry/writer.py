"""Group commit for device writes: one writer thread, many reports and fact updates per transaction.

During a rollout thousands of devices report each step within seconds. One transaction
per request would serialise them on the database's write lock (SQLite) or on commits
(PostgreSQL), and with many request threads each writer also waits for the interpreter
lock between statements while holding the database's; the queue turns that into a
handful of transactions per second, each carrying every write that arrived meanwhile.

A batch is written set-wise: one query for the sequence numbers already stored, one for
the per-model rows, then one multi-row statement per kind of change (:func:`store_batch`),
so a batch of 500 costs a few statements rather than five per request; Python work per
statement, not the database, was what bounded a download wave (3 CPU ms per report).
When that transaction fails (a bad request, or another registry process inserted the same
row meanwhile), the batch is written again one request per savepoint, so one bad request
fails alone and each request still learns its own result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, insert, select, tuple_, update
from sqlalchemy.exc import IntegrityError

from edged.protocol.fleet.messages import ReportEvent
from edged.registry.db import DeviceEventRow, DeviceModelRow, DeviceRow, ModelRow, QualityScoreRow
from edged.registry.service import EVENT_LOGS, FactsWrite, json_safe

log = logging.getLogger(__name__)


@dataclass
class _Item:
    device_id: str
    events: list[ReportEvent]
    done: Future[int]
    facts: FactsWrite | None = None


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

    def backlog(self) -> int:
        """Writes queued and not yet taken by the writer thread."""
        return self._q.qsize()

    def submit(self, device_id: str, events: list[ReportEvent]) -> Future[int]:
        """Queue a device's reports; the future gives how many were new once they are committed."""
        return self._enqueue(_Item(device_id, events, Future()))

    def submit_facts(self, device_id: str, facts: FactsWrite) -> Future[int]:
        """Queue a device's changed facts; the future gives 1 once they are committed."""
        return self._enqueue(_Item(device_id, [], Future(), facts))

    def _enqueue(self, item: _Item) -> Future[int]:
        if self._thread is None:
            item.done.set_exception(RuntimeError("the report writer is not running"))
        else:
            self._q.put(item)
        return item.done

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
        t = time.time()
        results: list[tuple[_Item, int | BaseException]]
        try:
            with self.engine.begin() as conn:
                models = self._model_ids(conn, {e.model for it in items for e in it.events})
                counts = store_batch(conn, [(it.device_id, it.events, it.facts) for it in items], models, t)
            self.transactions += 1
            results = list(zip(items, counts, strict=True))
        except Exception as e:
            log.debug("batch of %d write(s) failed as a whole (%s); writing them one by one", len(items), e)
            results = self._write_each(items, t)
        for it, r in results:
            if isinstance(r, BaseException):
                it.done.set_exception(r)
            else:
                it.done.set_result(r)

    def _write_each(self, items: list[_Item], t: float) -> list[tuple[_Item, int | BaseException]]:
        results: list[tuple[_Item, int | BaseException]] = []
        try:
            with self.engine.begin() as conn:
                models = self._model_ids(conn, {e.model for it in items for e in it.events})
                for it in items:
                    try:
                        with conn.begin_nested():
                            if it.facts is not None:
                                results.append((it, store_facts(conn, [(it.device_id, it.facts)], t)))
                            else:
                                results.append((it, store_reports(conn, it.device_id, it.events, models, t)))
                    except IntegrityError:
                        results.append((it, 0))  # the same reports committed concurrently elsewhere: nothing new
                    except Exception as e:
                        results.append((it, e))
            self.transactions += 1
        except Exception as e:
            log.exception("storing %d device write(s) failed", len(items))
            results = [(it, e) for it in items]
        return results

    def _model_ids(self, conn: Connection, names: set[str]) -> dict[str, int]:
        missing = names - self._models.keys()
        if missing:
            self._models.update({n: i for n, i in conn.execute(select(ModelRow.name, ModelRow.id)
                                                                 .where(ModelRow.name.in_(missing)))})
        return self._models


def event_detail(e: ReportEvent) -> dict[str, Any]:
    """What an event row keeps beside its columns: the device's detail with its quality scores (JSON-safe, capped),
    and its log tail, bounded by the protocol already (a ``logs`` key in the free-form detail is not taken for it)."""
    detail = {k: v for k, v in e.detail.items() if k != EVENT_LOGS}
    out = json_safe({**detail, "quality": e.quality.model_dump()} if e.quality else detail)
    if e.logs:
        out[EVENT_LOGS] = list(e.logs)
    return out


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
         "detail": event_detail(e),
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


# Statements built once: each batch only binds values (SQLAlchemy's compiled cache then skips compiling).
_SEEN = select(DeviceEventRow.device_id, DeviceEventRow.seq)
_MODEL_ROWS = select(DeviceModelRow.device_id, DeviceModelRow.model_id, DeviceModelRow.last_seq)
_UPDATE_MODEL = (update(DeviceModelRow)
                 .where(DeviceModelRow.device_id == bindparam("k_device"),
                        DeviceModelRow.model_id == bindparam("k_model"), DeviceModelRow.last_seq < bindparam("v_seq"))
                 .values(last_seq=bindparam("v_seq"), state=bindparam("v_state"), version=bindparam("v_version"),
                         release_number=bindparam("v_release"), reason=bindparam("v_reason"),
                         updated_at=bindparam("v_at")))
_UPDATE_FACTS = (update(DeviceRow).where(DeviceRow.id == bindparam("k_device"))
                 .values(facts=bindparam("v_facts"), serving=bindparam("v_serving"), last_seen_at=bindparam("v_at")))
_CHUNK = 400  # pairs per IN list: well under SQLite's bound-parameter limit


def store_facts(conn: Connection, writes: list[tuple[str, FactsWrite]], t: float) -> int:
    if writes:
        conn.execute(_UPDATE_FACTS, [{"k_device": d, "v_facts": f.facts, "v_serving": f.serving, "v_at": t}
                                     for d, f in writes])
    return len(writes)


def _existing(conn: Connection, query: Any, cols: tuple[Any, Any], pairs: list[tuple[Any, Any]]) -> list[Any]:
    rows: list[Any] = []
    for i in range(0, len(pairs), _CHUNK):
        rows.extend(conn.execute(query.where(tuple_(*cols).in_(pairs[i:i + _CHUNK]))).all())
    return rows


def store_batch(conn: Connection, batch: list[tuple[str, list[ReportEvent], FactsWrite | None]],
                model_ids: dict[str, int], t: float) -> list[int]:
    """Every request's new events (a repeated sequence number is ignored), the per-model latest state and
    changed facts, in a few multi-row statements; per request, how many of its events (or facts) were new.

    Raises whatever the database raises (the caller then writes request by request)."""
    pairs = sorted({(d, e.seq) for d, events, _ in batch for e in events})
    seen = {(r.device_id, r.seq) for r in _existing(conn, _SEEN, (DeviceEventRow.device_id, DeviceEventRow.seq),
                                                    pairs)} if pairs else set()
    counts: list[int] = []
    new_rows: list[dict[str, Any]] = []
    quality: list[tuple[str, int, ReportEvent]] = []
    latest: dict[tuple[str, int], ReportEvent] = {}
    facts: dict[str, FactsWrite] = {}
    for device_id, events, f in batch:
        if f is not None:
            facts[device_id] = f  # the later of two updates in one batch wins
            counts.append(1)
            continue
        n = 0
        for e in sorted(events, key=lambda e: e.seq):
            if (device_id, e.seq) in seen:
                continue
            seen.add((device_id, e.seq))
            n += 1
            new_rows.append({"device_id": device_id, "seq": e.seq, "model": e.model, "step": e.step,
                             "version": e.version, "release_number": e.release, "reason": e.reason,
                             "detail": event_detail(e),
                             "device_time": e.at, "received_at": t})
            mid = model_ids.get(e.model)
            if mid is None:
                continue
            if e.quality is not None and e.release is not None and e.version is not None:
                quality.append((device_id, mid, e))
            prev = latest.get((device_id, mid))
            if prev is None or prev.seq < e.seq:
                latest[(device_id, mid)] = e
        counts.append(n)
    if new_rows:
        conn.execute(insert(DeviceEventRow), new_rows)
    for device_id, mid, e in quality:
        _store_quality(conn, device_id, mid, e, t)
    if latest:
        _store_latest(conn, latest, t)
    store_facts(conn, sorted(facts.items()), t)
    return counts


def _store_latest(conn: Connection, latest: dict[tuple[str, int], ReportEvent], t: float) -> None:
    """Each (device, model)'s latest state: a new row, or an update where the event is newer than the stored one."""
    have = {(r.device_id, r.model_id): r.last_seq for r in _existing(
        conn, _MODEL_ROWS, (DeviceModelRow.device_id, DeviceModelRow.model_id), sorted(latest))}
    updates, inserts = [], []
    for (device_id, mid), e in latest.items():
        values = {"last_seq": e.seq, "state": e.step, "version": e.version, "release_number": e.release,
                  "reason": e.reason, "updated_at": t}
        last = have.get((device_id, mid))
        if last is None:
            inserts.append({"device_id": device_id, "model_id": mid, "pinned_release_id": None, **values})
        elif last < e.seq:
            updates.append({"k_device": device_id, "k_model": mid, "v_seq": e.seq, "v_state": e.step,
                            "v_version": e.version, "v_release": e.release, "v_reason": e.reason, "v_at": t})
    if updates:
        conn.execute(_UPDATE_MODEL, updates)
    if inserts:
        conn.execute(insert(DeviceModelRow), inserts)
