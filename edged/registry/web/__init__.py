"""The registry's web dashboard (``/ui``): fleet, devices, models and releases, rollouts.

Served by ``edged-registry serve`` itself from templates and static files shipped in this
package (nothing is fetched from elsewhere at run time). See docs/dashboard.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from sqlalchemy.orm import Session, sessionmaker

from edged.registry.desired import SnapshotCache
from edged.registry.service import RegistryError
from edged.registry.settings import RegistrySettings

if TYPE_CHECKING:
    from edged.registry.access import Guard
    from edged.registry.web.worker import PageRenderer


def renderer(settings: RegistrySettings, read_sessions: sessionmaker[Session],
             snapshots: SnapshotCache) -> PageRenderer:
    """Where pages are read and rendered (:mod:`edged.registry.web.worker`): a child process unless
    ``dashboard_process = false``; nothing starts before the first page or login."""
    from edged.registry.web.pages import Pages
    from edged.registry.web.worker import InProcess, PageProcess

    if settings.dashboard_process:
        return PageProcess(settings.db_url, poll_s=settings.dashboard_poll_s, online_s=settings.dashboard_online_s)
    return InProcess(Pages(read_sessions, snapshots, poll_s=settings.dashboard_poll_s,
                           online_s=settings.dashboard_online_s))


def install(app: FastAPI, guard: Guard, *, settings: RegistrySettings, admin_hash: str, sessions: sessionmaker[Session],  # noqa: PLR0913  the app's parts the dashboard shares, keyword-only
            read_sessions: sessionmaker[Session], renderer: PageRenderer,
            on_rollout_change: Callable[[int, str], None]) -> None:
    """Mount the dashboard; call after the app's own exception handlers so errors under /ui become pages.
    ``guard`` (the app's access check) learns from it who is signed in."""
    from edged.registry.web.pages import PREFIX
    from edged.registry.web.router import LoginRequiredError, dashboard_router, error_page, need_login

    app.include_router(dashboard_router(guard, settings=settings, admin_hash=admin_hash, sessions=sessions,
                                        read_sessions=read_sessions, renderer=renderer,
                                        on_rollout_change=on_rollout_change))
    app.add_exception_handler(LoginRequiredError, need_login)
    api_error: Any = app.exception_handlers.get(RegistryError)

    async def registry_error(request: Request, e: Exception) -> Response:
        if request.url.path.startswith(PREFIX + "/") and request.query_params.get("part") != "live":
            assert isinstance(e, RegistryError)
            return error_page(e)
        resp: Response = await api_error(request, e)
        return resp

    app.add_exception_handler(RegistryError, registry_error)
