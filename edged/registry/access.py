"""Who may call what: one table with the access rule of every route (:data:`RULES`), and the one
dependency (:class:`Guard`, set on the whole app) that enforces it before any handler runs.

Callers are operators (a named API token, the bootstrap admin token, or a dashboard session),
devices (their credential, checked by the device routes themselves) or anyone (health, docs,
enrollment with a token in the body, the sign-in page). An operator has a role
(:mod:`edged.registry.roles`). A route that is not in :data:`RULES` is refused, so a route added
without a decision here cannot be called (and tests/registry/test_access.py fails: it walks the
app's routes).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import API_PREFIX
from edged.protocol.fleet.telemetry import INGEST_PATH
from edged.registry.access_wire import CLIENT_HEADER
from edged.registry.auth import TOKEN_PREFIX, bearer_token, is_admin
from edged.registry.roles import ROLES, Role
from edged.registry.service import RegistryError

BOOTSTRAP = "bootstrap"  # the actor named for the registry's own admin token (file or setting)


def role_named(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise RegistryError(f"no role {name!r} (roles: {', '.join(ROLES)})", 422, ErrorCode.INVALID_ARGUMENT) from None


@dataclass(frozen=True)
class Principal:
    """An operator who called: the name the audit log shows, their role, and where they called from."""

    name: str
    role: Role
    source: str  # api, cli or dashboard


class Kind(enum.Enum):
    PUBLIC = "public"  # anyone (the route may check a token of its own, as enrollment does)
    DEVICE = "device"  # a device credential, checked by the route; operator tokens are not one
    OPERATOR = "operator"  # an operator's bearer token with at least the rule's role
    PAGE = "page"  # a dashboard session with at least the rule's role
    BLOB = "blob"  # an operator (any role), or a device the route lets fetch this file


@dataclass(frozen=True)
class Rule:
    kind: Kind
    role: Role = Role.VIEWER


_PUBLIC, _DEVICE, _BLOB = Rule(Kind.PUBLIC), Rule(Kind.DEVICE), Rule(Kind.BLOB)
_VIEW, _RELEASE, _ADMIN = Rule(Kind.OPERATOR), Rule(Kind.OPERATOR, Role.RELEASER), Rule(Kind.OPERATOR, Role.ADMIN)
_PAGE, _PAGE_RELEASE = Rule(Kind.PAGE), Rule(Kind.PAGE, Role.RELEASER)
A, UI = API_PREFIX, "/ui"

# (method, route path) -> rule; HEAD is answered as GET. Every route of the app is here.
RULES: dict[tuple[str, str], Rule] = {
    # anyone
    ("GET", "/healthz"): _PUBLIC,
    ("GET", "/openapi.json"): _PUBLIC,
    ("GET", "/docs"): _PUBLIC,
    ("GET", "/docs/oauth2-redirect"): _PUBLIC,
    ("GET", "/redoc"): _PUBLIC,
    ("POST", f"{A}/enroll"): _PUBLIC,
    ("GET", f"{UI}/login"): _PUBLIC,
    ("POST", f"{UI}/login"): _PUBLIC,
    ("GET", f"{UI}/static/{{name}}"): _PUBLIC,
    # devices
    ("GET", f"{A}/device/desired-state"): _DEVICE,
    ("POST", f"{A}/device/reports"): _DEVICE,
    ("PUT", f"{A}/device/facts"): _DEVICE,
    ("POST", f"{A}/device/credential"): _DEVICE,
    ("POST", INGEST_PATH): _DEVICE,
    ("GET", f"{A}/blobs/{{sha256}}"): _BLOB,
    # operators: reading
    ("GET", f"{A}/devices"): _VIEW,
    ("GET", f"{A}/devices/{{device_id}}"): _VIEW,
    ("GET", f"{A}/status"): _VIEW,
    ("GET", f"{A}/models"): _VIEW,
    ("GET", f"{A}/models/{{model}}/versions/{{version}}"): _VIEW,
    ("GET", f"{A}/models/{{model}}/releases"): _VIEW,
    ("GET", f"{A}/models/{{model}}/next-release"): _VIEW,
    ("GET", f"{A}/rollouts"): _VIEW,
    ("GET", f"{A}/rollouts/{{rollout_id}}"): _VIEW,
    ("GET", f"{A}/models/{{model}}/rollback"): _VIEW,
    ("GET", f"{A}/devices/{{device_id}}/telemetry"): _VIEW,
    ("GET", f"{A}/models/{{model}}/telemetry"): _VIEW,
    ("GET", f"{A}/models/{{model}}/telemetry/summary"): _VIEW,
    ("GET", f"{A}/tokens"): _VIEW,
    ("GET", f"{A}/audit"): _VIEW,
    # operators: releasing
    ("POST", f"{A}/blobs/missing"): _RELEASE,
    ("PUT", f"{A}/blobs/{{sha256}}"): _RELEASE,
    ("PUT", f"{A}/models/{{model}}/versions/{{version}}"): _RELEASE,
    ("POST", f"{A}/releases"): _RELEASE,
    ("POST", f"{A}/models/{{model}}/releases/{{number}}/revoke"): _RELEASE,
    ("POST", f"{A}/rollouts"): _RELEASE,
    ("POST", f"{A}/rollouts/evaluate"): _RELEASE,
    ("POST", f"{A}/rollouts/{{rollout_id}}/{{action}}"): _RELEASE,
    ("POST", f"{A}/models/{{model}}/rollback"): _RELEASE,
    ("PATCH", f"{A}/devices/{{device_id}}/labels"): _RELEASE,
    ("PUT", f"{A}/devices/{{device_id}}/models/{{model}}/pin"): _RELEASE,
    # operators: administering
    ("POST", f"{A}/enrollment-tokens"): _ADMIN,
    ("POST", f"{A}/devices/{{device_id}}/reenroll"): _ADMIN,
    ("POST", f"{A}/devices/{{device_id}}/decommission"): _ADMIN,
    ("POST", f"{A}/tokens"): _ADMIN,
    ("POST", f"{A}/tokens/{{name}}/revoke"): _ADMIN,
    # the dashboard
    ("GET", UI): _PAGE,
    ("GET", f"{UI}/"): _PAGE,
    ("POST", f"{UI}/logout"): _PAGE,
    ("GET", f"{UI}/fleet"): _PAGE,
    ("GET", f"{UI}/devices/{{device_id}}"): _PAGE,
    ("GET", f"{UI}/models"): _PAGE,
    ("GET", f"{UI}/rollouts"): _PAGE,
    ("GET", f"{UI}/rollouts/{{rollout_id}}"): _PAGE,
    ("GET", f"{UI}/audit"): _PAGE,
    ("POST", f"{UI}/rollouts"): _PAGE_RELEASE,
    ("POST", f"{UI}/rollouts/{{rollout_id}}/{{action}}"): _PAGE_RELEASE,
}


def rule_for(method: str, path: str) -> Rule | None:
    return RULES.get(("GET" if method == "HEAD" else method, path))


def unauthenticated(what: str) -> RegistryError:
    return RegistryError(f"{what} is required", 401, ErrorCode.UNAUTHENTICATED)


def refused(who: Principal, needed: Role) -> RegistryError:
    return RegistryError(
        f"{who.name} is a {who.role.label}: this needs the {needed.label} role", 403, ErrorCode.PERMISSION_DENIED
    )


TokenLookup = Callable[[str], "tuple[str, Role] | None"]  # a named token's (name, role), by the token itself
PageSession = Callable[[Request], Awaitable[Principal]]  # the signed-in operator (raises when there is none)


class Guard:
    """The app-wide dependency: finds the route's rule, identifies the caller, refuses or lets through.

    An operator let through is ``request.state.principal`` (what :func:`principal` hands a handler
    for its audit row). Device and public routes cost nothing here: no database, no thread.
    """

    def __init__(self, admin_hash: str, lookup: TokenLookup) -> None:
        self.admin_hash, self.lookup = admin_hash, lookup
        self.pages: PageSession | None = None  # set by the dashboard when it is mounted

    async def __call__(self, request: Request) -> None:
        route = request.scope.get("route")
        rule = rule_for(request.method, getattr(route, "path", ""))
        if rule is None:  # fail closed: a route nobody decided on answers nobody
            raise RegistryError("this route has no access rule", 403, ErrorCode.PERMISSION_DENIED)
        if rule.kind in (Kind.PUBLIC, Kind.DEVICE):
            return
        if rule.kind is Kind.PAGE:
            if self.pages is None:
                raise unauthenticated("a dashboard session")
            who: Principal | None = await self.pages(request)
        else:
            who = await self.operator(request)
            if who is None:
                if rule.kind is Kind.BLOB:
                    return  # a device's request: the route checks its credential and release
                raise unauthenticated("an operator token")
        assert who is not None
        if who.role < rule.role:
            raise refused(who, rule.role)
        request.state.principal = who

    async def operator(self, request: Request) -> Principal | None:
        """The operator whose bearer token this is: the bootstrap admin, or a named token not revoked."""
        authorization = request.headers.get("authorization")
        source = "cli" if request.headers.get(CLIENT_HEADER) == "cli" else "api"
        if is_admin(authorization, self.admin_hash):
            return Principal(BOOTSTRAP, Role.ADMIN, source)
        token = bearer_token(authorization)
        if token is None or not token.startswith(TOKEN_PREFIX):  # device credentials never reach the table
            return None
        found = await run_in_threadpool(self.lookup, token)
        return Principal(found[0], found[1], source) if found is not None else None


def principal(request: Request) -> Principal:
    """The operator the guard let through (a dependency of the handlers that write an audit row)."""
    who = getattr(request.state, "principal", None)
    if not isinstance(who, Principal):  # only a route whose rule is not an operator's could get here
        raise RegistryError("no operator identified for this route", 500, ErrorCode.INTERNAL)
    return who


Actor = Annotated[Principal, Depends(principal)]
