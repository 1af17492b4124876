"""The dashboard's pages read and rendered apart from HTTP: what a page shows, as bytes and an ETag.

The router authenticates and answers; this module reads the registry's data and renders the
templates. It runs where :mod:`edged.registry.web.worker` puts it: in a process of its own
(the default), so that a 10,000-device read never holds the interpreter that answers device
polls, or in the registry's own threads. Requests and answers are small picklable values,
and a refusal travels as values too (the error type's constructor does not pickle).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session as DbSession
from sqlalchemy.orm import sessionmaker

from edged.errors import ErrorCode
from edged.registry import audit
from edged.registry import desired as desired_state
from edged.registry.cli_format import ago, until
from edged.registry.roles import ROLES, Role
from edged.registry.rollouts import allowed_actions
from edged.registry.service import RegistryError
from edged.registry.web import views

PREFIX = "/ui"
HERE = Path(__file__).parent
FLEET_PAGE = 200
ACTIONS = {"pause": "Pause", "resume": "Resume", "abort": "Abort", "rollback": "Roll back"}
PAGES = ("fleet", "device", "models", "rollouts", "rollout", "audit")
AUDIT_PAGE = 100
QUERY = ("part", "from", "id", "label", "model", "profile", "state", "window")  # what a page reads of its query


@functools.cache
def env() -> Any:
    try:
        import jinja2
    except ImportError as err:  # pragma: no cover - part of the registry extra
        raise RuntimeError("the dashboard needs Jinja2: pip install 'edged[registry]'") from err
    e = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                           undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    e.filters["when"] = _when
    e.filters["ago"] = ago
    e.filters["until"] = until
    e.filters["ms"] = lambda s: "-" if s is None else f"{s * 1e3:.2f} ms"
    e.filters["pct"] = lambda x: "-" if x is None else f"{x * 100:.2f} %"
    e.filters["mb"] = lambda n: f"{n / 2**20:.1f} MB"
    return e


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (ValueError, OverflowError, OSError):  # a time no calendar holds (a release that never expires)
        return f"{ts:.0f} (Unix time)"


def etag_of(body: str) -> str:
    return '"' + hashlib.sha256(body.encode("utf-8")).hexdigest()[:32] + '"'


@dataclass(frozen=True)
class PageAsk:
    """One page asked for by a signed-in operator: which page, its query, who asks."""

    name: str  # one of PAGES
    key: str = ""  # the device id or the rollout id of a page about one thing
    query: dict[str, str] = field(default_factory=dict)
    csrf: str = ""
    who: str = ""
    role: str = "viewer"  # what the page offers follows it: a viewer is shown no action
    here: str = ""  # the page's own path and query (the forms come back to it)
    if_none_match: str | None = None  # live region only: the ETags the page has

    @property
    def live_only(self) -> bool:
        return self.query.get("part") == "live"


@dataclass(frozen=True)
class Rendered:
    """A page (or its live region) as UTF-8 bytes; ``body`` None when the asker's ETag still holds."""

    etag: str = ""
    body: bytes | None = None
    error: tuple[str, int, str] | None = None  # message, HTTP status, error code of a refusal
    read_ms: float = 0.0

    def raise_error(self) -> None:
        if self.error is not None:
            message, status, code = self.error
            raise RegistryError(message, status, ErrorCode(code))


