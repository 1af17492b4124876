"""What the registry's routers share: the app's parts (:class:`AppContext`), the bearer scheme,
device authentication and the transactions (who may call a route is :mod:`edged.registry.access`'s)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Query
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from edged.errors import ErrorCode
from edged.protocol.fleet.messages import MAX_INT32
from edged.protocol.fleet.nudge import Nudger
from edged.registry import desired as desired_state
from edged.registry import service
from edged.registry.auth import bearer_token, token_hash
from edged.registry.blob_urls import UrlSigner
from edged.registry.blobs import BlobStore, SmallBlobCache
from edged.registry.db import DeviceRow
from edged.registry.lastseen import LastSeen
from edged.registry.service import RegistryError
from edged.registry.settings import RegistrySettings
from edged.registry.writer import ReportWriter

log = logging.getLogger(__name__)

bearer_scheme = HTTPBearer(auto_error=False, description="an operator token, or a device credential")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
# Ids, versions, release numbers and offsets in paths and queries: what the database stores (32-bit columns on
# PostgreSQL). Beyond it is a 400 naming the parameter, never the database's overflow as a 500.
PathNumber = Annotated[int, Path(ge=0, le=MAX_INT32)]
QueryNumber = Annotated[int | None, Query(ge=0, le=MAX_INT32)]


@contextlib.contextmanager
def transaction(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """One session in one committed transaction (rolled back when the block raises)."""
    with sessions() as s, s.begin():
        yield s


@dataclass
class AppContext:
    """The parts one registry app is built from, handed to each router (nothing module-level)."""

    settings: RegistrySettings
    engine: Engine
    sessions: sessionmaker[Session]
    read_sessions: sessionmaker[Session]
    ro_engine: Engine
    snapshots: desired_state.SnapshotCache
    last_seen: LastSeen
    report_writer: ReportWriter
    store: BlobStore
    blob_cache: SmallBlobCache
    nudger: Nudger | None
    blob_signer: UrlSigner | None = None  # set: devices fetch blobs from the blob server (signed URLs)

    def tx(self) -> contextlib.AbstractContextManager[Session]:
        return transaction(self.sessions)

    @contextlib.contextmanager
    def rtx(self) -> Iterator[Session]:
        """For reads only: on SQLite it does not wait for, or hold, the write lock."""
        with self.read_sessions() as s, s.begin():
            yield s

    def authenticate(self, conn: Connection, authorization: str | None) -> desired_state.DeviceView:
        """The device holding the credential in this ``Authorization`` header value (401 when none does)."""
        return self._credential(conn, authorization)[0]

    def decide(self, conn: Connection, authorization: str | None) -> desired_state.Desired:
        """The hot path of a large fleet: one read-only query, the cached snapshot, no write."""
        view, rev = self._credential(conn, authorization)
        out = desired_state.decide(self.snapshots.get(conn, rev), view)
        self.last_seen.note(view.id, view.last_seen_at)
        return out

    @staticmethod
    def _credential(conn: Connection, authorization: str | None) -> tuple[desired_state.DeviceView, int]:
        """The device holding the credential and the registry revision (401 when none does)."""
        token = bearer_token(authorization)
        view, rev = desired_state.lookup_credential(conn, token_hash(token)) if token else (None, 0)
        if view is None:
            raise unauthorized()
        return view, rev

    def nudge(self, payload: dict[str, Any]) -> None:
        if self.nudger is not None:
            try:
                self.nudger.nudge(payload)
            except Exception as e:  # a nudge is an optimisation; never fail the release over it
                log.warning("MQTT nudge not sent: %s", e)

    def rollout_changed(self, changes: dict[int, str]) -> None:
        for rid, what in changes.items():
            self.nudge({"rollout": rid, "change": what})


def unauthorized() -> RegistryError:
    """A missing or refused device credential: the device forgets it on a 401 (edged.sync.enrollment)."""
    return RegistryError("a valid device credential is required", 401, ErrorCode.UNAUTHENTICATED)


def device_of(s: Session, auth: HTTPAuthorizationCredentials | None) -> DeviceRow:
    """The device holding the credential in ``auth`` (401 when none does)."""
    dev = service.device_for_credential(s, auth.credentials) if auth is not None else None
    if dev is None:
        raise unauthorized()
    return dev
