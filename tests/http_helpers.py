"""A real HTTP transport on a real inference service, served from an event loop in a background thread."""

from __future__ import annotations

import asyncio
import os
import shutil
import textwrap
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from edged.config import parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.transports.http.transport import HttpTransport

T = TypeVar("T")
MODELS = Path(__file__).resolve().parent.parent / "models"
TOKEN = "test-management-token-0123456789"  # [control] token of every Served unless told otherwise
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORT = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


def copy_models(repo: Path, *names: str) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copytree(MODELS / n, repo / n)
    return repo


class Served:
    """ModelManager + InferenceService + HttpTransport; ``url`` is where it listens.

    ``extra`` TOML lines continue the ``[http]`` section (or open sections of their own); ``token``
    is the management credential (None: none configured, the default of a real daemon).
    """

    def __init__(self, repo: Path, tmp: Path, *, listen: str = "127.0.0.1:0", extra: str = "",
                 load: bool = True, token: str | None = TOKEN, grpc: str | None = None) -> None:
        control = f'[control]\ntoken = "{token}"\n' if token else ""
        if grpc is not None:  # the [grpc] section's lines: a gRPC transport on the same service
            listen_line = "" if "listen" in grpc else 'listen = "127.0.0.1:0"\n'
            control += "[grpc]\n" + listen_line + textwrap.dedent(grpc)
        text = control + textwrap.dedent(f"""
            [device]
            id = "http-test"
            state_dir = "{tmp / 'state'}"
            runtime_dir = "{tmp / 'run'}"
            model_repository = "{repo}"
            [http]
            listen = "{listen}"
            """) + textwrap.dedent(extra)
        self.cfg = parse_config(text)
        self.repo = repo
        self.manager = ModelManager(repo, self.cfg.models, ORT)
        if load:
            self.manager.load_all()
        self.service = InferenceService(self.manager)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-test-loop", daemon=True)
        self.thread.start()
        self.transport = HttpTransport(self.cfg, self.service)
        self.grpc: Any = None
        try:
            self.run(self.transport.start())
            if grpc is not None:
                from edged.transports.grpc.server import GrpcTransport

                self.grpc = GrpcTransport(self.cfg, self.service, shm=self.transport.shm)  # as the daemon does
                self.run(self.grpc.start())
        except BaseException:
            self._stop_loop()
            raise
        self.url = self.transport.address
        self.grpc_url = self.grpc.address if self.grpc else None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def close(self) -> None:
        try:
            if self.grpc is not None:
                self.run(self.grpc.stop())
            self.run(self.transport.stop())
        finally:
            self._stop_loop()
            self.manager.shutdown()


@contextmanager
def served(repo: Path, tmp: Path, **kw: Any) -> Iterator[Served]:
    s = Served(repo, tmp, **kw)
    try:
        yield s
    finally:
        s.close()


class Segment:
    """A POSIX shared memory segment made the way a client makes one (and removed afterwards)."""

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.path = Path("/dev/shm") / key.lstrip("/")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)

    def write(self, data: bytes, offset: int = 0) -> None:
        os.pwrite(self.fd, data, offset)

    def read(self, size: int, offset: int = 0) -> bytes:
        return os.pread(self.fd, size, offset)

    def truncate(self, size: int = 0) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def in_process(srv: Served, model: str, x: Any) -> Any:
    """The model's answer computed in the process, without any transport (what every client must match)."""
    resp = srv.service.infer(InferRequest(model, {"pixels" if model == "digits" else "image": x}), timeout=30)
    return resp.outputs["probabilities"]


@contextmanager
def held_engine(service: InferenceService, model: str) -> Iterator[threading.Event]:
    """Stall a model's engine until the test lets go, yielding the event set once a call is inside.

    Queue-full and deadline tests then fill the queue on purpose instead of racing a long batch
    against the machine's speed (a fast CI machine drained the race's queue before the probe came).
    """
    mv = service.ready_model(model)
    sched = mv.scheduler
    assert sched is not None
    engine = sched.engine
    entered, release = threading.Event(), threading.Event()

    class _Held:
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def infer(self, inputs: Any, outputs: Any = None) -> Any:
            entered.set()
            release.wait(60)
            return engine.infer(inputs, outputs)

    sched.engine = _Held()  # type: ignore[assignment]
    try:
        yield entered
    finally:
        release.set()
        sched.engine = engine
