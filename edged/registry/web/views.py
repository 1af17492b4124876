"""What the dashboard pages show, read from the registry's own tables and services.

Everything here is a read in one session; the pages' templates only lay it out. The fleet
view reads the whole fleet in two queries (devices with their per-model rows, and the
recent engine of each device's models from telemetry) and works out what each device
*should* serve with the same decision the poll endpoint makes (:func:`desired.decide` on the
cached release snapshot), so the page and the devices never disagree about it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson
from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session

from edged.protocol.fleet.telemetry import HistCounts
from edged.protocol.fleet.telemetry_answers import ModelSummary
from edged.registry import desired as desired_state
from edged.registry import rollouts, service
from edged.registry.db import DeviceModelRow, DeviceRow, ModelRow, ReleaseRow, RolloutRow, VersionRow
from edged.registry.gates import NOT_MODEL_ERRORS, Side
from edged.registry.release_states import release_states, with_rollback_reasons
from edged.registry.rollout_wire import RolloutInfo, RolloutStatus
from edged.registry.telemetry_ingest import device_series
from edged.registry.telemetry_tables import TelemetryModelRow

ENGINE_RECENT_S = 300.0
T = TypeVar("T")
WINDOWS = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400}
ERROR_STATES = frozenset({"rolled-back", "failed"})


@dataclass
class Serving:
    model: str
    version: int | None
    release: int | None
    state: str
    engine: str | None = None
    want_release: int | None = None
    want_version: int | None = None

    @property
    def on_target(self) -> bool:
        return self.want_release is None or self.want_release == self.release


# What a device serves, in one vocabulary for the API, the CLI and the dashboard: the device's own word
# (ServingModel.state) mapped here, once. A version on trial already answers the clients: it is what is served.
SERVING_STATES = {"active-trial": "trial", "trial": "trial", "committed": "committed", "local": "local"}


def serving_state(reported: str) -> str:
    """``trial``, ``committed`` or ``local`` (an older device that sent no state served a committed version)."""
    return SERVING_STATES.get(reported, "committed")


@dataclass
class FleetRow:
    id: str
    online: bool
    last_seen_at: float | None
    labels: dict[str, str]
    profile: str
    accelerator: str
    serving: list[Serving]
    last_error: str | None

    @property
    def off_target(self) -> bool:
        return any(not sv.on_target for sv in self.serving)


@dataclass
class Fleet:
    rows: list[FleetRow]
    matching: int
    counts: dict[str, int]
    models: list[str]
    profiles: list[str]
    label_keys: list[str]
    at: float  # when the lines were read: "last contact" is relative to it, so an unchanged read renders the same
    shown_from: int = 0


def accelerator_of(facts: dict[str, Any]) -> str:
    """One word for the device's accelerator, from the probed facts (the CPU when there is none)."""
    if facts.get("jetson.module"):
        return f"Jetson {facts['jetson.module']}"
    if facts.get("nvidia_gpu.name"):
        return str(facts["nvidia_gpu.name"])
    if facts.get("intel_npu.present"):
        return "Intel NPU"
    if facts.get("intel_gpu.present"):
        return "Intel GPU"
    return "CPU" + (f" ({facts['cpu.arch']})" if facts.get("cpu.arch") else "")


Engines = dict[str, dict[str, tuple[float, str, int]]]  # device -> model -> (t, engine, version)


def _recent_engines(s: Session, models: list[str], now: float, device_id: str | None = None) -> Engines:
    """Per (device, model), the engine and version of its latest telemetry sample in the last few minutes.

    One statement per model, so that each is a range of the (model, t) index.
    """
    out: Engines = defaultdict(dict)
    conn = s.connection()
    for m in models:
        q = (select(TelemetryModelRow.device_id, TelemetryModelRow.t, TelemetryModelRow.backend,
                    TelemetryModelRow.version)
             .where(TelemetryModelRow.model == m, TelemetryModelRow.t >= now - ENGINE_RECENT_S))
        if device_id is not None:
            q = q.where(TelemetryModelRow.device_id == device_id)
        for dev, t, backend, version in conn.execute(q):
            mine = out[dev]
            if m not in mine or mine[m][0] < t:
                mine[m] = (t, backend, version)
    return out


