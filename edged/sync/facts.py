"""What the device tells the registry about itself: profile, hardware, version, and what it serves."""

from __future__ import annotations

import logging
import socket
from typing import Any

from edged import __version__
from edged.protocol.fleet.messages import API_PREFIX, DeviceFactsUpdate, ServingModel
from edged.sync.enrollment import DeviceAuth, error_message

log = logging.getLogger(__name__)


def base_facts(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` (the device profile and hardware facts, for rollout targets) with edged's version and host."""
    return {**extra, "edged_version": __version__, "hostname": socket.gethostname()}


class FactsSender:
    def __init__(self, auth: DeviceAuth, extra: dict[str, Any]) -> None:
        self.auth, self.extra = auth, extra

    def send(self, serving: list[ServingModel]) -> bool:
        """True when the registry took them; a busy registry (503) hears them at a later poll."""
        upd = DeviceFactsUpdate(facts=base_facts(self.extra), serving=serving)
        status, _, data = self.auth.request("PUT", f"{API_PREFIX}/device/facts", body=upd.model_dump_json().encode())
        if status == 503:
            log.debug("registry busy: facts sent again at the next poll")
            return False
        if status != 200:
            log.warning("registry refused facts (%d): %s", status, error_message(data))
        return True
