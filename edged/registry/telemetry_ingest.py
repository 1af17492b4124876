"""Registry side of telemetry: the ingest endpoint devices upload to, its tables, and the series queries.

Mounted into the registry app with ``app.include_router(telemetry_router(sessions, ...))``;
the tables are in :mod:`edged.registry.telemetry_tables` (created by the registry's
``0002_telemetry`` migration, see docs/telemetry.md). Device uploads are authenticated with
the per-device credential, queries need an operator token (any role: :mod:`edged.registry.access`).

Storage is idempotent: a sample is keyed by (device, buffer id, seq), so a batch resent
after a lost acknowledgement is stored once. Drops are tracked from the device's own
per-buffer running total, which is idempotent as well. Queries answer per device (the
system series) and per model (request, failure and latency series, and a summary over a
time range and label selector that rollout gates read).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import API_PREFIX
from edged.protocol.fleet.telemetry import INGEST_PATH, HistCounts, SystemWindow, UploadAck, UploadBatch
from edged.protocol.fleet.telemetry_answers import (
    DevicePoint,
    DeviceTelemetry,
    ModelPoint,
    ModelSeries,
    ModelSummary,
)
from edged.registry import service
from edged.registry.db import DeviceRow
from edged.registry.deps import Bearer, QueryNumber, transaction, unauthorized
from edged.registry.service import RegistryError
from edged.registry.telemetry_tables import TelemetryDeviceRow, TelemetryModelRow, TelemetrySampleRow

MAX_POINTS = 10_000
INGEST_THREADS = 4  # SQLite writes serialise anyway; PostgreSQL takes a few at once
MAX_WAITING_UPLOADS = 512


# ---- storage --------------------------------------------------------------------------------------
def ingest(s: Session, dev: DeviceRow, batch: UploadBatch) -> UploadAck:
    seqs = [it.seq for it in batch.items]
    if any(q < 1 for q in seqs):
        raise service.invalid("items[].seq: every uploaded sample needs a buffer sequence number >= 1")
    known = set(s.scalars(select(TelemetrySampleRow.seq).where(
        TelemetrySampleRow.device_id == dev.id, TelemetrySampleRow.buffer_id == batch.buffer_id,
        TelemetrySampleRow.seq.in_(seqs)))) if seqs else set()
    accepted = duplicates = 0
    received = time.time()
    for it in batch.items:
        if it.seq in known:
            duplicates += 1
            continue
        known.add(it.seq)
        row = TelemetrySampleRow(device_id=dev.id, buffer_id=batch.buffer_id, seq=it.seq, run=it.run, t=it.t,
                                 window_s=it.window_s, profile=it.profile,
                                 system=it.system.model_dump(mode="json", exclude_none=True), received_at=received)
        s.add(row)
        s.flush()
        for m in it.models:
            s.add(TelemetryModelRow(
                sample_id=row.id, device_id=dev.id, t=it.t, window_s=it.window_s, model=m.model, version=m.version,
                backend=m.backend, success=m.success, failures=m.failure_count, failures_by_code=dict(m.failures),
                inferences=m.inferences, in_flight=m.in_flight, latency_counts=list(m.latency.counts),
                latency_sum_s=m.latency.sum_s, p50_s=m.p50_s, p99_s=m.p99_s))
        accepted += 1
    st = s.get(TelemetryDeviceRow, dev.id)
    if st is None:
        st = TelemetryDeviceRow(device_id=dev.id, samples_total=0, buffer_id=batch.buffer_id, buffer_dropped=0,
                                dropped_before=0)
        s.add(st)
    if st.buffer_id != batch.buffer_id:
        st.dropped_before += st.buffer_dropped
        st.buffer_id, st.buffer_dropped = batch.buffer_id, 0
    st.buffer_dropped = max(st.buffer_dropped, batch.dropped_total)
    st.samples_total += accepted
    if batch.items:
        st.last_t = max(st.last_t or 0.0, *(it.t for it in batch.items))
    st.last_received_at = received
    return UploadAck(accepted=accepted, duplicates=duplicates, last_seq=max(seqs, default=0))


def prune(s: Session, older_than: float) -> int:
    """Delete samples received before ``older_than`` (Unix seconds); returns how many."""
    old = select(TelemetrySampleRow.id).where(TelemetrySampleRow.received_at < older_than)
    s.execute(delete(TelemetryModelRow).where(TelemetryModelRow.sample_id.in_(old)))
    res = s.execute(delete(TelemetrySampleRow).where(TelemetrySampleRow.received_at < older_than))
    return int(getattr(res, "rowcount", 0) or 0)


def device_series(s: Session, device_id: str, *, since: float | None = None, until: float | None = None,
                  limit: int = 1000) -> DeviceTelemetry:
    if s.get(DeviceRow, device_id) is None:
        raise service.not_found("device")
    q = select(TelemetrySampleRow).where(TelemetrySampleRow.device_id == device_id)
    if since is not None:
        q = q.where(TelemetrySampleRow.t >= since)
    if until is not None:
        q = q.where(TelemetrySampleRow.t < until)
    rows = list(s.scalars(q.order_by(TelemetrySampleRow.t.desc(), TelemetrySampleRow.id.desc()).limit(limit)))
    rows.reverse()
    st = s.get(TelemetryDeviceRow, device_id)
    return DeviceTelemetry(
        device_id=device_id, samples_total=st.samples_total if st else 0,
        dropped_total=st.dropped_before + st.buffer_dropped if st else 0,
        last_received_at=st.last_received_at if st else None,
        points=[DevicePoint(seq=r.seq, run=r.run, t=r.t, window_s=r.window_s, received_at=r.received_at,
                            profile=r.profile, system=SystemWindow.model_validate(r.system)) for r in rows])


def _model_rows(model: str, *, version: int | None, device_id: str | None, since: float | None,
                until: float | None) -> Any:
    q = select(TelemetryModelRow).where(TelemetryModelRow.model == model)
    if version is not None:
        q = q.where(TelemetryModelRow.version == version)
    if device_id is not None:
        q = q.where(TelemetryModelRow.device_id == device_id)
    if since is not None:
        q = q.where(TelemetryModelRow.t >= since)
    if until is not None:
        q = q.where(TelemetryModelRow.t < until)
    return q


def model_series(s: Session, model: str, *, version: int | None = None, device_id: str | None = None,
                 since: float | None = None, until: float | None = None, limit: int = 1000) -> ModelSeries:
    q = _model_rows(model, version=version, device_id=device_id, since=since, until=until)
    rows = list(s.scalars(q.order_by(TelemetryModelRow.t.desc(), TelemetryModelRow.id.desc()).limit(limit)))
    rows.reverse()
    return ModelSeries(model=model, points=[
        ModelPoint(t=r.t, device_id=r.device_id, version=r.version, backend=r.backend, window_s=r.window_s,
                   success=r.success, failures=r.failures, failures_by_code=dict(r.failures_by_code),
                   inferences=r.inferences, in_flight=r.in_flight, p50_s=r.p50_s, p99_s=r.p99_s) for r in rows])


def model_summary(s: Session, model: str, *, version: int | None = None, since: float | None = None,
                  until: float | None = None, labels: dict[str, str] | None = None,
                  device_id: str | None = None) -> ModelSummary:
    rows = list(s.scalars(_model_rows(model, version=version, device_id=device_id, since=since, until=until)))
    if labels:
        ids = {r.device_id for r in rows}
        devs: list[DeviceRow] = list(s.scalars(select(DeviceRow).where(DeviceRow.id.in_(ids)))) if ids else []
        keep = {d.id for d in devs if all(d.effective_labels().get(k) == v for k, v in labels.items())}
        rows = [r for r in rows if r.device_id in keep]
    hist = HistCounts()
    by_code: dict[str, int] = {}
    success = failures = 0
    for r in rows:
        success += r.success
        failures += r.failures
        for code, n in r.failures_by_code.items():
            by_code[code] = by_code.get(code, 0) + int(n)
        counts = [int(c) for c in r.latency_counts][: len(hist.counts)]
        hist = hist.plus(HistCounts(counts + [0] * (len(hist.counts) - len(counts)), float(r.latency_sum_s)))
    total = success + failures
    span = (max(r.t for r in rows) - min(r.t - r.window_s for r in rows)) if rows else None
    return ModelSummary(model=model, version=version, since=since, until=until,
                        devices=len({r.device_id for r in rows}), samples=len(rows), success=success,
                        failures=failures, failures_by_code=dict(sorted(by_code.items())),
                        error_rate=failures / total if total else None, p50_s=hist.quantile(0.5),
                        p90_s=hist.quantile(0.9), p99_s=hist.quantile(0.99), device_id=device_id, span_s=span,
                        rate_per_s=total / span if span else None, versions=sorted({r.version for r in rows}),
                        backends=sorted({r.backend for r in rows}))


# ---- the router -----------------------------------------------------------------------------------


def _labels(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise service.invalid(f"label {item!r}: expected key=value")
        out[key] = value
    return out


def telemetry_router(sessions: sessionmaker[Session], last_seen_resolution_s: float) -> APIRouter:
    router = APIRouter()

    def tx() -> contextlib.AbstractContextManager[Session]:
        return transaction(sessions)

    # Uploads are writes that queue on the database; they get threads of their own, so a fleet's
    # telemetry never occupies the server's shared thread pool (operators' requests, the dashboard).
    # A device whose upload finds too many waiting is told to come back later (its buffer keeps it).
    pool = ThreadPoolExecutor(max_workers=INGEST_THREADS, thread_name_prefix="telemetry-ingest")
    waiting = 0

    def store(batch: UploadBatch, credential: str | None) -> UploadAck:
        with tx() as s:
            dev = service.device_for_credential(s, credential) if credential is not None else None
            if dev is None:
                raise unauthorized()
            service.touch(dev, last_seen_resolution_s)
            return ingest(s, dev, batch)

    @router.post(INGEST_PATH, tags=["device"], response_model=UploadAck)
    async def upload(batch: UploadBatch, auth: Bearer) -> UploadAck:
        nonlocal waiting
        if waiting >= MAX_WAITING_UPLOADS:
            raise RegistryError("telemetry ingest is busy; try again later", 503, ErrorCode.UNAVAILABLE)
        waiting += 1
        try:
            return await asyncio.wrap_future(pool.submit(store, batch, auth.credentials if auth else None))
        finally:
            waiting -= 1

    @router.get(f"{API_PREFIX}/devices/{{device_id}}/telemetry", tags=["admin"], response_model=DeviceTelemetry)
    def device_telemetry(device_id: str, *, since: float | None = None, until: float | None = None,
                         limit: Annotated[int, Query(ge=1, le=MAX_POINTS)] = 1000) -> DeviceTelemetry:
        with tx() as s:
            return device_series(s, device_id, since=since, until=until, limit=limit)

    @router.get(f"{API_PREFIX}/models/{{model}}/telemetry", tags=["admin"], response_model=ModelSeries)
    def model_telemetry(model: str, *, version: QueryNumber = None, device_id: str | None = None,
                        since: float | None = None, until: float | None = None,
                        limit: Annotated[int, Query(ge=1, le=MAX_POINTS)] = 1000) -> ModelSeries:
        with tx() as s:
            return model_series(s, model, version=version, device_id=device_id, since=since, until=until,
                                limit=limit)

    @router.get(f"{API_PREFIX}/models/{{model}}/telemetry/summary", tags=["admin"], response_model=ModelSummary)
    def model_telemetry_summary(model: str, *, version: QueryNumber = None, since: float | None = None,
                                until: float | None = None, device_id: str | None = None,
                                label: Annotated[list[str] | None, Query()] = None) -> ModelSummary:
        with tx() as s:
            return model_summary(s, model, version=version, since=since, until=until, labels=_labels(label),
                                 device_id=device_id)

    return router