@dataclass
class FleetFilter:
    label: str = ""   # key=value
    model: str = ""
    profile: str = ""
    state: str = ""   # online | offline | off-target | error
    id: str = ""      # device id prefix (the search box)

    def label_pair(self) -> tuple[str, str] | None:
        key, sep, value = self.label.partition("=")
        return (key.strip(), value.strip()) if sep and key.strip() else None

    def keeps(self, row: FleetRow) -> bool:
        if self.id and not row.id.startswith(self.id):
            return False
        pair = self.label_pair()
        if pair is not None and row.labels.get(pair[0]) != pair[1]:
            return False
        if self.model and self.model not in {sv.model for sv in row.serving}:
            return False
        if self.profile and row.profile != self.profile:
            return False
        return not self.state or {"online": row.online, "offline": not row.online, "off-target": row.off_target,
                                  "error": row.last_error is not None}.get(self.state, True)


def _row(dev_id: str, *, labels: dict[str, str], facts: dict[str, Any], last_seen_at: float | None,  # noqa: PLR0913  one keyword per source of a fleet row
         serving_json: list[Any] | None, wants: dict[str, desired_state.ReleaseView],
         engines: Engines, last_error: str | None, online_s: float,
         now: float) -> FleetRow:
    """A device's line: what it reports serving next to what the registry would have it serve."""
    serving: list[Serving] = []
    mine = engines.get(dev_id, {})
    for sm in serving_json or []:
        name = str(sm.get("model", "?"))
        eng = mine.get(name)
        rv = wants.get(name)
        serving.append(Serving(model=name, version=sm.get("version"), release=sm.get("release"),
                               state=serving_state(str(sm.get("state", ""))), engine=eng[1] if eng else None,
                               want_release=rv.number if rv else None, want_version=rv.version if rv else None))
    served = {sv.model for sv in serving}
    # a model the daemon serves outside the registry's updates (installed locally) shows in its telemetry only
    serving += [Serving(model=m, version=eng[2], release=None, state="local", engine=eng[1],
                        want_release=wants[m].number if m in wants else None,
                        want_version=wants[m].version if m in wants else None)
                for m, eng in sorted(mine.items()) if m not in served]
    served = {sv.model for sv in serving}
    serving += [Serving(model=m, version=None, release=None, state="not serving", want_release=rv.number,
                        want_version=rv.version) for m, rv in sorted(wants.items()) if m not in served]
    return FleetRow(id=dev_id, online=last_seen_at is not None and now - last_seen_at <= online_s,
                    last_seen_at=last_seen_at, labels=labels, profile=str(facts.get("profile", "")) or "unknown",
                    accelerator=accelerator_of(facts), serving=serving, last_error=last_error)


@dataclass
class FleetRows:
    """Every device's line, worked out at ``at`` from the snapshot of ``revision``: what pages filter."""

    rows: list[FleetRow]
    models: list[str]
    revision: int
    at: float


def _json(raw: Any) -> Any:
    """A JSON column read as text (one fast parse instead of the driver's per-type processing)."""
    return orjson.loads(raw) if isinstance(raw, (str, bytes)) else raw


