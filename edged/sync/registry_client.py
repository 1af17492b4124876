"""The device's conversation with the registry, one part per job, over one HTTP client.

``auth`` (:mod:`.enrollment`): enroll, then send requests with the device credential;
``desired`` (:mod:`.desired`): poll the desired state; ``outbox`` (:mod:`.outbox`): send
reports in order from a persistent outbox; ``facts`` (:mod:`.facts`): tell the registry what
the device is and serves. Release files are fetched by :mod:`.download`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from edged.sync.capped_http import RegistryHttp
from edged.sync.desired import DesiredStatePoller
from edged.sync.enrollment import DeviceAuth
from edged.sync.facts import FactsSender, base_facts
from edged.sync.outbox import ReportOutbox
from edged.sync.settings import SyncSettings
from edged.sync.state import StateStore, SyncState

log = logging.getLogger(__name__)


class DeviceClient:
    def __init__(
        self,
        settings: SyncSettings,
        http: RegistryHttp,
        store: StateStore,
        state: SyncState,
        extra_facts: dict[str, Any] | None = None,
    ) -> None:
        self.http = http
        extra = dict(extra_facts or {})  # device profile and hardware facts, for rollout targets
        self.auth = DeviceAuth(settings, http, store, lambda: base_facts(extra))
        self.desired = DesiredStatePoller(self.auth, settings.device_id)
        self.outbox = ReportOutbox(self.auth, store, state)
        # The daemon's last log lines (edged.logring), attached to a failed update's report: what the device
        # said around the failure, for the operator who has no shell on it.
        self.log_tail: Callable[[], list[str]] | None = None
        self.facts = FactsSender(self.auth, extra)
        if settings.labels:
            log.warning(
                "[registry] labels (%s) are not sent: labels are set by operators "
                "(edged-registry label, or enroll-token --label); a device never labels itself",
                ", ".join(sorted(settings.labels)),
            )

    def start(self) -> None:
        """Reports are sent by their own thread, so a slow or unreachable registry never holds up an update."""
        self.outbox.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.outbox.stop(timeout)
