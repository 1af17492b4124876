"""Which of the daemon's threads wake for a lone request, per transport (issue 41).

    .venv/bin/python -m bench.wakeups [--requests N] [--model mobilenet|digits]

A thread wake-up costs from a few microseconds on bare metal to ~150 us on some 2-core VMs, so the
one host-independent way to hold the serving path at its floor is to count them, not to time them:
this runs a whole daemon (shm, HTTP, gRPC and MQTT through a private mosquitto, the bundled CNN) in
this process, sends N requests one at a time on each transport from a client thread, and reads every
daemon thread's context switches from /proc before and after. The thread that reads a request (the
shm connection's thread, the event loop for HTTP and gRPC, paho's network thread for MQTT) must wake
once per request; any other Python thread that wakes per request (beyond its wake-ups in as long a
quiet spell: timers) is a hand-off on the path. ONNX Runtime's own pool threads are native and not
counted (the bare responders of the suite have them too).
tests/transports/test_wakeups.py asserts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mobilenet"
# Each bundled model measured here: its input's name and a request's shape.
INPUTS = {"mobilenet": ("image", (1, 3, 48, 192)), "digits": ("pixels", (1, 64))}
DEVICE = "wakeups"


def switches() -> dict[int, tuple[str, int]]:
    """Each live Python thread of this process: native id -> (name, voluntary context switches)."""
    out: dict[int, tuple[str, int]] = {}
    for t in threading.enumerate():
        tid = t.native_id
        if tid is None:
            continue
        try:
            text = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        out[tid] = (t.name, int(fields["voluntary_ctxt_switches"]))
    return out


@dataclass(frozen=True)
class Woken:
    """A thread's voluntary switches (sleeps, each ended by a wake-up) per request over a run, beyond
    those it makes in the same time with no request at all (a timer's)."""

    name: str
    per_request: float


IDLE_CAP_S = 10.0  # the longest quiet spell measured after a run; a longer run's timers are scaled from it


def count(send: Callable[[], object], n: int, skip: set[int]) -> list[Woken]:
    """Run ``send`` n times and return the Python threads (other than those in ``skip``) that slept.

    A timer thread (telemetry, the memory trimmer) wakes per second, not per request, and while the
    serving threads hold the GIL it sleeps again for the GIL after each of its system calls: on a host
    slow enough that n requests take seconds that would read as a hand-off. So a quiet spell as long as
    the run follows it, with a thread of ours holding the GIL as the serving threads did, and each
    thread's wake-ups in it, scaled to the run's length, are taken off. A thread the requests were
    handed to has nothing to do in it."""
    for _ in range(20):
        send()
    before = switches()
    t0 = time.monotonic()
    for _ in range(n):
        send()
    run_s = time.monotonic() - t0
    after = switches()
    quiet_s = min(run_s, IDLE_CAP_S)
    done = threading.Event()

    def busy() -> None:
        while not done.is_set():  # Python bytecode: holds the GIL between the interpreter's switches
            pass
    spinner = threading.Thread(target=busy, name="wakeups-gil", daemon=True)
    spinner.start()
    done.wait(quiet_s)  # nothing sent: what wakes now is on a clock
    idle = switches()
    done.set()
    spinner.join()
    woken = []
    for tid, (name, vol) in after.items():
        if tid not in before or tid in skip or vol <= before[tid][1]:
            continue
        timer = (idle[tid][1] - vol) * run_s / quiet_s if tid in idle and quiet_s > 0 else 0.0
        woken.append(Woken(name, max(0.0, vol - before[tid][1] - timer) / n))
    return sorted(woken, key=lambda w: -w.per_request)


def _config(tmp: Path, http_port: int, grpc_port: int, broker_url: str, processes: int = 0) -> Path:
    path = tmp / "edged.toml"
    path.write_text(f"""
[device]
id = "{DEVICE}"
profile = "generic"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{tmp / 'models'}"
[http]
listen = "127.0.0.1:{http_port}"
[grpc]
listen = "127.0.0.1:{grpc_port}"
[mqtt]
url = "{broker_url}"
[telemetry]
enabled = false
[limits]
engine_processes = {processes}
[logging]
level = "warning"
""")
    return path


class InProcessDaemon:
    """``edged run`` on this process's main thread (its signal handlers need it); work on other threads."""

    def __init__(self, cfg_path: Path, *, quick_choice: bool = False) -> None:
        """``quick_choice``: the background engine choice measures briefly (a test's daemon)."""
        from edged.config import load_config
        from edged.daemon import Daemon

        self.daemon = Daemon(load_config(cfg_path))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self.quick_choice = quick_choice

    def settled(self, timeout: float) -> None:
        """Wait until every version's engine is chosen (the chooser measures candidates after READY)."""
        from tests.polling import wait_until

        rt = self.daemon.runtime
        assert rt is not None
        wait_until(lambda: all(mv.choice is None or mv.choice.status()["state"] in ("chosen", "single")
                               for mv in rt.manager.table.all()), timeout, what="the engine choice to settle")

    def quiet_chooser(self) -> None:
        """Stop the engine chooser's poll once the choice is made: a background job, not on the path,
        that wakes twice a second and, while traffic flows, again for the GIL each time it looks at the
        traffic; on a host slow enough for a run of lone requests to take seconds, that reads as a
        hand-off of some of them."""
        rt = self.daemon.runtime
        assert rt is not None
        rt.manager.chooser.stop()

    def serve(self, work: Callable[[], None]) -> None:
        """Serve until ``work`` (run on a thread once the daemon is READY) returns or raises."""
        failure: list[BaseException] = []

        def worker() -> None:
            try:
                assert self.ready.wait(120), "the in-process daemon did not become ready"
                work()
            except BaseException as e:
                failure.append(e)
            finally:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self.daemon.request_stop)

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            told = self.daemon.notifier.ready

            def ready(status: str | None = None) -> bool:
                rt = self.daemon.runtime
                if self.quick_choice and rt is not None:  # before the chooser starts, right after READY
                    from edged.core.chooser import BACKGROUND
                    from tests.edged_process import QUICK_CHOICE

                    rt.manager.chooser.settings = dataclasses.replace(BACKGROUND, **QUICK_CHOICE)
                self.ready.set()
                return told(status)
            self.daemon.notifier.ready = ready  # type: ignore[method-assign]  # told READY, then as before
            await self.daemon.serve()

        thread = threading.Thread(target=worker, name="wakeups-client")
        thread.start()
        try:
            asyncio.run(main())
        finally:
            thread.join(60)
        if failure:
            raise failure[0]


