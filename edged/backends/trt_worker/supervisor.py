"""The daemon's side of the TensorRT engine worker (JetPack 5: TensorRT's bindings exist for Python 3.8
only): the worker script and its plan, on the generic worker client (:mod:`edged.backends.worker_client`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from edged.backends.base import Engine
from edged.backends.worker_client import (
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    EngineWorkerClient,
    WorkerDiedError,
)
from edged.protocol import shm as p

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "WorkerDiedError", "WorkerEngine"]

log = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
WIRE_DIR = Path(p.__file__).resolve().parent.parent / "protocol"


class WorkerEngine(EngineWorkerClient):
    """A TensorRT plan served by an engine worker under another Python (JetPack 5's system 3.8)."""

    backend = "tensorrt"
    what = "TensorRT engine worker"
    loads = "plan"

    def __init__(self, python: str, plan: Path, label: str, *, device: str = "GPU", precision: str = "fp32",
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.python, self.plan = python, plan
        super().__init__(label, device=device, precision=precision, start_timeout_s=start_timeout_s,
                         request_timeout_s=request_timeout_s)

    def _command(self, fd: int) -> list[str]:
        # -s -E: only the system site-packages (numpy, TensorRT); nothing from the daemon's environment.
        return [self.python, "-s", "-E", str(WORKER_SCRIPT), "--fd", str(fd), "--plan", str(self.plan),
                "--wire", str(WIRE_DIR)]

    def _started(self) -> None:
        log.info("%s: TensorRT engine worker pid %d ready (Python %s, TensorRT %s)", self.label, self.pid,
                 self.info.get("python"), self.info.get("tensorrt"))

    def describe(self) -> dict[str, Any]:
        return {**Engine.describe(self), "engine_worker": {"python": self.python, "pid": self.pid,
                                                           "restarts": self.restarts}}

    def health(self) -> dict[str, Any]:
        return {**super().health(), "python": self.info.get("python"), "tensorrt": self.info.get("tensorrt")}
