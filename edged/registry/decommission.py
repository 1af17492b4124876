"""Decommissioning a device: it can no longer call, it takes part in no rollout, its history stays.

The mark is an operator label, ``decommissioned=<UTC date>``, so it needs no schema change and shows
wherever labels do (fleet page, ``edged-registry devices``, the API); the credential is replaced by
one nobody knows, as ``reenroll`` does. Undoing it is ``edged-registry label ID decommissioned=``
and ``edged-registry reenroll ID``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from edged.registry.auth import DEVICE_PREFIX, new_token, token_hash
from edged.registry.db import DeviceRow
from edged.registry.service import bump_revision, not_found

LABEL = "decommissioned"


def decommission(s: Session, device_id: str, *, now: float | None = None) -> None:
    dev = s.get(DeviceRow, device_id)
    if dev is None:
        raise not_found(f"device {device_id!r}")
    dev.credential_hash = token_hash(new_token(DEVICE_PREFIX))  # nobody knows this one
    if LABEL not in (dev.admin_labels or {}):
        when = time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))
        dev.admin_labels = {**(dev.admin_labels or {}), LABEL: when}
    bump_revision(s)  # rollouts recount without it


def is_decommissioned(labels: Mapping[str, Any]) -> bool:
    return LABEL in labels