@contextlib.contextmanager
def daemon_with_everything(tmp: Path, *, quick_choice: bool = False, processes: int = 0, model: str = MODEL
                           ) -> Iterator[tuple[InProcessDaemon, int, int, int, Path]]:
    """A daemon (not yet serving) with a bundled model (the CNN) on every transport, and a private broker."""
    sys.path.insert(0, str(ROOT))
    from tests.mqtt_helpers import Broker
    from tests.netutil import free_port

    shutil.copytree(ROOT / "models" / model, tmp / "models" / model)
    broker = Broker(tmp / "broker").start()
    try:
        http_port, grpc_port = free_port(), free_port()
        d = InProcessDaemon(_config(tmp, http_port, grpc_port, broker.url, processes), quick_choice=quick_choice)
        yield d, http_port, grpc_port, broker.port, tmp / "run" / "edged.sock"
    finally:
        broker.stop()


def measure(tmp: Path, n: int, *, quick_choice: bool = False, processes: int = 0, model: str = MODEL,
            again: Callable[[str, list[Woken]], bool] | None = None, attempts: int = 3
            ) -> dict[str, list[Woken]]:
    """Per transport, the daemon's Python threads that slept during n lone requests of ``model``.

    A model whose runs are longer than an event loop may block for (v2_ops.LOOP_INLINE_MAX_NS: the
    CNN's on a loaded 2-core host) is handed to its worker thread by design: the digits MLP, a 30 us
    run, stays far inside it however busy the host.

    ``again(transport, woken)``: True when a count looks like a hand-off; the transport is counted
    again, up to ``attempts`` times in all, and its fewest wake-ups are kept. A hand-off on the path
    wakes its thread in every count; a host's noise (another tenant's burst stretching a timer's wait
    for the GIL) does not repeat on cue."""
    from bench.bench_mqtt import Driver, binary_request
    from edged.client.grpc import GrpcClient
    from edged.client.http import HttpClient
    from edged.client.shm import ShmClient

    name, shape = INPUTS[model]
    x1 = np.random.default_rng(0).random(shape, dtype=np.float32)
    results: dict[str, list[Woken]] = {}
    with daemon_with_everything(tmp, quick_choice=quick_choice, processes=processes, model=model) as (
            d, http_port, grpc_port, mqtt_port, sock):
        def work() -> None:
            d.settled(60.0)  # the engine choice measures in the background after READY: not on our counts
            d.quiet_chooser()
            shm = ShmClient(sock)
            http = HttpClient(f"127.0.0.1:{http_port}")
            grpc = GrpcClient(f"127.0.0.1:{grpc_port}")
            driver = Driver(mqtt_port, qos=0)
            payload, users = binary_request(name, x1)
            topic = f"edged/{DEVICE}/infer/{model}"
            # The clients' threads: this one and paho's for the MQTT driver; every other is the daemon's.
            skip = {tid for tid, (name, _) in switches().items() if "bench-driver" in name}
            skip.add(threading.get_native_id())

            def judged(transport: str, send: Callable[[], object], skip: set[int]) -> None:
                kept: list[Woken] | None = None
                for _ in range(max(1, attempts)):
                    woken = count(send, n, skip)
                    if kept is None or _most(woken) < _most(kept):
                        kept = woken
                    if again is None or not again(transport, woken):
                        break
                assert kept is not None
                results[transport] = kept
            try:
                judged("shm", lambda: shm.infer(model, {name: x1}), skip)
                judged("http", lambda: http.infer(model, {name: x1}), skip)
                judged("grpc", lambda: grpc.infer(model, {name: x1}), skip)
                # A stream's client feeds its requests from a thread of its own: the threads that appear
                # with the stream are the client's.
                known = set(switches())
                stream = grpc.stream()
                stream.infer(model, {name: x1})
                stream_skip = skip | (set(switches()) - known)
                try:
                    judged("grpc stream", lambda: stream.infer(model, {name: x1}), stream_skip)
                finally:
                    stream.close()
                judged("mqtt", lambda: driver.run(topic, payload, users, concurrency=1, n=1), skip)
            finally:
                shm.close()
                http.close()
                grpc.close()
                driver.c.disconnect()
                driver.c.loop_stop()
        d.serve(work)
    return results


def _most(woken: list[Woken]) -> float:
    """The wake-ups per request of all threads together: the count with fewer is the cleaner one."""
    return sum(w.per_request for w in woken)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--model", choices=sorted(INPUTS), default=MODEL)
    ap.add_argument("--engine-processes", type=int, default=0, help="[limits] engine_processes of the daemon")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edged-wakeups-") as t:
        results = measure(Path(t), args.requests, processes=args.engine_processes, model=args.model)
    for transport, woken in results.items():
        print(f"{transport}: " + (", ".join(f"{w.name} {w.per_request:.2f}" for w in woken) or "no thread slept"))


if __name__ == "__main__":
    main()
