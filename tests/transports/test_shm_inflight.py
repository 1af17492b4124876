"""The asyncio shm client's bound on requests in flight: the limiter alone, then against a daemon
whose per-connection limit is far below what the caller starts at once; and calls cut off midway,
which must leave neither a place nor a segment behind."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.client.inflight import Inflight
from edged.client.shm import AsyncShmClient
from edged.errors import EdgedError, ErrorCode
from edged.transports.shm.conn import Limits
from tests.http_helpers import held_engine
from tests.polling import wait_until_async
from tests.spying import results_of
from tests.transports.test_shm import _serve, held_model


def test_places_are_taken_at_once_while_free_then_handed_over_in_order() -> None:
    async def run() -> list[int]:
        lim = Inflight(2)
        assert lim.take_now() and lim.take_now() and not lim.take_now()
        order: list[int] = []

        async def waiter(k: int) -> None:
            await lim.take()
            order.append(k)

        tasks = [asyncio.ensure_future(waiter(k)) for k in range(3)]
        await asyncio.sleep(0)  # sleep-ok: let the three start waiting
        assert lim.used == 2 and not order
        assert not lim.take_now()  # others wait: no overtaking even once a place is given back
        lim.give()
        assert not lim.take_now()  # the place went to the first waiter, not to the pool
        await asyncio.sleep(0)  # sleep-ok: let it run
        assert order == [0] and lim.used == 2
        lim.give()
        lim.give()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and lim.used == 2
        lim.give()
        lim.give()
        assert lim.used == 0
        return order

    assert asyncio.run(run()) == [0, 1, 2]


def test_a_cancelled_waiter_holds_nothing_and_a_place_handed_to_it_goes_on() -> None:
    async def run() -> None:
        lim = Inflight(1)
        assert lim.take_now()
        first = asyncio.ensure_future(lim.take())
        second = asyncio.ensure_future(lim.take())
        await asyncio.sleep(0)  # sleep-ok: both wait
        first.cancel()  # cancelled while waiting: it had no place
        await asyncio.sleep(0)  # sleep-ok: one turn of the loop, for the cancellation to land
        assert first.cancelled() and lim.used == 1
        lim.give()  # to the second (the first is gone)
        await second
        assert lim.used == 1
        third = asyncio.ensure_future(lim.take())
        await asyncio.sleep(0)  # sleep-ok: it waits
        lim.give()  # handed to the third ...
        third.cancel()  # ... which is cancelled before it runs: the place must come back
        await asyncio.gather(third, return_exceptions=True)
        assert third.cancelled() and lim.used == 0
        assert lim.take_now()

    asyncio.run(run())


def test_more_calls_than_the_daemon_takes_at_once_all_succeed(
        model_repo: Callable[..., Path], tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """The daemon refuses a connection's request beyond its max_inflight with OVERLOADED; the client
    learns the limit from HELLO and holds the rest back, cancelled waiters included."""
    x, _ = digits_holdout
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_inflight=2)) as s:
        engine = s.service.ready_model("digits").engine
        assert engine is not None
        ref = engine.infer({"pixels": x[:40]})["probabilities"]

        async def run() -> None:
            async with AsyncShmClient(s.socket) as c:
                assert c.server["max_inflight"] == 2
                preps = [await c.prepare("digits", {"pixels": (1, 64)}) for _ in range(4)]

                async def prepared(k: int) -> list[np.ndarray]:
                    outs = []
                    for i in range(k, 40, 4):
                        preps[k].inputs["pixels"][:] = x[i:i + 1]
                        outs.append((await preps[k].run(copy=True))["probabilities"][0])
                    return outs

                for _ in range(3):
                    calls = [asyncio.ensure_future(c.infer("digits", {"pixels": x[i:i + 1]})) for i in range(40)]
                    loops = [asyncio.ensure_future(prepared(k)) for k in range(4)]
                    await asyncio.sleep(0)  # sleep-ok: all under way, most of them waiting for a place
                    for task in calls[5::4]:
                        task.cancel()
                    done = await asyncio.gather(*calls, return_exceptions=True)
                    for i, r in enumerate(done):
                        if i >= 5 and (i - 5) % 4 == 0:
                            continue  # cancelled
                        assert not isinstance(r, BaseException), f"call {i}: {r!r}"
                        np.testing.assert_allclose(r["probabilities"][0], ref[i], rtol=1e-5, atol=1e-6)
                    for k, outs in enumerate(await asyncio.gather(*loops)):
                        np.testing.assert_allclose(np.stack(outs), ref[k::4], rtol=1e-5, atol=1e-6)
                    inflight = c._inflight
                    assert inflight is not None and inflight.used == 0

        asyncio.run(run())


def test_a_prepared_request_closed_while_it_waits_for_a_place_runs_then_gives_its_buffers_back(
        model_repo: Callable[..., Path], tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = digits_holdout
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_inflight=1)) as s:
        engine = s.service.ready_model("digits").engine
        assert engine is not None
        ref = engine.infer({"pixels": x[:2]})["probabilities"]

        async def run() -> tuple[np.ndarray, np.ndarray, int, int]:
            async with AsyncShmClient(s.socket) as c:
                base = s.transport.clients()[0]["segments"]
                a = await c.prepare("digits", {"pixels": (1, 64)})
                b = await c.prepare("digits", {"pixels": (1, 64)})
                a.inputs["pixels"][:] = x[:1]
                b.inputs["pixels"][:] = x[1:2]
                first = asyncio.ensure_future(a.run(copy=True))
                second = asyncio.ensure_future(b.run(copy=True))
                await asyncio.sleep(0)  # sleep-ok: the first is sent, the second waits for the one place
                inflight = c._inflight
                assert inflight is not None and inflight.used == 1 and not second.done()
                await b.close()  # while it waits: its run goes on, its buffers go when it ends
                out_a, out_b = await asyncio.gather(first, second)
                await a.close()
                return out_a["probabilities"][0], out_b["probabilities"][0], base, \
                    s.transport.clients()[0]["segments"]

        out_a, out_b, base, after = asyncio.run(run())
        np.testing.assert_allclose(out_a, ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out_b, ref[1], rtol=1e-5, atol=1e-6)
        assert after == base, f"{after - base} segment(s) of the closed prepared requests still registered"


def test_requests_sent_while_the_socket_is_full_wait_for_room_and_are_all_answered(
        model_repo: Callable[..., Path], tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's connection thread is held in a run, so it reads nothing more; the client's socket buffer
    (made as small as the kernel allows) fills with the requests behind it. Each waits for room and is
    sent: every answer comes back, right; and closed meanwhile, every waiting call fails, none hangs."""
    x, _ = digits_holdout
    with _serve(model_repo("digits"), tmp_path) as s:
        engine = s.service.ready_model("digits").engine
        assert engine is not None
        ref = engine.infer({"pixels": x[:48]})["probabilities"]

        async def run() -> list[np.ndarray]:
            async with AsyncShmClient(s.socket) as c:
                assert c._sock is not None
                c._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
                sent = results_of(monkeypatch, c, "_send_now")
                with held_engine(s.service, "digits") as entered:
                    # Alone on an idle model, the first runs on the connection's thread, which then reads no more.
                    calls = [asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]}))]
                    assert await asyncio.to_thread(entered.wait, 30), "the first request never reached the engine"
                    calls += [asyncio.ensure_future(c.infer("digits", {"pixels": x[i:i + 1]})) for i in range(1, 48)]
                    deadline = time.monotonic() + 30
                    while False not in sent:  # the requests behind the held one fill the buffer
                        assert time.monotonic() < deadline, "the socket's buffer never filled"
                        await asyncio.sleep(0.01)
                # Dozens of senders wait for room at once; each must be woken (the loop keeps one writer
                # callback per socket: one each left all but the last waiting for ever).
                answers = await asyncio.wait_for(asyncio.gather(*calls), 30)
                # Closed while senders wait for room: each fails at once with the client's error.
                with held_model(s.service):  # until the scheduler forgets the queueing above, a lone request
                    pass  # is queued, and the connection's thread, not held, would go on reading
                sent.clear()
                with held_engine(s.service, "digits") as entered:
                    calls = [asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]}))]
                    assert await asyncio.to_thread(entered.wait, 30), "the first request never reached the engine"
                    calls += [asyncio.ensure_future(c.infer("digits", {"pixels": x[i:i + 1]})) for i in range(1, 48)]
                    deadline = time.monotonic() + 30
                    while sent.count(False) < 20:  # no room comes while the thread is held: one refusal a sender
                        assert time.monotonic() < deadline, f"{sent.count(False)} senders wait for room, not 20"
                        await asyncio.sleep(0.01)
                    await c.close()
                    failed = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
                assert all(isinstance(f, EdgedError) for f in failed), failed
                return [a["probabilities"][0] for a in answers]

        answers = asyncio.run(run())
        np.testing.assert_allclose(np.stack(answers), ref, rtol=1e-5, atol=1e-6)


