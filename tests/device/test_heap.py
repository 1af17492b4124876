"""Start-up's objects frozen from the cyclic collector (edged/heap.py): skipped while frozen, collected
by a review once they die, a review asked for when a model version is retired, and nothing left frozen
after the keeper stops (the process's collector works as before)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.heap import HeapKeeper, review
from edged.profiles import BackendPreference
from tests.polling import wait_until

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


class Node:
    other: Node | None = None


def held_cycle() -> tuple[Node, weakref.ref[Node]]:
    """Two objects referring to each other: garbage only the cyclic collector can free, once let go."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


@pytest.fixture
def keeper() -> Iterator[Callable[..., HeapKeeper]]:
    made: list[HeapKeeper] = []

    def make(**kw: float) -> HeapKeeper:
        k = HeapKeeper(**kw)
        made.append(k)
        return k
    yield make
    for k in made:
        k.stop()
    assert gc.get_freeze_count() == 0, "a stopped keeper leaves nothing frozen"


def test_frozen_objects_are_skipped_until_a_review_collects_those_that_died(
        keeper: Callable[..., HeapKeeper]) -> None:
    strong, startup = held_cycle()
    frozen = keeper(interval_s=3600).start()
    assert frozen.objects > 1000 and gc.get_freeze_count() == frozen.objects
    del strong  # start-up's object dies in a cycle
    gc.collect()
    assert startup() is not None, "frozen: the collector does not look at it"
    late_strong, late = held_cycle()
    del late_strong
    gc.collect()
    assert late() is None, "what serving makes after the freeze is collected as before"
    after = review()
    assert startup() is None, "a review collects what died while frozen"
    assert after is not None and after.objects > 1000, "and freezes the rest again"


def test_a_second_keeper_takes_over_and_only_the_current_one_unfreezes(
        keeper: Callable[..., HeapKeeper]) -> None:
    """Two daemons in one process (tests): the first keeper stops, the freeze stays the second's."""
    first, second = keeper(interval_s=3600), keeper(interval_s=3600)
    first.start()
    frozen = second.start()  # hung for good before: the first's stop took the keepers' lock again
    assert gc.get_freeze_count() == frozen.objects > 1000
    first.stop()
    assert gc.get_freeze_count() == frozen.objects, "a keeper that is not the current one leaves the freeze"
    second.stop()
    assert gc.get_freeze_count() == 0
    stopped = threading.Event()
    stopped.set()
    assert review(unless=stopped) is None and gc.get_freeze_count() == 0, "a stopped keeper's review freezes nothing"


def test_a_review_asked_for_happens_soon(keeper: Callable[..., HeapKeeper]) -> None:
    strong, startup = held_cycle()
    k = keeper(interval_s=3600, soon_s=0.05)
    k.start()
    del strong
    k.soon()
    wait_until(lambda: k.reviews, 10, what="the review asked for")
    assert startup() is None, "it collected the dead start-up cycle"
    assert k.reviews == 1


def test_retiring_a_model_version_asks_the_running_keeper_for_a_review(
        keeper: Callable[..., HeapKeeper], model_repo: Callable[..., Path]) -> None:
    manager = ModelManager(model_repo("digits"), ModelsSection(), ORT_CPU)
    try:
        manager.load_all()
        mv = manager.table.find("digits")
        assert mv is not None
        # What the version holds from start-up, in a cycle with it (as callbacks and closures make them).
        strong, held = held_cycle()
        strong.other.version = mv  # type: ignore[union-attr]
        mv.held_for_test = strong  # type: ignore[attr-defined]
        del strong, mv  # the table holds the version until it is retired
        k = keeper(interval_s=3600, soon_s=0.05)
        k.start()
        manager.unload_model("digits")
        wait_until(lambda: k.reviews, 10, what="a review after the version was retired")
        assert held() is None, "the retired version's cycle was collected"
    finally:
        manager.shutdown()
