"""The dashboard's routes under ``/ui``: server-rendered pages, their live fragments, and the operator's actions.

Pages are Jinja2 templates over :mod:`edged.registry.web.views`. Each page carries a *live*
region that the page's script asks for again every ``dashboard_poll_s`` with the ETag of
what it has; an unchanged region costs the registry one render and a 304, never a
transfer (docs/dashboard.md has what one open page costs at 10,000 devices).

Access: a session cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over HTTPS), honoured
while its session is open in the database (sign-out closes it: :mod:`edged.registry.web.session_store`);
device credentials and enrollment tokens are refused at the login. Without a session, pages
redirect to the login and live fragments answer 401.
Every action is a POST carrying the session's CSRF token, and none happens before the
operator confirmed it on a page that says what it will do. Which role each page and action
needs is :data:`edged.registry.access.RULES`, checked before the route runs; each action adds
its row to the audit log in its own transaction.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from sqlalchemy.orm import Session as DbSession
from sqlalchemy.orm import sessionmaker

from edged.errors import ConfigError, ErrorCode
from edged.protocol.fleet.release import SignedRelease
from edged.registry import audit, rollout_preview, rollouts, step_syntax
from edged.registry.access import BOOTSTRAP, Guard, Principal, principal
from edged.registry.auth import is_admin
from edged.registry.deps import PathNumber
from edged.registry.passwords import check_password
from edged.registry.roles import DEFAULT_OPERATOR_ROLE, ROLES, Role
from edged.registry.rollout_wire import Gates, RolloutCreate, RolloutInfo, RolloutStatus, StepSpec
from edged.registry.service import RegistryError
from edged.registry.settings import RegistrySettings
from edged.registry.targets import RolloutTarget
from edged.registry.web import pages, views
from edged.registry.web.login_guard import LoginGuard
from edged.registry.web.pages import ACTIONS, HERE, PREFIX, QUERY, PageAsk
from edged.registry.web.session import ADMIN, COOKIE, Session, Sessions
from edged.registry.web.session_store import SessionStore
from edged.registry.web.worker import PageRenderer

STATIC = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain",
          "dash.js": "text/javascript", "dash.css": "text/css"}
MAX_FORM = 64 << 10
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")


class LoginRequiredError(Exception):
    def __init__(self, live: bool) -> None:
        super().__init__("login required")
        self.live = live


def parse_steps(text: str, min_devices: int, soak_s: float) -> list[StepSpec]:
    """The CLI's step vocabulary (``label:ring=canary, devices:cam-1+cam-2, 10%/min=3/soak=15m, 100%``; a bare
    number is a percentage); the first step gets ``min_devices`` unless it says ``/min=``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    parts = [p if not _bare_number(p.split("/", 1)[0]) else p.replace("/", "%/", 1) if "/" in p else p + "%"
             for p in parts]
    try:
        out = step_syntax.parse_steps(",".join(parts), soak_s=soak_s, min_devices=1, duration=step_syntax.duration_s)
    except (ConfigError, ValueError) as e:
        raise RegistryError(f"steps: {str(e).splitlines()[-1]}", 422, ErrorCode.INVALID_ARGUMENT) from None
    if out and "/min=" not in parts[0]:
        # validated, not model_copy(update=...): the form's number is held to StepSpec's bounds like the API's
        out[0] = StepSpec.model_validate({**out[0].model_dump(), "min_devices": min_devices})
    return out


def _bare_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _opt_float(form: dict[str, str], key: str, scale: float = 1.0) -> float | None:
    raw = form.get(key, "").strip()
    if not raw:
        return None
    try:
        return float(raw) * scale
    except ValueError:
        raise RegistryError(f"{key}: {raw!r} is not a number", 422, ErrorCode.INVALID_ARGUMENT) from None


def _pairs(form: dict[str, str], key: str) -> dict[str, str]:
    """``k=v, k=v`` (globs allowed in the values, as on the CLI)."""
    out = {}
    for item in form.get(key, "").split(","):
        if item.strip():
            k, sep, v = item.partition("=")
            if not sep or not k.strip():
                raise RegistryError(f"{key}: {item.strip()!r} is not key=value", 422, ErrorCode.INVALID_ARGUMENT)
            out[k.strip()] = v.strip()
    return out


