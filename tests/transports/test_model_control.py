"""Repository loads over a transport: answered at once when the transport stops, and a load nobody
awaits any more (the transport stopped, or the caller went away) ends without an orphaned error."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any, cast

import pytest

from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode
from edged.transports.v2_ops import ModelControl


class _SlowFailingLoads:
    """The one method run_model_control calls for a load: blocks until let go, then fails like an
    engine that gave up (what a real load does minutes into an engine call nobody can interrupt)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()

    def load(self, name: str) -> list[Any]:
        self.entered.set()
        try:
            assert self.release.wait(10), "the test never let the load go"
            raise EdgedError(f"model {name!r}: the engine gave up", code=ErrorCode.INTERNAL)
        finally:
            self.ended.set()


async def _orphan_errors_after(loads: _SlowFailingLoads, loop: asyncio.AbstractEventLoop,
                               reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Let the load fail, wait for its thread and task to end, collect garbage: what asyncio reported."""
    loads.release.set()
    await asyncio.to_thread(loads.ended.wait, 10)
    current, deadline = asyncio.current_task(), time.monotonic() + 10
    while any(t is not current and not t.done() for t in asyncio.all_tasks()):  # the load's task ends
        assert time.monotonic() < deadline, "the load's task never ended"
        await asyncio.sleep(0.01)
    gc.collect()  # a task nobody retrieved reports its error from its finalizer, at once
    return [r for r in reported if "never retrieved" in str(r.get("message", ""))]


def _watch(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    return reported


async def _a_load_under_way() -> tuple[asyncio.AbstractEventLoop, list[dict[str, Any]], _SlowFailingLoads,
                                       ModelControl, asyncio.Future[None]]:
    """A caller awaiting a load asked for over a transport, the load inside its engine call."""
    loop = asyncio.get_running_loop()
    reported = _watch(loop)
    loads = _SlowFailingLoads()
    control = ModelControl()
    caller = asyncio.ensure_future(control.run(cast(InferenceService, loads), "digits", "load"))
    await asyncio.to_thread(loads.entered.wait, 10)
    return loop, reported, loads, control, caller


def test_a_stop_answers_the_waiting_caller_and_the_load_fails_later_unheard() -> None:
    async def scenario() -> list[dict[str, Any]]:
        loop, reported, loads, control, caller = await _a_load_under_way()
        control.stop()
        with pytest.raises(EdgedError) as err:
            await asyncio.wait_for(caller, 5)
        assert err.value.code is ErrorCode.UNAVAILABLE and "'digits'" in str(err.value)
        del err, caller  # the traceback's frames hold the load's task: let it go as a transport does
        assert not loads.ended.is_set()  # answered while the load still runs
        return await _orphan_errors_after(loads, loop, reported)

    assert asyncio.run(scenario()) == []


def test_a_caller_that_goes_away_leaves_the_load_running_and_its_error_retrieved() -> None:
    async def scenario() -> list[dict[str, Any]]:
        loop, reported, loads, control, caller = await _a_load_under_way()
        caller.cancel()  # what a transport does when the client's connection drops
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not loads.ended.is_set()
        control.stop()  # nothing waits any more: a later stop has nobody to answer
        del caller
        return await _orphan_errors_after(loads, loop, reported)

    assert asyncio.run(scenario()) == []
