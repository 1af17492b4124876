"""Operator-side client of the registry API (used by ``edged-registry``): push folders, sign releases,
run rollouts, manage the fleet and access.

One HTTP session (:mod:`.admin_http`) with one module per job mixed in; signing happens here, on the
operator's machine, with their private key: the registry only ever sees the signed envelope.
"""

from __future__ import annotations

from edged.registry.admin_access import AccessApi
from edged.registry.admin_fleet import FleetApi
from edged.registry.admin_http import RegistryClientError
from edged.registry.admin_releases import folder_files
from edged.registry.admin_rollouts import RolloutsApi

__all__ = ["RegistryClient", "RegistryClientError", "folder_files"]


class RegistryClient(RolloutsApi, FleetApi, AccessApi):
    """Everything an operator can ask of the registry (publishing comes with rollouts)."""

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