def _list(form: dict[str, str], key: str) -> list[str]:
    return [x.strip() for x in form.get(key, "").split(",") if x.strip()]


def rollout_request(form: dict[str, str]) -> RolloutCreate:
    """The create form's fields -> the same request the API and the CLI send."""
    signed: SignedRelease | None = None
    release: int | None = None
    model = form.get("model", "")
    if form.get("signed", "").strip():  # a release signed off-line (edged-registry release --out FILE)
        try:
            signed = SignedRelease.model_validate_json(form["signed"])
        except ValueError as e:
            raise RegistryError(f"signed release: not a signed release file ({str(e).splitlines()[0]})", 422,
                                ErrorCode.INVALID_ARGUMENT) from None
        model = signed.unverified().model
    elif form.get("pick"):  # the page's select of existing releases: "model:release"
        model, _, number = form["pick"].rpartition(":")
        release = int(number) if number.isdigit() else None
    if signed is None and release is None:
        raise RegistryError("choose an existing release or paste a signed one", 422, ErrorCode.INVALID_ARGUMENT)
    try:
        min_devices = int(form.get("min_devices", "1") or "1")
        min_reporting = int(form.get("min_reporting", "1") or "1")
    except ValueError:
        raise RegistryError("min_devices and min_reporting are whole numbers", 422,
                            ErrorCode.INVALID_ARGUMENT) from None
    target = RolloutTarget(labels=_pairs(form, "target"), facts=_pairs(form, "target_facts"),
                           profiles=_list(form, "target_profiles"), devices=_list(form, "target_devices"))
    gates = Gates(max_failure_rate=_opt_float(form, "max_failure_pct", 0.01),
                  max_error_rate=_opt_float(form, "max_error_pct", 0.01),
                  max_p99_ratio=_opt_float(form, "max_p99_ratio"), min_reporting=min_reporting,
                  max_quality_drop=_opt_float(form, "max_quality_drop"), min_quality=_opt_float(form, "min_quality"))
    try:
        start_at = step_syntax.start_time(form.get("start_at", ""))
    except ConfigError as e:
        raise RegistryError(str(e), 422, ErrorCode.INVALID_ARGUMENT) from None
    return RolloutCreate(model=model, release=release, signed=signed, target=target,
                         steps=parse_steps(form.get("steps", ""), min_devices, _opt_float(form, "soak_s") or 0.0),
                         gates=gates, notes=form.get("notes", "")[:4096], start_at=start_at)


def dashboard_router(access: Guard, *, settings: RegistrySettings, admin_hash: str, sessions: sessionmaker[DbSession],
                     read_sessions: sessionmaker[DbSession], renderer: PageRenderer,
                     on_rollout_change: Callable[[int, str], None]) -> APIRouter:
    ui = _Ui(settings, admin_hash=admin_hash, sessions=sessions, read_sessions=read_sessions, renderer=renderer)
    access.pages = ui.signed_in
    router = APIRouter(prefix=PREFIX, include_in_schema=False)
    _login_routes(router, ui)
    _page_routes(router, ui)
    _action_routes(router, ui, on_rollout_change)
    return router


