"""Prometheus exposition for ``/metrics``: delegates to the telemetry collector."""

from __future__ import annotations

from edged.core.service import InferenceService
from edged.telemetry.prometheus import CONTENT_TYPE, renderer_for


class MetricsEndpoint:
    content_type = CONTENT_TYPE

    def __init__(self, service: InferenceService) -> None:
        self._renderer = renderer_for(service)

    def render(self) -> bytes:
        return self._renderer.render()
