"""The steps of a model update and the moves allowed between them, as data.

The step reached is part of the persisted sync state (``Pending.step``, written atomically
before the next step begins), so a process killed at any instant resumes at that step.
``None`` stands for "no update in progress": where an update starts, and where it ends
(committed, rolled back, or abandoned before activation).
"""

from __future__ import annotations

from collections.abc import Callable

from edged.errors import EdgedError, ErrorCode
from edged.sync.state import ModelSync, Pending, PendingStep, StateStore, SyncState

Step = PendingStep | None

NEXT: dict[Step, frozenset[Step]] = {
    None: frozenset({"download"}),
    "download": frozenset({"prepare", None}),  # None: superseded, refused for good, reverted
    "prepare": frozenset({"install", "download", "rollback", None}),  # download: the staged copy was damaged
    "install": frozenset({"activate", "download", None}),  # download: the staged copy is gone
    "activate": frozenset({"trial", "rollback", None}),
    "trial": frozenset({"rollback", None}),  # None: committed
    "rollback": frozenset({None}),
}
# Steps that run on the sync thread until they finish; a trial is visited again and again until its deadline.
WAITING: frozenset[Step] = frozenset({"trial"})


class IllegalMoveError(EdgedError):
    """A step asked for a move the machine does not allow: a bug, never a property of the release."""

    code = ErrorCode.INTERNAL


def start(store: StateStore, state: SyncState, model: str, pending: Pending) -> None:
    """Begin an update of ``model`` (its release becomes the highest accepted), in one atomic write."""
    with store.lock:
        ms = state.model(model)
        if ms.pending is not None or pending.step not in NEXT[None]:
            raise IllegalMoveError(f"model={model}: an update may not start at {pending.step!r} here")
        ms.highest_release = max(ms.highest_release, pending.release)
        ms.pending = pending
        store.save(state)


def move(
    store: StateStore, state: SyncState, model: str, to: PendingStep, also: Callable[[ModelSync], None] | None = None
) -> None:
    """Persist the update of ``model`` at step ``to`` (with ``also``'s changes, in the same atomic write).

    A completed step clears the last local fault and, going forward, a refusal of the release.
    """
    with store.lock:
        ms = state.model(model)
        p = ms.pending
        if p is None:
            raise IllegalMoveError(f"model={model}: no update in progress to move to {to!r}")
        if to != p.step and to not in NEXT[p.step]:
            raise IllegalMoveError(f"model={model}: an update may not go from {p.step!r} to {to!r}")
        p.step = to
        p.fault = None
        if to != "rollback":
            ms.refused.pop(p.release, None)
        if also is not None:
            also(ms)
        store.save(state)


def finish(store: StateStore, state: SyncState, model: str, also: Callable[[ModelSync], None]) -> None:
    """End the update of ``model`` (``also`` records how), in one atomic write."""
    with store.lock:
        ms = state.model(model)
        p = ms.pending
        if p is not None and None not in NEXT[p.step]:
            raise IllegalMoveError(f"model={model}: an update may not end at {p.step!r}")
        also(ms)
        ms.pending = None
        store.save(state)
