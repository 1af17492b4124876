"""The tables of who may call the registry and what they did: named API tokens and the audit log.

Kept in a module of their own (registered in :mod:`edged.registry.schema`) so that the access
control and the audit log evolve apart from the fleet's tables; the ``0008_tokens_audit``
migration creates them, and on both databases a trigger refuses any UPDATE or DELETE of
``audit_log`` (the log only grows).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from edged.registry.db import Base, now

_ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only an INTEGER primary key


class ApiTokenRow(Base):
    """A named operator token: only its sha256 is kept; revoking keeps the row (the audit log names it)."""

    __tablename__ = "api_tokens"
    __table_args__ = (Index("ix_api_tokens_token_hash", "token_hash", unique=True),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Double, default=now)
    created_by: Mapped[str] = mapped_column(String(64))
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class AuditRow(Base):
    """One operator action, written in the transaction of the action itself."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_at", "at"),)
    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Double, default=now)
    actor: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(16))  # api, cli or dashboard
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(Text, default="")