def test_a_cancelled_request_keeps_its_place_until_the_daemon_has_answered_it(
        model_repo: Callable[..., Path], tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """The daemon counts a request against max_inflight until it has answered it, cancelled by its caller
    or not: the client gives the place back only then, so a later call waits for it instead of being
    refused (OVERLOADED); closed meanwhile, the waiting call fails with the client's error."""
    x, _ = digits_holdout
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_inflight=2)) as s:
        ref = s.reference(x[:1])

        def daemon_inflight() -> int:
            return int(s.transport.clients()[0]["inflight"])

        async def cut_off_two(c: AsyncShmClient) -> None:
            cut = [asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]})) for _ in range(2)]
            await wait_until_async(lambda: daemon_inflight() == 2, 30, 0.005, "both requests queued at the daemon")
            for task in cut:
                task.cancel()
            await asyncio.gather(*cut, return_exceptions=True)

        async def run() -> None:
            async with AsyncShmClient(s.socket) as c:
                inflight = c._inflight
                assert inflight is not None
                await c.infer("digits", {"pixels": x[:1]})  # metadata and a pooled slot: calls send at once
                with held_model(s.service):
                    await cut_off_two(c)
                    assert inflight.used == 2  # the daemon still counts both
                    later = asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]}))
                    await asyncio.sleep(0)  # sleep-ok: one turn of the loop, in which a free place sends it
                    assert not later.done() and inflight.used == 2 and daemon_inflight() == 2
                # let go: the late completions give the places back, and the later call is answered
                np.testing.assert_allclose((await later)["probabilities"], ref, rtol=1e-5, atol=1e-6)
                await wait_until_async(lambda: inflight.used == 0, 30, 0.005, "every place to be given back")
                with held_model(s.service):
                    await cut_off_two(c)
                    waiting = asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]}))
                    await asyncio.sleep(0)  # sleep-ok: one turn of the loop: it waits for a place
                    await c.close()
                    with pytest.raises(EdgedError, match="the client is closed") as ei:
                        await waiting
                    assert ei.value.code is ErrorCode.FAILED_PRECONDITION

        asyncio.run(run())


