"""Everything a device checks about a release before it downloads a byte of it."""

from __future__ import annotations

import time

from edged.protocol.fleet.release import ReleaseError, ReleaseManifest, SignedRelease, verify_release


class RefusedError(ReleaseError):
    """The release is refused; ``permanent`` when no later attempt can succeed (a lower number)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def check_release(signed: SignedRelease, *, model: str, public_keys: list[str], highest: int, device_id: str,
                  max_bytes: int, now: float | None = None) -> ReleaseManifest:
    """Signature, model, number (never below the highest accepted), expiry, target and size."""
    try:
        m = verify_release(signed, public_keys)
    except ReleaseError as e:
        raise RefusedError(str(e)) from None
    if m.model != model:
        raise RefusedError(f"the signed release is for model {m.model!r}, offered as {model!r}")
    if m.release < highest:
        raise RefusedError(f"release {m.release} is lower than release {highest} already accepted "
                           "(a rollback must be a new, higher release)", permanent=True)
    t = time.time() if now is None else now
    if m.expires_at <= t:
        raise RefusedError(f"release {m.release} expired at {m.expires_at} (device clock {int(t)})")
    if m.selector.devices and device_id not in m.selector.devices:
        raise RefusedError(f"release {m.release} is not signed for this device")
    if m.total_size > max_bytes:
        raise RefusedError(f"release {m.release} is {m.total_size / 1e6:.1f} MB, over the device's "
                           f"{max_bytes / 1e6:.1f} MB download limit")
    return m
