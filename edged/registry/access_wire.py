"""What the access API sends and takes (named tokens, the audit log): pydantic only, so that the
operator's client imports no server code."""

from __future__ import annotations

from pydantic import BaseModel, Field

CLIENT_HEADER = "x-edged-client"  # "cli" from edged-registry: the audit log says where an action came from


class TokenCreate(BaseModel):
    name: str = Field(max_length=64, description="who holds it: the audit log names its actions so")
    role: str = Field(description="viewer, releaser or admin")


class TokenInfo(BaseModel):
    name: str
    role: str
    created_at: float
    created_by: str
    revoked_at: float | None = None


class TokenCreated(TokenInfo):
    token: str = Field(description="shown this once: the registry keeps only its sha256")


class AuditEntry(BaseModel):
    id: int
    at: float
    actor: str = Field(description="a token's name, a dashboard operator's, or 'bootstrap' (the admin token)")
    role: str
    source: str = Field(description="api, cli or dashboard")
    action: str
    target: str
    reason: str = ""


class AuditPage(BaseModel):
    entries: list[AuditEntry] = Field(description="newest first")
    total: int
