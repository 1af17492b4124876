"""What the registry's routers share: the bearer scheme, the admin check and a write transaction."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from edged.errors import ErrorCode
from edged.registry.auth import is_admin
from edged.registry.service import RegistryError

bearer_scheme = HTTPBearer(auto_error=False, description="admin token, or a device credential")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def credential(auth: HTTPAuthorizationCredentials | None) -> str:
    """The ``Authorization`` header value back from FastAPI's parsed form ("" when none was sent)."""
    return f"Bearer {auth.credentials}" if auth is not None else ""


def admin_check(admin_hash: str) -> Callable[[HTTPAuthorizationCredentials | None], None]:
    """A dependency that refuses (401) anything but the admin token."""

    def require_admin(auth: Bearer) -> None:
        if not is_admin(credential(auth), admin_hash):
            raise RegistryError("an admin token is required", 401, ErrorCode.INVALID_ARGUMENT)

    return require_admin


@contextlib.contextmanager
def transaction(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """One session in one committed transaction (rolled back when the block raises)."""
    with sessions() as s, s.begin():
        yield s
