"""Operators' tokens and the audit log: make, list and revoke named API tokens; read the log.

Who may call these is in :data:`edged.registry.access.RULES` (reading: any operator; tokens: admin).
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query

from edged.protocol.fleet.messages import API_PREFIX, MAX_INT32
from edged.registry import api_tokens, audit
from edged.registry.access import Actor
from edged.registry.access_wire import AuditPage, TokenCreate, TokenCreated, TokenInfo
from edged.registry.deps import AppContext

log = logging.getLogger(__name__)


def access_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["access"])

    @router.post(f"{API_PREFIX}/tokens", response_model=TokenCreated, status_code=201)
    def create_token(req: TokenCreate, who: Actor) -> TokenCreated:
        """A new named token with a role; the token itself is in this answer only."""
        with ctx.tx() as s:
            out = api_tokens.create(s, req, who.name)
            audit.record(s, who, "token.create", f"token {out.name}", f"role {out.role}")
        log.info("API token %s (%s) created by %s", out.name, out.role, who.name)
        return out

    @router.get(f"{API_PREFIX}/tokens", response_model=list[TokenInfo])
    def list_tokens() -> list[TokenInfo]:
        with ctx.rtx() as s:
            return api_tokens.listing(s)

    @router.post(f"{API_PREFIX}/tokens/{{name}}/revoke", response_model=TokenInfo)
    def revoke_token(name: str, who: Actor) -> TokenInfo:
        with ctx.tx() as s:
            out = api_tokens.revoke(s, name)
            audit.record(s, who, "token.revoke", f"token {name}")
        log.info("API token %s revoked by %s", name, who.name)
        return out

    @router.get(f"{API_PREFIX}/audit", response_model=AuditPage)
    def audit_log(
        limit: Annotated[int, Query(ge=1, le=audit.MAX_PAGE)] = 100,
        offset: Annotated[int, Query(ge=0, le=MAX_INT32)] = 0,
    ) -> AuditPage:
        """The audit log, newest first."""
        with ctx.rtx() as s:
            return audit.recent(s, limit, offset)

    return router