def fleet_rows(s: Session, snap: desired_state.Snapshot, *, online_s: float, now: float | None = None) -> FleetRows:
    """The whole fleet in three statements: devices, their per-model rows, recent engines from telemetry.

    JSON columns are read as text and parsed here: at 10,000 devices the driver's JSON
    processing was a third of the page's time.
    """
    now = time.time() if now is None else now
    conn = s.connection()
    model_names = {mid: name for mid, name in conn.execute(select(ModelRow.id, ModelRow.name))}
    per_dev: dict[str, list[Any]] = defaultdict(list)
    for r in conn.execute(select(DeviceModelRow.device_id, DeviceModelRow.model_id, DeviceModelRow.pinned_release_id,
                                 DeviceModelRow.state, DeviceModelRow.release_number, DeviceModelRow.reason,
                                 DeviceModelRow.updated_at)):
        per_dev[r.device_id].append(r)
    engines = _recent_engines(s, sorted(model_names.values()), now)
    rows: list[FleetRow] = []
    q = select(DeviceRow.id, cast(DeviceRow.admin_labels, Text), cast(DeviceRow.facts, Text),
               cast(DeviceRow.serving, Text), DeviceRow.last_seen_at).order_by(DeviceRow.id)
    for dev_id, labels_raw, facts_raw, serving_raw, last_seen_at in conn.execute(q):
        labels = {str(k): str(v) for k, v in (_json(labels_raw) or {}).items()}
        facts = _json(facts_raw) or {}
        view = desired_state.DeviceView(id=dev_id, credential_hash="", labels=labels, facts=facts,
                                        last_seen_at=last_seen_at, models={})
        last_error: tuple[float, str] | None = None
        for r in per_dev.get(dev_id, ()):
            view.models[r.model_id] = desired_state.DeviceModelView(r.pinned_release_id, r.state, r.release_number)
            if r.state in ERROR_STATES and r.reason and (last_error is None or (r.updated_at or 0) > last_error[0]):
                last_error = (r.updated_at or 0.0, f"{model_names.get(r.model_id, '?')}: {r.reason}")
        wants = {rv.model: rv for rv in desired_state.decide(snap, view).releases}
        rows.append(_row(dev_id, labels=labels, facts=facts, last_seen_at=last_seen_at,
                         serving_json=_json(serving_raw), wants=wants, engines=engines,
                         last_error=last_error[1] if last_error else None, online_s=online_s, now=now))
    return FleetRows(rows=rows, models=sorted(model_names.values()), revision=snap.revision, at=now)


def fleet(all_rows: FleetRows, flt: FleetFilter, *, limit: int, offset: int = 0) -> Fleet:
    """Counts over the whole fleet, and one page of the devices the filter keeps."""
    counts: Counter[str] = Counter({k: 0 for k in ("devices", "online", "offline", "off-target", "error")})
    profiles: set[str] = set()
    label_keys: set[str] = set()
    kept: list[FleetRow] = []
    for row in all_rows.rows:
        profiles.add(row.profile)
        label_keys.update(row.labels)
        counts["devices"] += 1
        counts["online" if row.online else "offline"] += 1
        counts["off-target"] += row.off_target
        counts["error"] += row.last_error is not None
        if flt.keeps(row):
            kept.append(row)
    return Fleet(rows=kept[offset:offset + limit], matching=len(kept), counts=dict(counts),
                 models=all_rows.models, profiles=sorted(profiles), label_keys=sorted(label_keys),
                 at=all_rows.at, shown_from=offset)


class SharedRead(Generic[T]):
    """A costly page read shared by every open page, done again at most every ``ttl_s`` per key.

    Any number of open pages cost the registry one read per period, concurrent requests wait
    for the read in progress instead of starting their own, and the period stretches to
    ``cost_factor`` times the last read's duration, so that open dashboards never take more
    than about 1/cost_factor of one core however large the fleet. A release or rollout change
    (a new snapshot revision) is read at the next request.
    """

    def __init__(self, ttl_s: float, cost_factor: float = 100.0) -> None:
        self.ttl_s = ttl_s
        self.cost_factor = cost_factor
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, float, T]] = {}  # key -> revision, when read, value
        self._cost_s = 0.0
        self.reads = 0

    def get(self, key: str, revision: int, read: Callable[[], T]) -> T:
        with self._lock:
            held = self._held.get(key)
            period = max(self.ttl_s, self.cost_factor * self._cost_s)
            if held is None or held[0] != revision or time.monotonic() - held[1] >= period:
                t0 = time.monotonic()
                value = read()
                now = time.monotonic()
                self._held[key] = (revision, now, value)
                self._cost_s = now - t0
                self.reads += 1
                return value
            return held[2]


class FleetCache:
    """The fleet's lines (the dashboard's costliest read: every device's line) as a :class:`SharedRead`."""

    def __init__(self, ttl_s: float, cost_factor: float = 100.0) -> None:
        self.shared: SharedRead[FleetRows] = SharedRead(ttl_s, cost_factor)

    @property
    def reads(self) -> int:
        return self.shared.reads

    def get(self, s: Session, snap: desired_state.Snapshot, *, online_s: float) -> FleetRows:
        return self.shared.get("fleet", snap.revision, lambda: fleet_rows(s, snap, online_s=online_s))


