"""Which dashboard sessions are open, held in the registry's database so that every process agrees.

A session cookie proves who signed in (:mod:`edged.registry.web.session`); it is honoured only
while its row is here. Signing out deletes the row, so the cookie stops working at once in every
registry process, also when it was copied before. Rotating the admin token or removing (or
re-passwording) an operator ends sessions through the cookie's MAC, whatever the rows say.
The row is keyed by the nonce's sha256: the table never holds anything a cookie could be made from.
"""

from __future__ import annotations

import hashlib
import time

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from edged.registry.db import DashboardSessionRow


def _key(nonce: str) -> str:
    return hashlib.sha256(b"edged-dashboard-session\0" + nonce.encode("utf-8", "replace")).hexdigest()


class SessionStore:
    def __init__(self, sessions: sessionmaker[Session], read_sessions: sessionmaker[Session]) -> None:
        self.sessions, self.read_sessions = sessions, read_sessions

    def open(self, nonce: str, who: str, expires_at: float) -> None:
        """Record a new session (and forget those that expired)."""
        now = time.time()
        with self.sessions() as s, s.begin():
            s.execute(delete(DashboardSessionRow).where(DashboardSessionRow.expires_at < now))
            s.add(DashboardSessionRow(id=_key(nonce), who=who, expires_at=float(expires_at), created_at=now))

    def is_open(self, nonce: str, who: str) -> bool:
        """One primary-key read: the session was opened for ``who``, not closed, not expired."""
        with self.read_sessions() as s, s.begin():
            row = s.execute(select(DashboardSessionRow.who, DashboardSessionRow.expires_at)
                            .where(DashboardSessionRow.id == _key(nonce))).first()
        return row is not None and row.who == who and row.expires_at >= time.time()

    def close(self, nonce: str) -> None:
        with self.sessions() as s, s.begin():
            s.execute(delete(DashboardSessionRow).where(DashboardSessionRow.id == _key(nonce)))