class _Ui:
    """What the dashboard's routes share: its sessions, sign-in guard, page renderer and response headers."""

    def __init__(self, settings: RegistrySettings, *, admin_hash: str, sessions: sessionmaker[DbSession],
                 read_sessions: sessionmaker[DbSession], renderer: PageRenderer) -> None:
        self.settings, self.admin_hash, self.renderer = settings, admin_hash, renderer
        self.sessions, self.read_sessions = sessions, read_sessions
        self.env = pages.env()
        self.auth = Sessions(admin_hash, operators=settings.operators)
        self.store = SessionStore(sessions, read_sessions)  # sign-out ends a session in every process
        self.guard = LoginGuard()
        self.poll_s = settings.dashboard_poll_s

    @staticmethod
    def headers(extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
                "Cache-Control": "no-store", "X-Frame-Options": "DENY", **(extra or {})}

    def session_of(self, request: Request, *, live: bool = False) -> Session:
        known = getattr(request.state, "session", None)  # the access check found it already
        if isinstance(known, Session):
            return known
        request.state.t0 = time.perf_counter()  # for the Server-Timing header of what it answers
        sess = self.auth.check(request.cookies.get(COOKIE))
        # one primary-key read, as a device poll makes: a signed-out cookie is refused even though its MAC holds
        if sess is None or not self.store.is_open(sess.nonce, sess.who):
            raise LoginRequiredError(live)
        request.state.session = sess
        return sess

    async def signed_in(self, request: Request) -> Principal:
        """Who the session is, with their role: what the app's access check (:mod:`edged.registry.access`) asks."""
        sess = self.session_of(request, live=request.method != "GET" or request.query_params.get("part") == "live")
        if sess.who == ADMIN:  # signed in with the registry's own admin token
            return Principal(BOOTSTRAP, Role.ADMIN, "dashboard")
        role = self.settings.operator_roles.get(sess.who)
        return Principal(sess.who, ROLES[role] if role else DEFAULT_OPERATOR_ROLE, "dashboard")

    def render(self, name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        ctx.setdefault("who", "")
        html = self.env.get_template(name).render(prefix=PREFIX, poll_s=self.poll_s, **ctx)
        return HTMLResponse(html, status_code=status, headers=self.headers())

    async def page(self, request: Request, name: str, key: str = "") -> Response:
        """A page, or with ``?part=live`` only its live region (ETag'd, 304 when unchanged), from the renderer."""
        q = request.query_params
        live = q.get("part") == "live"
        sess = self.session_of(request, live=live)
        ask = PageAsk(name=name, key=key, query={k: q[k] for k in QUERY if k in q}, csrf=sess.csrf, who=sess.who,
                      role=principal(request).role.label,
                      here=request.url.path + ("?" + request.url.query if request.url.query else ""),
                      if_none_match=request.headers.get("if-none-match") if live else None)
        out = await self.renderer.render(ask)
        out.raise_error()
        timing = {"ETag": out.etag, "Server-Timing": f"app;dur={(time.perf_counter() - request.state.t0) * 1e3:.1f}, "
                                                     f"read;dur={out.read_ms:.1f}"}
        if out.body is None:
            return Response(status_code=304, headers=self.headers(timing))
        return HTMLResponse(out.body, headers=self.headers(timing))

    @staticmethod
    async def form_of(request: Request) -> dict[str, str]:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
            raise RegistryError("expected a form (application/x-www-form-urlencoded)", 415,
                                ErrorCode.INVALID_ARGUMENT)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM:
                raise RegistryError(f"form over {MAX_FORM} bytes", 413, ErrorCode.INVALID_ARGUMENT)
        return {k: v[-1] for k, v in urllib.parse.parse_qs(body.decode("utf-8", "replace")).items()}

    @staticmethod
    def same_origin(request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is None or origin == "null":
            return origin is None
        return urllib.parse.urlsplit(origin).netloc == request.headers.get("host", "")

    async def action_form(self, request: Request) -> tuple[Session, dict[str, str]]:
        """The session and form of a POSTed action, refused without a session, from elsewhere or without CSRF."""
        sess = self.session_of(request, live=True)
        form = await self.form_of(request)
        if not self.same_origin(request) or not Sessions.csrf_ok(sess, form.get("csrf")):
            raise RegistryError("missing or wrong CSRF token: reload the page and try again", 403,
                                ErrorCode.PERMISSION_DENIED)
        return sess, form


def _login_routes(router: APIRouter, ui: _Ui) -> None:
    """Sign-in and sign-out, and the pages' static files."""
    @router.get("/login")
    def login_page(request: Request) -> Response:
        return ui.render("login.html", title="Sign in", nav="", csrf="", error=None, operator="",
                         next=request.query_params.get("next", ""))

    @router.post("/login")
    async def login(request: Request) -> Response:
        form = await ui.form_of(request)
        nxt = form.get("next", "")
        name = form.get("name", "").strip()
        secret = form.get("token", "")
        address = request.client.host if request.client is not None else "?"
        wait_s = ui.guard.retry_after(address)
        if wait_s is not None:  # refused before any check: a guess costs nothing and proves nothing
            refused = ui.render("login.html", status=429, title="Sign in", nav="", csrf="", next=nxt,
                                operator=name[:64], error="Too many failed sign-ins from this address: try again "
                                                          f"in {math.ceil(wait_s)} s.")
            refused.headers["Retry-After"] = str(math.ceil(wait_s))
            return refused
        if name:
            # an operator account: scrypt, ~50 ms and 16 MiB, off the event loop and a few at a time
            stored = ui.settings.operators.get(name) if name != ADMIN and len(name) <= 64 else None
            async with ui.guard.checks:
                ok = await run_in_threadpool(check_password, secret, stored)
            who = name
        else:
            # device credentials and enrollment tokens end here too: only the admin token opens the dashboard
            ok = is_admin(f"Bearer {secret.strip()}", ui.admin_hash)
            who = ADMIN
        if not ok:
            ui.guard.failed(address)
            return ui.render("login.html", status=401, title="Sign in", nav="", csrf="", next=nxt,
                             operator=name[:64], error="That is not an operator's password." if name else
                             "That is not the registry's admin token.")
        ui.guard.succeeded(address)
        value, opened = ui.auth.issue(who)
        await run_in_threadpool(ui.store.open, opened.nonce, opened.who, opened.expires_at)
        ui.renderer.warm()  # the page process starts while the browser follows the redirect
        target = nxt if nxt.startswith(PREFIX + "/") and not nxt.startswith("//") else f"{PREFIX}/fleet"
        resp = RedirectResponse(target, status_code=303, headers=ui.headers())
        resp.set_cookie(COOKIE, value, max_age=ui.auth.lifetime_s, path=PREFIX, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        sess, _ = await ui.action_form(request)
        await run_in_threadpool(ui.store.close, sess.nonce)  # the cookie, even if kept or copied, is dead now
        resp = RedirectResponse(f"{PREFIX}/login", status_code=303, headers=ui.headers())
        resp.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return resp

    @router.get("/static/{name}")
    def static(name: str) -> Response:
        kind = STATIC.get(name)
        if kind is None:
            return Response(status_code=404)
        return Response((HERE / "static" / name).read_bytes(), media_type=kind,
                        headers={"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff"})


def _page_routes(router: APIRouter, ui: _Ui) -> None:
    """The pages, each drawn by the renderer."""
    @router.get("")
    @router.get("/")
    def home(request: Request) -> Response:
        ui.session_of(request)
        return RedirectResponse(f"{PREFIX}/fleet", status_code=303)

    @router.get("/fleet")
    async def fleet(request: Request) -> Response:
        return await ui.page(request, "fleet")

    @router.get("/devices/{device_id}")
    async def device(device_id: str, request: Request) -> Response:
        return await ui.page(request, "device", device_id)

    @router.get("/models")
    async def models(request: Request) -> Response:
        return await ui.page(request, "models")

    @router.get("/rollouts")
    async def rollout_list(request: Request) -> Response:
        return await ui.page(request, "rollouts")

    @router.get("/rollouts/{rollout_id}")
    async def rollout(rollout_id: PathNumber, request: Request) -> Response:
        return await ui.page(request, "rollout", str(rollout_id))

    @router.get("/audit")
    async def audit_log(request: Request) -> Response:
        return await ui.page(request, "audit")


def _action_routes(router: APIRouter, ui: _Ui, on_rollout_change: Callable[[int, str], None]) -> None:
    """Actions: a confirmation page first, then the action."""
    @router.post("/rollouts")
    async def create(request: Request) -> Response:
        sess, form = await ui.action_form(request)
        try:
            req = rollout_request(form)
        except ValueError as e:  # pydantic's, with the field that was wrong
            raise RegistryError(str(e).split("\n", 1)[-1][:500], 422, ErrorCode.INVALID_ARGUMENT) from None
        if form.get("confirmed") != "yes":
            # The members each step would take, worked out by the code that starts it (rolled back): refused here
            # already when starting would be (another rollout active, a bad release).
            steps = await run_in_threadpool(rollout_preview.preview, ui.sessions, req, ui.settings.public_keys)
            return ui.render("confirm.html", title="Confirm the rollout", nav="rollouts", csrf=sess.csrf,
                             action=f"{PREFIX}/rollouts", form=form, what="start this rollout", req=req,
                             back=f"{PREFIX}/rollouts", preview=steps)
        req = req.model_copy(update={"notes": f"{req.notes} (started by {sess.who} from the dashboard)".strip()[:4096]})
        who = principal(request)

        def start(r: RolloutCreate) -> RolloutInfo:
            with ui.sessions() as s, s.begin():
                info = rollouts.create_rollout(s, r, ui.settings.public_keys,
                                               admit_per_minute=ui.settings.rollout_admit_per_minute)
                audit.record(s, who, "rollout.create", f"rollout {info.id}",
                             f"model {info.model} release {info.release}, {len(info.steps)} step(s)")
                return info

        info = await run_in_threadpool(start, req)  # the database work off the event loop the devices use
        on_rollout_change(info.id, "created")
        return RedirectResponse(f"{PREFIX}/rollouts/{info.id}", status_code=303, headers=ui.headers())

    @router.post("/rollouts/{rollout_id}/{action}")
    async def act(rollout_id: PathNumber, action: str, request: Request) -> Response:
        sess, form = await ui.action_form(request)
        if action not in ACTIONS:
            raise RegistryError(f"unknown action {action!r}", 404, ErrorCode.NOT_FOUND)
        if form.get("confirmed") != "yes":
            def status() -> RolloutStatus:
                with ui.read_sessions() as s, s.begin():
                    return views.rollout(s, rollout_id)

            st = await run_in_threadpool(status)
            if action not in rollouts.allowed_actions(st.rollout.state):  # refused before, not after, the confirmation
                left = ", ".join(ACTIONS[a] for a in rollouts.allowed_actions(st.rollout.state)) or "none"
                raise RegistryError(f"rollout {rollout_id} is {st.rollout.state}: {ACTIONS[action]} is not possible "
                                    f"(possible now: {left})", 409, ErrorCode.FAILED_PRECONDITION)
            return ui.render("confirm.html", title=f"Confirm: {ACTIONS[action].lower()}", nav="rollouts",
                             csrf=sess.csrf, action=f"{PREFIX}/rollouts/{rollout_id}/{action}", form=form,
                             what=f"{ACTIONS[action].lower()} rollout {rollout_id} ({st.rollout.model} release "
                                  f"{st.rollout.release}, now {st.rollout.state})", req=None,
                             back=f"{PREFIX}/rollouts/{rollout_id}")
        given = form.get("reason", "").strip()[:1000]
        reason = f"{given} ({sess.who}, dashboard)" if given else f"{action} by {sess.who} from the dashboard"
        who = principal(request)

        def do() -> RolloutInfo:
            with ui.sessions() as s, s.begin():
                info = rollouts.act(s, rollout_id, action, reason)
                audit.record(s, who, f"rollout.{action}", f"rollout {rollout_id}", given)
                return info

        info = await run_in_threadpool(do)
        on_rollout_change(rollout_id, info.state)
        return RedirectResponse(f"{PREFIX}/rollouts/{rollout_id}", status_code=303, headers=ui.headers())



ERROR_TITLES = {400: "Invalid request", 401: "Sign-in required", 403: "Not allowed", 404: "Not found",
                409: "Not possible now", 413: "Too large", 422: "Invalid request", 429: "Too many attempts",
                503: "Registry busy"}


def error_page(e: RegistryError) -> Response:
    """A refused or failed request under /ui as a page that says what was wrong."""
    html = pages.env().get_template("error.html").render(prefix=PREFIX, title=ERROR_TITLES.get(e.status, "Failed"),
                                                    nav="", csrf="",
                                                    message=e.message, back=f"{PREFIX}/fleet")
    return HTMLResponse(html, status_code=e.status, headers={"Content-Security-Policy": CSP,
                                                             "Cache-Control": "no-store"})


async def need_login(request: Request, e: Exception) -> Response:
    """No session: a page redirects to the login, live fragments and actions answer 401."""
    assert isinstance(e, LoginRequiredError)
    if e.live or request.method != "GET":
        return JSONResponse({"error": {"code": ErrorCode.INVALID_ARGUMENT.value, "message": "login required"}},
                            status_code=401, headers={"Cache-Control": "no-store"})
    nxt = urllib.parse.quote(request.url.path + ("?" + request.url.query if request.url.query else ""))
    return RedirectResponse(f"{PREFIX}/login?next={nxt}", status_code=303)