class Pages:
    """Reads and renders every page; holds the shared reads that open pages reuse between periods."""

    def __init__(self, read_sessions: sessionmaker[DbSession], snapshots: desired_state.SnapshotCache, *,
                 poll_s: float, online_s: float) -> None:
        self.read_sessions, self.snapshots = read_sessions, snapshots
        self.poll_s, self.online_s = poll_s, online_s
        self.fleet_cache = views.FleetCache(ttl_s=poll_s)
        self.models_read: views.SharedRead[list[views.ModelView]] = views.SharedRead(ttl_s=poll_s)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[DbSession]:
        with self.read_sessions() as s, s.begin():
            yield s

    def render(self, ask: PageAsk) -> Rendered:
        t0 = time.perf_counter()
        if ask.name not in PAGES:
            return Rendered(error=(f"no page {ask.name!r}", 404, ErrorCode.NOT_FOUND.value))
        try:
            template, ctx = getattr(self, "_" + ask.name)(ask)
        except RegistryError as e:
            return Rendered(error=(e.message, e.status, e.code.value))
        read_ms = (time.perf_counter() - t0) * 1e3
        ctx["may_release"] = ROLES.get(ask.role, Role.VIEWER) >= Role.RELEASER
        live = env().get_template(template.replace(".html", "_live.html")).render(prefix=PREFIX, csrf=ask.csrf, **ctx)
        etag = etag_of(live)
        if ask.live_only:
            if ask.if_none_match is not None and etag in [t.strip() for t in ask.if_none_match.split(",")]:
                return Rendered(etag=etag, read_ms=read_ms)
            return Rendered(etag=etag, body=live.encode("utf-8"), read_ms=read_ms)
        html = env().get_template(template).render(prefix=PREFIX, poll_s=self.poll_s, csrf=ask.csrf, live=live,
                                                   live_etag=etag, here=ask.here, who=ask.who, role=ask.role,
                                                   **ctx)
        return Rendered(etag=etag, body=html.encode("utf-8"), read_ms=read_ms)

    # ---- one method per page: its template and what the template shows --------------------------
    def _fleet(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        q = ask.query
        flt = views.FleetFilter(label=q.get("label", "")[:256], model=q.get("model", "")[:128],
                                profile=q.get("profile", "")[:128], state=q.get("state", "")[:16],
                                id=q.get("id", "").strip()[:128])
        try:
            offset = max(0, int(q.get("from", "0")))
        except ValueError:
            offset = 0
        with self._tx() as s:
            every = self.fleet_cache.get(s, self.snapshots.get(s.connection()), online_s=self.online_s)
        data = views.fleet(every, flt, limit=FLEET_PAGE, offset=offset)
        return "fleet.html", {"title": "Fleet", "nav": "fleet", "fleet": data, "flt": flt, "page_size": FLEET_PAGE}

    def _device(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        window, since = window_of(ask.query)
        with self._tx() as s:
            data = views.device(s, self.snapshots.get(s.connection()), ask.key, online_s=self.online_s, since=since)
        return "device.html", {"title": f"Device {ask.key}", "nav": "fleet", "d": data, "window": window,
                               "windows": list(views.WINDOWS)}

    def _models(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        window, since = window_of(ask.query)
        with self._tx() as s:
            data = self.models_read.get(window, self.snapshots.get(s.connection()).revision,
                                        lambda: views.models(s, since,
                                                             bucket_s=max(10.0, views.WINDOWS[window] / 90)))
        return "models.html", {"title": "Models and releases", "nav": "models", "models": data, "window": window,
                               "windows": list(views.WINDOWS)}

    def _rollouts(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        with self._tx() as s:
            items = views.rollout_list(s)
            offer = views.releasable(s)
        return "rollouts.html", {"title": "Rollouts", "nav": "rollouts", "rollouts": items, "offer": offer}

    def _rollout(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        with self._tx() as s:
            st, offline = views.rollout_page(s, int(ask.key), online_s=self.online_s)
        # Only what the rollout's state machine accepts (a completed or halted rollout cannot be paused or resumed),
        # and nothing to a viewer.
        may = ROLES.get(ask.role, Role.VIEWER) >= Role.RELEASER
        offered = {a: ACTIONS[a] for a in allowed_actions(st.rollout.state)} if may else {}
        return "rollout.html", {"title": f"Rollout {ask.key}", "nav": "rollouts", "st": st, "actions": offered,
                                "offline": offline}

    def _audit(self, ask: PageAsk) -> tuple[str, dict[str, Any]]:
        try:
            offset = max(0, int(ask.query.get("from", "0")))
        except ValueError:
            offset = 0
        with self._tx() as s:
            log = audit.recent(s, AUDIT_PAGE, offset)
        return "audit.html", {"title": "Audit log", "nav": "audit", "log": log, "offset": offset,
                              "page_size": AUDIT_PAGE}


def window_of(query: dict[str, str]) -> tuple[str, float]:
    w = query.get("window", "15m")
    w = w if w in views.WINDOWS else "15m"
    return w, time.time() - views.WINDOWS[w]
