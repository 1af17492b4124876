"""What the device does with one entry of its desired state: pure decisions over the sync state.

Kept free of I/O so the real :class:`~edged.sync.updater.Updater` and the fleet simulator
(``python -m bench.sim``) decide exactly alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from edged.sync.state import ModelSync, Refusal

BEFORE_ACTIVATION = ("download", "prepare", "install")
REVERT_PREFIX = "the registry asked to return to the last-known-good"  # how a revert's reason begins
RevertAction = Literal["none", "forget", "abandon", "rollback", "to-lkg", "no-lkg"]


@dataclass(frozen=True)
class Verdict:
    abandon: bool  # drop the update in progress first: another release superseded it before activation
    action: Literal["idle", "start", "resume"]


def decide(ms: ModelSync, release: int, now: float) -> Verdict:
    """Offered ``release`` of a model: ignore it, start it, or carry on with the one in progress."""
    p = ms.pending
    if p is not None and p.step not in BEFORE_ACTIVATION:
        return Verdict(False, "idle")  # activated: finished at start-up, or it ran to its end already
    abandon = p is not None and p.release != release
    if abandon:
        p = None
    if p is None:
        if ms.current is not None and ms.current.release == release:
            return Verdict(abandon, "idle")
        if release in ms.rejected:
            return Verdict(abandon, "idle")
    refusal = ms.refused.get(release)
    if refusal is not None and now < refusal.retry_at:
        return Verdict(abandon, "idle")
    return Verdict(abandon, "resume" if p is not None else "start")


def next_refusal(prev: Refusal | None, reason: str, now: float, *, poll_interval_s: float,
                 retry_max_s: float) -> Refusal:
    """A refused release is retried later, each time twice as late, up to ``retry_max_s``."""
    count = prev.count + 1 if prev else 1
    delay = min(retry_max_s, max(1.0, min(poll_interval_s, 10.0)) * 2 ** (count - 1))
    return Refusal(reason=reason, count=count, retry_at=now + delay)


def revert_action(ms: ModelSync, releases: Collection[int]) -> tuple[RevertAction, int | None]:
    """The registry says these releases must not run here (their rollout was halted or rolled back).

    ``abandon``: one is being downloaded or prepared; ``rollback``: one is activated or on
    trial; ``to-lkg``: one is committed and a last-known-good is kept; ``no-lkg``: committed
    with nothing to go back to; ``forget``: never had it, remember never to install it.
    """
    p = ms.pending
    if p is not None and p.release in releases:
        if p.step == "rollback":
            return "none", None  # already going back
        return ("abandon" if p.step in BEFORE_ACTIVATION else "rollback"), p.release
    cur = ms.current
    if cur is not None and cur.release in releases:
        return ("to-lkg" if ms.lkg is not None else "no-lkg"), cur.release
    missing = [r for r in releases if r not in ms.rejected]
    return ("forget", missing[0]) if missing else ("none", None)
