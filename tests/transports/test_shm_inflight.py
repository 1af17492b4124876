"""The asyncio shm client's bound on requests in flight: the limiter alone, then against a daemon
whose per-connection limit is far below what the caller starts at once."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edged.client.inflight import Inflight
from edged.client.shm import AsyncShmClient
from edged.errors import EdgedError
from edged.transports.shm.conn import Limits
from tests.http_helpers import held_engine
from tests.spying import results_of
from tests.transports.test_shm import _serve


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