def test_a_prepared_run_waiting_for_a_place_when_the_client_closes_fails_with_the_clients_error(
        model_repo: Callable[..., Path], tmp_path: Path) -> None:
    """Closed while a run waits for the one place: the run in flight fails as the connection goes, the
    waiting one, handed the place, fails with the client's own error (it sends nothing)."""
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_inflight=1)) as s:
        async def run() -> list[object]:
            c = await AsyncShmClient(s.socket).connect()
            a = await c.prepare("digits", {"pixels": (1, 64)})
            b = await c.prepare("digits", {"pixels": (1, 64)})
            with held_model(s.service):
                first = asyncio.ensure_future(a.run())
                await wait_until_async(lambda: s.transport.clients()[0]["inflight"] == 1, 30, 0.005,
                                       "the first run queued at the daemon")
                second = asyncio.ensure_future(b.run())
                await asyncio.sleep(0)  # sleep-ok: one turn of the loop: it waits for the one place
                inflight = c._inflight
                assert inflight is not None and inflight.used == 1 and not second.done()
                await c.close()
                return [*await asyncio.gather(first, second, return_exceptions=True)]

        first, second = asyncio.run(run())
        assert isinstance(first, EdgedError) and first.code is ErrorCode.UNAVAILABLE, repr(first)
        assert isinstance(second, EdgedError) and second.code is ErrorCode.FAILED_PRECONDITION, repr(second)


def test_calls_cancelled_while_registering_their_memory_give_it_back(
        model_repo: Callable[..., Path], tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """A call cancelled while its REGISTER is answered: the daemon maps the segment all the same, and the
    client gives it back when the answer comes, so cancelled calls never use up the client's segments."""
    x, _ = digits_holdout
    with _serve(model_repo("digits"), tmp_path, limits=Limits(max_segments=8)) as s:
        def daemon_segments() -> int:
            return int(s.transport.clients()[0]["segments"])

        async def run() -> None:
            async with AsyncShmClient(s.socket) as c:
                await c._info("digits", None)  # metadata cached: a call's first round trip is its slot's REGISTER
                for i in range(30):
                    call = asyncio.ensure_future(c.infer("digits", {"pixels": x[:1]}) if i % 2 else c.tensor((1, 64)))
                    await asyncio.sleep(0)  # sleep-ok: one turn of the loop sends its REGISTER, then it is cut off
                    assert c._pending, "the REGISTER was not sent"
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError, EdgedError):  # EdgedError: over the limit
                        await call
                assert not c._core.segments
                # every REGISTER answered (so the daemon has served them all), then none of their segments left
                await wait_until_async(lambda: not c._pending and not c._chores and daemon_segments() == 0, 30, 0.005,
                                       "the daemon to have none left")
                out = await c.infer("digits", {"pixels": x[:1]})
                np.testing.assert_allclose(out["probabilities"], s.reference(x[:1]), rtol=1e-5, atol=1e-6)
                assert daemon_segments() == len(c._core.segments) == 1

        asyncio.run(run())


def test_async_prepared_requests_closed_after_a_cut_off_run_leave_nothing_registered(
        model_repo: Callable[..., Path], tmp_path: Path) -> None:
    """A loop that gives up on a run (a timeout) and closes its prepared request while the run is still
    queued at the daemon: its input segment and output area are given back all the same, every time."""
    with _serve(model_repo("digits"), tmp_path) as s:
        def daemon() -> dict[str, Any]:
            return s.transport.clients()[0]

        async def run() -> None:
            async with AsyncShmClient(s.socket) as c:
                await c.metadata("digits")
                for _ in range(3):
                    prep = await c.prepare("digits", {"pixels": (1, 64)})
                    with held_model(s.service):
                        cut = asyncio.ensure_future(prep.run())
                        await wait_until_async(lambda: daemon()["inflight"] == 1, 30, 0.005, "the run queued")
                        cut.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await cut
                        await prep.close()
                    await wait_until_async(lambda: not daemon()["segments"] and not daemon()["mapped_bytes"], 30,
                                           0.005, "every segment of the closed request to be given back")
                    assert not c._core.segments and not c._late

        asyncio.run(run())
