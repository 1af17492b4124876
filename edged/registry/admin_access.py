"""Access, for the operator client: named API tokens and the audit log."""

from __future__ import annotations

from pydantic import TypeAdapter

from edged.registry.access_wire import AuditPage, TokenCreate, TokenCreated, TokenInfo
from edged.registry.admin_http import AdminHttp


class AccessApi(AdminHttp):
    def create_token(self, name: str, role: str) -> TokenCreated:
        r = self._send("POST", "/tokens", TokenCreate(name=name, role=role))
        return TokenCreated.model_validate_json(r.content)

    def tokens(self) -> list[TokenInfo]:
        return TypeAdapter(list[TokenInfo]).validate_json(self._call("GET", "/tokens").content)

    def revoke_token(self, name: str) -> TokenInfo:
        return TokenInfo.model_validate_json(self._call("POST", f"/tokens/{name}/revoke").content)

    def audit(self, limit: int = 100, offset: int = 0) -> AuditPage:
        r = self._call("GET", "/audit", params={"limit": limit, "offset": offset})
        return AuditPage.model_validate_json(r.content)
