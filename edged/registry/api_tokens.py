"""Named operator API tokens: made with a role, shown once, kept only as their sha256, revoked by name.

A revoked token's row stays (the audit log names it, and the name is not given out again).
"""

from __future__ import annotations

import re
import time

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from edged.registry.access import BOOTSTRAP, role_named
from edged.registry.access_tables import ApiTokenRow
from edged.registry.access_wire import TokenCreate, TokenCreated, TokenInfo
from edged.registry.auth import TOKEN_PREFIX, new_token, token_hash
from edged.registry.roles import Role
from edged.registry.service import conflict, invalid, not_found

NAME = re.compile(r"[a-z0-9][a-z0-9_.@-]{0,63}")


def _info(row: ApiTokenRow) -> TokenInfo:
    return TokenInfo(
        name=row.name, role=row.role, created_at=row.created_at, created_by=row.created_by, revoked_at=row.revoked_at
    )


def create(s: Session, req: TokenCreate, by: str) -> TokenCreated:
    role = role_named(req.role)
    if not NAME.fullmatch(req.name) or req.name == BOOTSTRAP:
        raise invalid(
            f"token name {req.name!r}: 1-64 of a-z 0-9 _ . @ - (starting with a letter or digit), not {BOOTSTRAP!r}"
        )
    if s.scalar(select(ApiTokenRow.id).where(ApiTokenRow.name == req.name)) is not None:
        raise conflict(f"a token named {req.name!r} exists (revoked names are not given out again)")
    token = new_token(TOKEN_PREFIX)
    row = ApiTokenRow(
        name=req.name, role=role.label, token_hash=token_hash(token), created_at=time.time(), created_by=by
    )
    s.add(row)
    s.flush()
    return TokenCreated(**_info(row).model_dump(), token=token)


def listing(s: Session) -> list[TokenInfo]:
    return [_info(r) for r in s.scalars(select(ApiTokenRow).order_by(ApiTokenRow.name))]


def revoke(s: Session, name: str) -> TokenInfo:
    row = s.scalar(select(ApiTokenRow).where(ApiTokenRow.name == name))
    if row is None:
        raise not_found(f"token {name!r}")
    if row.revoked_at is None:
        row.revoked_at = time.time()
    return _info(row)


def lookup(read_sessions: sessionmaker[Session], token: str) -> tuple[str, Role] | None:
    """The (name, role) of a token that is not revoked, else None: one indexed read."""
    with read_sessions() as s, s.begin():
        row = s.execute(
            select(ApiTokenRow.name, ApiTokenRow.role).where(
                ApiTokenRow.token_hash == token_hash(token), ApiTokenRow.revoked_at.is_(None)
            )
        ).first()
    return (row.name, role_named(row.role)) if row is not None else None