# ---- charts -----------------------------------------------------------------------------------------
@dataclass
class Chart:
    """One chart as uPlot draws it: shared x (Unix seconds), one list per series (None for a gap)."""

    id: str
    title: str
    unit: str
    x: list[float] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "unit": self.unit, "x": self.x,
                "series": [{"label": k, "values": v} for k, v in self.series.items()]}

    def points(self) -> int:
        return sum(1 for v in self.series.values() for y in v if y is not None)


GAP_FACTOR = 3.0  # a spacing this many times the usual one is a period without data, drawn as a break


def _with_breaks(xs: list[float]) -> list[float]:
    """``xs`` with an x of no value inside every gap much longer than the usual spacing (the median), so
    no line is drawn across a period when nothing was reported (a device off, a version not loaded)."""
    if len(xs) < 3:
        return xs
    steps = sorted(b - a for a, b in itertools.pairwise(xs))
    usual = steps[len(steps) // 2]
    if usual <= 0:
        return xs
    out = [xs[0]]
    for a, b in itertools.pairwise(xs):
        if b - a > GAP_FACTOR * usual:
            out.append((a + b) / 2)
        out.append(b)
    return out


def _chart(cid: str, title: str, unit: str, rows: Sequence[tuple[float, str, float | None]]) -> Chart:
    """Rows of (t, series, y) -> a chart on the union of the x values, gaps broken (``_with_breaks``)."""
    xs = _with_breaks(sorted({t for t, _, _ in rows}))
    pos = {t: i for i, t in enumerate(xs)}
    ch = Chart(cid, title, unit, x=xs)
    for t, name, y in rows:
        ch.series.setdefault(name, [None] * len(xs))[pos[t]] = y
    return ch


def _hist(row: TelemetryModelRow) -> HistCounts:
    size = len(HistCounts().counts)
    counts = [int(c) for c in row.latency_counts][:size]
    return HistCounts(counts + [0] * (size - len(counts)), float(row.latency_sum_s))


def _model_rows(s: Session, model: str, since: float, device_id: str | None = None,
                limit: int = 10_000) -> list[TelemetryModelRow]:
    """The newest ``limit`` samples of a model since ``since``, oldest first."""
    q = select(TelemetryModelRow).where(TelemetryModelRow.model == model, TelemetryModelRow.t >= since)
    if device_id is not None:
        q = q.where(TelemetryModelRow.device_id == device_id)
    rows = list(s.scalars(q.order_by(TelemetryModelRow.t.desc()).limit(limit)))
    rows.reverse()
    return rows


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def device_charts(s: Session, device_id: str, models: list[str], since: float) -> list[Chart]:
    sys_pts = device_series(s, device_id, since=since, limit=2000).points
    cpu: list[tuple[float, str, float | None]] = []
    mem: list[tuple[float, str, float | None]] = []
    temp: list[tuple[float, str, float | None]] = []
    for p in sys_pts:
        sw = p.system
        cpu.append((p.t, "CPU %", None if sw.cpu_utilization is None else round(sw.cpu_utilization * 100, 2)))
        cpu.extend((p.t, f"{a.name} %", round(a.utilization * 100, 2)) for a in sw.accelerators
                   if a.utilization is not None)
        mem.append((p.t, "used MB", None if sw.memory_used is None else round(sw.memory_used / 2**20, 1)))
        if sw.process_rss is not None:
            mem.append((p.t, "edged RSS MB", round(sw.process_rss / 2**20, 1)))
        temps = list(sw.temperatures_c.values()) + [a.temperature_c for a in sw.accelerators
                                                    if a.temperature_c is not None]
        temp.append((p.t, "hottest °C", max(temps) if temps else None))
    rate: list[tuple[float, str, float | None]] = []
    lat: list[tuple[float, str, float | None]] = []
    for m in models:
        for mr in _model_rows(s, m, since, device_id, limit=2000):
            w = mr.window_s or 1.0
            tag = f"{m} v{mr.version}"
            h = _hist(mr)
            rate.append((mr.t, f"{tag} req/s", round((mr.success + mr.failures) / w, 3)))
            rate.append((mr.t, f"{tag} errors/s", round(mr.failures / w, 3)))
            lat.append((mr.t, f"{tag} p50", _ms(mr.p50_s if mr.p50_s is not None else h.quantile(0.5))))
            lat.append((mr.t, f"{tag} p99", _ms(mr.p99_s if mr.p99_s is not None else h.quantile(0.99))))
    return [_chart("rate", "Requests and errors per second", "/s", rate),
            _chart("latency", "Latency p50 / p99", "ms", lat),
            _chart("load", "CPU / accelerator load", "%", cpu),
            _chart("temp", "Temperature", "°C", temp),
            _chart("memory", "Memory", "MB", mem)]


# ---- one device ----------------------------------------------------------------------------------------
@dataclass
class DevicePage:
    row: FleetRow
    facts: dict[str, Any]
    enrolled_at: float
    models: list[Any]
    events: list[Any]
    charts: list[Chart]
    # (model, release) of reports a rollout of that release did not count: the device is not its member
    not_counted: dict[tuple[str, int], int] = field(default_factory=dict)


def not_counted(s: Session, dev: DeviceRow, pairs: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """For each (model, release) this device reported about: the latest rollout of that release that does
    not count its word (it is not a member), by rollout id."""
    out: dict[tuple[str, int], int] = {}
    if not pairs:
        return out
    names = {m for m, _ in pairs}
    rows = s.execute(select(RolloutRow, ModelRow.name, ReleaseRow.number)
                     .join(ReleaseRow, ReleaseRow.id == RolloutRow.release_id)
                     .join(ModelRow, ModelRow.id == RolloutRow.model_id)
                     .where(ModelRow.name.in_(names)).order_by(RolloutRow.id)).all()
    latest = {(name, number): ro for ro, name, number in rows if (name, number) in pairs}
    labels, facts = dev.effective_labels(), dict(dev.facts or {})
    for key, ro in latest.items():
        if not rollouts.counted(s, ro, dev.id, labels, facts):
            out[key] = ro.id
    return out


def device(s: Session, snap: desired_state.Snapshot, device_id: str, *, online_s: float, since: float,
           events: int = 100) -> DevicePage:
    info = service.get_device(s, device_id, events)  # raises not-found for an unknown device
    dev = s.get_one(DeviceRow, device_id)
    view, _ = desired_state.lookup_device(s.connection(), device_id)
    wants = {rv.model: rv for rv in desired_state.decide(snap, view).releases} if view is not None else {}
    now = time.time()
    errs = [m for m in info.models if m.state in ERROR_STATES and m.reason]
    row = _row(device_id, labels=dev.effective_labels(), facts=dev.facts, last_seen_at=dev.last_seen_at,
               serving_json=dev.serving, wants=wants,
               engines=_recent_engines(s, list(s.scalars(select(ModelRow.name))), now, device_id),
               last_error=f"{errs[-1].model}: {errs[-1].reason}" if errs else None, online_s=online_s, now=now)
    serving = row.serving
    models = sorted({m.model for m in info.models} | {sv.model for sv in serving})
    return DevicePage(row=row, facts=dict(sorted(dev.facts.items())), enrolled_at=dev.enrolled_at,
                      models=info.models, events=list(reversed(with_rollback_reasons(s, info.events))),
                      charts=device_charts(s, device_id, models, since),
                      not_counted=not_counted(s, dev, {(e.model, e.release) for e in info.events
                                                       if e.release is not None}))


# ---- models and releases -----------------------------------------------------------------------------
@dataclass
class VersionView:
    version: int
    size: int | None  # None: not pushed to the registry
    created_at: float | None
    devices: int
    summary: ModelSummary
    side: Side  # the version's requests as a rollout gate counts them (model errors only)
    base: int | None = None  # the next older version with requests in the window: what the gates compare with
    error_delta: float | None = None  # model-error rate minus the base's (the error_rate gate's value)
    p99_ratio: float | None = None  # p99 over the base's (the p99_ratio gate's value)


@dataclass
class ModelView:
    name: str
    versions: list[VersionView]
    releases: list[dict[str, Any]]
    charts: list[Chart]


MAX_MODEL_SAMPLES = 200_000


@dataclass
class _Acc:
    """One version's (or one chart bucket's) telemetry added up: requests, failures, merged histogram."""

    success: int = 0
    failures: int = 0
    hist: Any = None  # numpy counts, summed
    total_s: float = 0.0
    devices: set[str] = field(default_factory=set)
    samples: int = 0
    by_code: Counter[str] = field(default_factory=Counter)

    def add(self, success: int, failures: int, counts: Any, total_s: float) -> None:
        self.success += success
        self.failures += failures
        self.hist = counts if self.hist is None else self.hist + counts
        self.total_s += total_s
        self.samples += 1

    def histogram(self) -> HistCounts:
        size = len(HistCounts().counts)
        return HistCounts([int(c) for c in self.hist] if self.hist is not None else [0] * size, self.total_s)


def _counts(raw: Any, size: int) -> Any:
    import numpy as np

    c = np.zeros(size, dtype=np.int64)
    vals = _json(raw) or []
    n = min(size, len(vals))
    c[:n] = vals[:n]
    return c


def models(s: Session, since: float, *, bucket_s: float) -> list[ModelView]:
    """Every model with its versions' fleet telemetry side by side: one read of each model's samples.

    The per-version figures are the same merge of histograms the rollout gates make
    (:class:`HistCounts`); at most ``MAX_MODEL_SAMPLES`` newest samples per model are read.
    """
    conn = s.connection()
    running: dict[str, Counter[Any]] = defaultdict(Counter)
    for raw, in conn.execute(select(cast(DeviceRow.serving, Text))):
        for sm in _json(raw) or []:
            running[str(sm.get("model"))][sm.get("version")] += 1
    size = len(HistCounts().counts)
    out = []
    for m in s.scalars(select(ModelRow).order_by(ModelRow.name)):
        per_version: dict[int, _Acc] = defaultdict(_Acc)
        buckets: dict[tuple[float, int], _Acc] = defaultdict(_Acc)
        q = (select(TelemetryModelRow.version, TelemetryModelRow.t, TelemetryModelRow.device_id,
                    TelemetryModelRow.success, TelemetryModelRow.failures,
                    cast(TelemetryModelRow.failures_by_code, Text), cast(TelemetryModelRow.latency_counts, Text),
                    TelemetryModelRow.latency_sum_s)
             .where(TelemetryModelRow.model == m.name, TelemetryModelRow.t >= since)
             .order_by(TelemetryModelRow.t.desc()).limit(MAX_MODEL_SAMPLES))
        for version, t, dev, success, failures, codes, counts_raw, sum_s in conn.execute(q):
            counts = _counts(counts_raw, size)
            acc = per_version[version]
            acc.add(success, failures, counts, sum_s)
            acc.devices.add(dev)
            for code, n in (_json(codes) or {}).items():
                acc.by_code[str(code)] += int(n)
            buckets[(t // bucket_s * bucket_s, version)].add(success, failures, counts, sum_s)
        pushed = {v.version: v for v in s.scalars(select(VersionRow).where(VersionRow.model_id == m.id))}
        here = running.get(m.name, Counter())
        # versions devices run or report that were never pushed (installed locally) are shown too
        numbers = sorted(set(pushed) | set(per_version) | {v for v in here if isinstance(v, int)}, reverse=True)
        versions = []
        for n in numbers:
            acc = per_version.get(n, _Acc())
            h = acc.histogram()
            total = acc.success + acc.failures
            summary = ModelSummary(model=m.name, version=n, since=since, until=None, devices=len(acc.devices),
                                   samples=acc.samples, success=acc.success, failures=acc.failures,
                                   failures_by_code=dict(sorted(acc.by_code.items())),
                                   error_rate=acc.failures / total if total else None, p50_s=h.quantile(0.5),
                                   p90_s=h.quantile(0.9), p99_s=h.quantile(0.99))
            side = Side(ok=acc.success, errors=sum(c for code, c in acc.by_code.items()
                                                   if code not in NOT_MODEL_ERRORS), hist=h)
            versions.append(VersionView(version=n, size=pushed[n].total_size if n in pushed else None,
                                        created_at=pushed[n].created_at if n in pushed else None,
                                        devices=here.get(n, 0), summary=summary, side=side))
        compare(versions)
        vnum = dict(conn.execute(select(VersionRow.id, VersionRow.version).where(VersionRow.model_id == m.id)).all())
        rel_devices = Counter(n for n, in conn.execute(select(DeviceModelRow.release_number).where(
            DeviceModelRow.model_id == m.id, DeviceModelRow.state == "committed")))
        states = release_states(s, m.id)
        releases = [{"number": r.number, "version": vnum.get(r.version_id), "key_id": r.key_id,
                     "signature": r.signature, "issued_at": r.issued_at, "expires_at": r.expires_at,
                     "revoked": r.revoked_at is not None, "notes": r.notes, "devices": rel_devices.get(r.number, 0),
                     "selector": r.selector, "state": states.get(r.number, "")}
                    for r in s.scalars(select(ReleaseRow).where(ReleaseRow.model_id == m.id)
                                       .order_by(ReleaseRow.number.desc()))]
        out.append(ModelView(name=m.name, versions=versions, releases=releases,
                             charts=version_charts(m.name, buckets, bucket_s)))
    return out


def compare(versions: list[VersionView]) -> None:
    """Each version against the next older one with requests: the two figures the telemetry gates judge."""
    for i, v in enumerate(versions):
        base = next((b for b in versions[i + 1:] if b.side.total), None)
        if base is None or not v.side.total:
            continue
        v.base = base.version
        v.error_delta = v.side.error_rate - base.side.error_rate
        p_new, p_base = v.side.p99_s(), base.side.p99_s()
        v.p99_ratio = p_new / p_base if p_new is not None and p_base else None


def version_charts(model: str, buckets: dict[tuple[float, int], _Acc], bucket_s: float) -> list[Chart]:
    """Per-version fleet series side by side: what a rollout's telemetry gates compare."""
    rate = [(t, f"v{v} req/s", round((a.success + a.failures) / bucket_s, 3)) for (t, v), a in buckets.items()]
    erate = [(t, f"v{v} error %", round(100 * a.failures / (a.success + a.failures), 3)
              if a.success + a.failures else None) for (t, v), a in buckets.items()]
    p99 = [(t, f"v{v} p99", _ms(a.histogram().quantile(0.99))) for (t, v), a in buckets.items()]
    return [_chart(f"{model}-rate", f"{model}: fleet requests per second by version", "/s", rate),
            _chart(f"{model}-errors", f"{model}: error rate by version", "%", erate),
            _chart(f"{model}-p99", f"{model}: fleet p99 by version (merged histograms)", "ms", p99)]


# ---- rollouts -------------------------------------------------------------------------------------------
def rollout_list(s: Session) -> list[RolloutInfo]:
    return sorted(rollouts.list_rollouts(s), key=lambda r: -r.id)


def rollout(s: Session, rollout_id: int) -> RolloutStatus:
    return rollouts.rollout_status(s, rollout_id)


@dataclass
class OfflineMember:
    device_id: str
    progress: str
    last_seen_at: float | None


# A member in one of these is done with the release: being offline holds nothing up.
_SETTLED = {"committed", "rolled_back", "failed"}


def rollout_page(s: Session, rollout_id: int, *, online_s: float) -> tuple[RolloutStatus, list[OfflineMember]]:
    """The rollout with its members that have not settled and are offline: they read 'pending' in the counts,
    but will not move until they call again, which an operator needs to see (a paused rollout's above all)."""
    st = rollouts.rollout_status(s, rollout_id, with_members=True)
    waiting = {m.device_id: m.progress for m in st.members if m.progress not in _SETTLED}
    st.members = []  # the page shows counts per step, not every member
    if not waiting:
        return st, []
    now = time.time()
    offline = [OfflineMember(dev_id, waiting[dev_id], seen) for dev_id, seen in
               s.execute(select(DeviceRow.id, DeviceRow.last_seen_at).where(DeviceRow.id.in_(list(waiting))))
               if seen is None or now - seen > online_s]
    return st, sorted(offline, key=lambda m: m.device_id)


def releasable(s: Session) -> dict[str, list[dict[str, Any]]]:
    """Per model, its unrevoked releases (newest first): what the create form offers."""
    out: dict[str, list[dict[str, Any]]] = {}
    for info in service.list_models(s):
        out[info.name] = [{"number": r.release, "version": r.version} for r in
                          sorted(service.list_releases(s, info.name), key=lambda r: -r.release) if not r.revoked]
    return out
