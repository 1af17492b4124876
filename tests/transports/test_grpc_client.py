"""edged's gRPC client (edged/client/grpc.py) against a bare grpcio server on loopback that answers some
requests and never answers others: a stream's answer is awaited at most ``timeout`` seconds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from edged.client.grpc import GrpcClient
from edged.errors import EdgedError, ErrorCode
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(60)
X = {"x": np.zeros((1, 2), np.float32)}


class Silent:
    """A grpc.aio server in a thread of its own: ServerLive answers; a ModelStreamInfer request for model
    "echo" is answered, any other is never answered (its handler awaits forever, and counts its cancellation).
    It counts the streams opened and the requests received on them, to tell a refusal from a request sent."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="silent-grpc", daemon=True)
        self.thread.start()
        self.cancelled = 0
        self.streams = 0
        self.received = 0
        self.server: Any = None
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        async def live(req: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)

        async def stream(requests: AsyncIterator[pb.ModelInferRequest],
                         context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
            self.streams += 1
            async for req in requests:
                self.received += 1
                if req.model_name == "echo":
                    yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(model_name="echo"))
                    continue
                try:
                    await asyncio.Event().wait()  # sleep-ok: the server that never answers, until cancelled
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise

        handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
            "ServerLive": grpc.unary_unary_rpc_method_handler(
                live, pb.ServerLiveRequest.FromString, pb.ServerLiveResponse.SerializeToString),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                stream, pb.ModelInferRequest.FromString, pb.ModelStreamInferResponse.SerializeToString),
        })
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    s = Silent()
    yield s
    s.close()


def _timed_out(stream: Any, timeout: float) -> EdgedError:
    t0 = time.monotonic()
    with pytest.raises(EdgedError) as e:
        stream.infer("never", X)
    took = time.monotonic() - t0
    assert e.value.code is ErrorCode.DEADLINE_EXCEEDED, e.value
    # Never before the timeout; the upper bound is slack for a stalled host: without the timeout the
    # silent server holds the request for ever.
    assert timeout <= took < timeout + 10, f"the answer was given up after {took:.2f} s, timeout {timeout} s"
    return e.value


def test_a_stream_answer_that_never_comes_is_deadline_exceeded_and_the_call_is_cancelled(silent: Silent) -> None:
    """The client's timeout bounds each answer a stream awaits, as it bounds each unary call: a typed
    DEADLINE_EXCEEDED once the timeout has passed, the stream's call cancelled on the server, its threads
    ended, later requests on it refused at once (by the client, nothing sent), and the channel still
    serving other calls."""
    threads = threading.active_count()
    with GrpcClient(silent.address, timeout=0.5) as c:
        stream = c.stream()  # the client's timeout
        assert "0.5 s" in str(_timed_out(stream, 0.5))
        wait_until(lambda: silent.cancelled == 1, 10, what="the server's handler cancelled")
        sent = (silent.streams, silent.received)
        t0 = time.monotonic()
        with pytest.raises(EdgedError) as again:
            stream.infer("echo", X)
        # Refused by the stream itself, which knows it is over: no answer awaited, no stream reopened.
        assert again.value.code is ErrorCode.UNAVAILABLE and "open a new one" in str(again.value), again.value
        assert "did not answer within 0.5 s" in str(again.value), again.value
        assert time.monotonic() - t0 < 10, "the refusal waited, as for an answer"
        stream.close()

        other = c.stream(timeout=0.3)  # its own timeout, on the same channel
        _timed_out(other, 0.3)
        other.close()
        assert c.call("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse).live
        wait_until(lambda: silent.cancelled == 2, 10, what="the second stream's handler cancelled")
        # Only the second stream and its request reached the server since, sent after the refused one.
        assert (silent.streams, silent.received) == (sent[0] + 1, sent[1] + 1), "the refused request was sent"
    wait_until(lambda: threading.active_count() <= threads, 10, what="the streams' threads ended")


def test_the_timeout_bounds_each_answer_not_the_stream(silent: Silent) -> None:
    """A stream that sits idle longer than its timeout between requests is not cut off: only an answer
    being awaited is timed."""
    with GrpcClient(silent.address, timeout=30) as c:
        stream = c.stream(timeout=0.2)
        for _ in range(3):
            assert stream.infer("echo", X) == {}
            time.sleep(0.3)  # sleep-ok: idle past the timeout between requests is what is tested
        stream.close()
        assert silent.cancelled == 0
