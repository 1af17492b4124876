"""The one place where the report of a failed update is built (refused, failed, rolled back).

Anything a failure report should carry from the device (its context, recent log lines) is
added here, once, for every way an update can fail.
"""

from __future__ import annotations

from typing import Any, Literal

from edged.protocol.fleet.messages import QualityReport
from edged.sync.registry_client import DeviceClient

FailureStep = Literal["failed", "rolled-back"]


def failure(  # noqa: PLR0913  the report event's fields, as ReportOutbox.report takes them
    client: DeviceClient,
    model: str,
    step: FailureStep,
    *,
    version: int | None,
    release: int | None,
    reason: str,
    detail: dict[str, Any] | None = None,
    quality: QualityReport | None = None,
    quiet: bool = False,
    later: bool = False,
) -> None:
    """Queue the report of a failed update (``quiet``: the caller logs it; ``later``: as ReportOutbox.report)."""
    client.outbox.report(
        model,
        step,
        version=version,
        release=release,
        reason=reason,
        detail=dict(detail or {}),
        quality=quality,
        quiet=quiet,
        later=later,
        logs=client.log_tail() if client.log_tail is not None else [],
    )
