"""A request that a retiring copy gives up unstarted, and that the daemon takes on to the serving copy,
is counted once: where it is answered.

When a copy of a model is replaced (a reload in place, or a new version) and its drain times out (a
run stuck in its engine), the requests still queued behind that run are failed. A blocking caller
(``InferenceService.infer_blocking``: the MQTT streams) hears that as ModelNotReadyError and goes on
to the copy that serves now, which answers it. The retiring copy used to count it as failed
(``unavailable``) as well, so the version's statistics showed a failure no client saw, beside the
success of the same request on the new copy (a reload in place continues the same series).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

import edged.core.manager as manager_module
from edged.protocol.types import InferRequest, InferResponse
from edged.telemetry.model_metrics import ModelMetrics
from tests.conftest import MODELS
from tests.http_helpers import held_engine
from tests.in_process import served
from tests.polling import wait_until


def _in_thread(call: Callable[[], InferResponse]) -> Future[InferResponse]:
    """``call()`` on a thread of its own (a blocking caller), its answer or error in the future."""
    out: Future[InferResponse] = Future()

    def run() -> None:
        try:
            out.set_result(call())
        except BaseException as exc:  # handed to the test through the future
            out.set_exception(exc)
    threading.Thread(target=run, daemon=True).start()
    return out


@pytest.mark.parametrize("new_version", [1, 2], ids=["reload-in-place", "new-version"])
def test_request_withdrawn_by_a_timed_out_drain_is_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_version: int) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    monkeypatch.setattr(manager_module, "DRAIN_TIMEOUT_S", 0.2)  # the 30 s drain, shortened
    x = np.ones((1, 64), np.float32)
    with served(repo) as service:
        if new_version != 1:  # published while version 1 serves
            shutil.copytree(repo / "digits" / "1", repo / "digits" / str(new_version))
        old = service.ready_model("digits", 1)
        assert old.scheduler is not None and old.stats is not None
        metrics = ModelMetrics(service)
        metrics.snapshot()  # the daemon's /metrics reader has seen the old copy before it is replaced
        with held_engine(service, "digits") as entered:
            stuck = service.submit(InferRequest(model="digits", inputs={"pixels": x}, version=1))
            assert entered.wait(60)
            retried = _in_thread(lambda: service.infer_blocking(InferRequest(model="digits", inputs={"pixels": x})))
            wait_until(lambda: old.scheduler is not None and old.scheduler.queued == 1, 30, 0.005,
                       "the blocking request queued behind the held run")
            service.load("digits", [new_version])  # the old copy's drain times out behind the held run
            answer = retried.result(60)  # given up by the old copy, answered by the new one
        assert stuck.result(60).version == 1
        new = service.ready_model("digits", new_version)
        assert new is not old and new.stats is not None
        assert answer.version == new_version
        wait_until(lambda: old.stats is not None and old.stats.in_flight == 0, 30, 0.005,
                   "the old copy's requests all ended")
        if new_version == 1:  # one series for the version: both copies' counts together
            (snap,) = [s for s in metrics.snapshot() if s.model == "digits"]
            assert (snap.counters.success, snap.counters.failures_by_code) == (2, {}), snap.counters
        old_counts, new_counts = old.stats.snapshot(), new.stats.snapshot()
        # The old copy answered the held request only; the new copy answered the retried one.
        assert old_counts.failures_by_code == {}, old_counts.failures_by_code
        assert old_counts.success.count == 1
        assert new_counts.failures_by_code == {} and new_counts.success.count == 1
