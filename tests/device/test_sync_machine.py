"""The update's state machine: its moves are data, every step is reachable and can end, a move is persisted."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from edged.protocol.fleet.release import SignedRelease
from edged.sync.state import Pending, PendingStep, StateStore
from edged.sync.update.machine import NEXT, IllegalMoveError, finish, move, start


def test_every_step_is_reachable_and_every_update_can_end() -> None:
    steps = set(typing.get_args(PendingStep))
    assert set(NEXT) == steps | {None}
    seen, todo = {None}, [None]
    while todo:
        for nxt in NEXT[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == steps | {None}
    assert all(None in NEXT[s] for s in steps)  # a crash-safe way out of every step


def test_a_move_is_persisted_and_an_illegal_one_changes_nothing(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = store.load()
    signed = SignedRelease(manifest="e30=", signature="", key_id="0")
    start(store, state, "m", Pending(release=3, version=2, step="download", signed=signed, fault="disk full"))
    assert store.load().models["m"].highest_release == 3
    with pytest.raises(IllegalMoveError):
        start(store, state, "m", Pending(release=4, version=3, step="download", signed=signed))  # one at a time
    move(store, state, "m", "prepare")
    on_disk = store.load().models["m"].pending
    assert on_disk is not None and (on_disk.step, on_disk.fault) == ("prepare", None)
    with pytest.raises(IllegalMoveError):
        move(store, state, "m", "trial")  # never without install and activation
    assert store.load().models["m"].pending.step == "prepare"  # type: ignore[union-attr]
    finish(store, state, "m", lambda ms: None)
    assert store.load().models["m"].pending is None
