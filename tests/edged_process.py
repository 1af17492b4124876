"""A real ``edged run --config`` in its own process for tests and benchmarks: started, waited on, stopped.

The fixtures that serve a whole daemon all did the same: start it from the repository root with its
output in a log, poll a readiness check until it holds (failing with the log's tail if the process
exits or the deadline passes), and on the way out SIGTERM it, then SIGKILL.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from tests.conftest import EDGED, REPO_ROOT
from tests.mqtt_helpers import terminate

# The background engine choice (edged.core.chooser) as it measures, only for less long: BACKGROUND's settings
# but 0.3 s a candidate and 1.5 s in all (not 1.5 s and 8 s). For tests that check when the chooser measures
# and what it switches to between engines far apart, or that wait for it to be done, not how long a
# measurement takes: QUICK_CHOICE_EDGED is ``edged`` with it; bench/wakeups.py sets it in-process.
QUICK_CHOICE: dict[str, Any] = {"time_per_candidate_s": 0.3, "total_s": 1.5}
QUICK_CHOICE_EDGED = [sys.executable, "-c", textwrap.dedent(f"""
    import dataclasses, sys
    from edged.core import chooser
    chooser.EngineChooser.__init__.__kwdefaults__["settings"] = dataclasses.replace(
        chooser.BACKGROUND, **{QUICK_CHOICE!r})
    from edged.cli import main
    sys.exit(main())
    """)]


class DaemonExitedError(AssertionError):
    """``edged run`` exited before it was ready; ``log`` is its whole log."""

    def __init__(self, returncode: int | None, log: str) -> None:
        super().__init__(f"edged run exited with {returncode}:\n{log[-3000:]}")
        self.log = log


def start_edged(config: Path, log_path: Path, prefix: Sequence[str] = (),
                edged: Sequence[str] = EDGED) -> subprocess.Popen[bytes]:
    """``edged run --config config`` from the repository root, stdout and stderr into ``log_path``;
    ``prefix``: argv it runs under (e.g. prlimit); ``edged``: the command that is ``edged``."""
    with log_path.open("wb") as log:
        return subprocess.Popen([*prefix, *edged, "run", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, ready: Callable[[], bool], *, timeout: float,
               interval: float = 0.1, transient: tuple[type[BaseException], ...] = (Exception,)) -> None:
    """Poll ``ready()`` until it is true; an exception in ``transient`` counts as not yet (not listening).

    Raises DaemonExitedError if the process exits first, AssertionError with the log's tail after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DaemonExitedError(proc.returncode, log_path.read_text(errors="replace"))
        try:
            if ready():
                return
        except transient:
            pass
        assert time.monotonic() < deadline, (f"edged run did not become ready in {timeout} s:\n"
                                             + log_path.read_text(errors="replace")[-3000:])
        time.sleep(interval)


def http_ok(port: int, path: str) -> bool:
    """``GET path`` on 127.0.0.1:``port`` answers 200 (a readiness check; OSError: not listening yet)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        c.request("GET", path)
        return c.getresponse().status == 200
    finally:
        c.close()


def engines_settled(port: int, model: str) -> bool:
    """``model`` is ready and its background engine choice (edged.core.chooser) is done, so nothing loads or
    measures candidate engines any more: what a test measures of the daemon (RSS, latency) is its own."""
    if not http_ok(port, f"/v2/models/{model}/ready"):
        return False
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        c.request("GET", f"/v2/models/{model}")
        r = c.getresponse()
        body = r.read()
    finally:
        c.close()
    if r.status != 200:
        return False
    choice = orjson.loads(body).get("parameters", {}).get("choice")
    return choice is None or choice.get("state") in ("chosen", "single")


@contextmanager
def edged_run(config: Path, log_path: Path, ready: Callable[[], bool], *, timeout: float, interval: float = 0.1,  # noqa: PLR0913  wait_ready's and start_edged's, passed on
              transient: tuple[type[BaseException], ...] = (Exception,),
              prefix: Sequence[str] = (), edged: Sequence[str] = EDGED) -> Iterator[subprocess.Popen[bytes]]:
    """The daemon started and ready (see ``wait_ready``) for the body; SIGTERM, then SIGKILL, afterwards."""
    proc = start_edged(config, log_path, prefix, edged)
    try:
        wait_ready(proc, log_path, ready, timeout=timeout, interval=interval, transient=transient)
        yield proc
    finally:
        terminate(proc, 30)
