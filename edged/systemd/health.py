"""End-to-end health: the self-test before READY=1 and the probe behind every WATCHDOG=1.

Both send a real inference on each ready model version's warm-up input through the
inference service (validation, queue, batcher, engine, outputs), so they fail exactly
when a client's request would. The probe keeps an unanswered probe pending instead of
queueing another: a hung engine shows up as a probe that never completes, and the
watchdog pings stop until it does (systemd restarts the service after WatchdogSec).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.core.public import ModelState, ModelVersion, sample_inputs
from edged.core.service import InferenceService
from edged.errors import EdgedError, ModelNotFoundError, ModelNotReadyError, OverloadedError
from edged.logs import log_fields
from edged.protocol.types import InferRequest, InferResponse

log = logging.getLogger(__name__)

SELF_TEST_ID = "edged-self-test"
PROBE_ID = "edged-watchdog-probe"
Key = tuple[str, int]


def check_response(mv: ModelVersion, resp: InferResponse) -> str | None:
    """Why a self-test/probe answer is wrong (missing output, NaN/inf), or None when it is fine."""
    for spec in mv.outputs:
        arr = resp.outputs.get(spec.name)
        if arr is None:
            return f"output {spec.name!r} missing from the answer"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"output {spec.name!r} has NaN or infinite values"
    return None


def self_test(service: InferenceService, versions: list[ModelVersion], timeout: float,
              stop: concurrent.futures.Future[None] | None = None) -> dict[Key, str]:
    """One inference per version through the service; returns the failures (key -> reason).

    Blocking: run it on a worker thread. A failed version is taken out of service here
    (state UNAVAILABLE with the reason, queue drained, engine released) so the daemon
    still starts and serves everything else. ``stop`` done (SIGTERM) ends the self-test at
    once: the version under test is neither passed nor failed, and the rest are not tested.
    """
    failures: dict[Key, str] = {}
    for mv in versions:
        if stop is not None and stop.done():
            log.info("self-test stopped: edged is stopping")
            break
        if mv.state is not ModelState.READY or mv.pipeline is not None:
            continue  # a pipeline has no sample input; its models are tested themselves
        if mv.warmup_skipped:  # the same made-up input would be refused again; that is not a fault
            log.warning("model=%s version=%s self-test skipped: %s", mv.name, mv.version, mv.warmup_note,
                        extra=log_fields(mv.name, mv.version, SELF_TEST_ID))
            continue
        t0 = time.monotonic()
        why = _one_test(service, mv, timeout, stop)
        if why is _STOPPED:
            log.info("model=%s version=%s self-test stopped: edged is stopping", mv.name, mv.version,
                     extra=log_fields(mv.name, mv.version, SELF_TEST_ID))
            break
        if why is None:
            log.info("model=%s version=%s self-test passed in %.1f ms", mv.name, mv.version,
                     (time.monotonic() - t0) * 1e3, extra=log_fields(mv.name, mv.version, SELF_TEST_ID))
            continue
        failures[(mv.name, mv.version)] = why
        log.error("model=%s version=%s self-test failed, not serving it: %s", mv.name, mv.version, why,
                  extra=log_fields(mv.name, mv.version, SELF_TEST_ID))
        take_out_of_service(mv, f"self-test failed: {why}")
    return failures


_STOPPED = "(stopped)"  # _one_test's answer when edged began stopping first


def _one_test(service: InferenceService, mv: ModelVersion, timeout: float,
              stop: concurrent.futures.Future[None] | None) -> str | None:
    """Why ``mv`` failed its one inference (None: it passed; :data:`_STOPPED`: ``stop`` came first)."""
    try:
        fut = service.submit(InferRequest(model=mv.name, version=mv.version, inputs=sample_inputs(mv),
                                          id=SELF_TEST_ID, source="self-test"))
        either: list[concurrent.futures.Future[Any]] = [fut] if stop is None else [fut, stop]
        concurrent.futures.wait(either, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        if stop is not None and stop.done() and not fut.done():
            return _STOPPED
        return check_response(mv, fut.result(0))
    except concurrent.futures.TimeoutError:
        return f"no answer within {timeout:.0f}s"
    except EdgedError as e:
        return str(e)
    except (OSError, KeyError, ValueError) as e:
        return f"warm-up input unusable: {e}"


def take_out_of_service(mv: ModelVersion, reason: str) -> None:
    mv.state, mv.reason = ModelState.UNAVAILABLE, reason
    if mv.scheduler is not None and not mv.scheduler.drain(5.0):
        return  # a worker is stuck inside the engine: leave the engine alone rather than free it under it
    if mv.engine is not None:
        mv.engine.unload()
        mv.engine = None


@dataclass
class ProbeResult:
    ok: bool
    checked: int = 0
    problems: dict[Key, str] = field(default_factory=dict)


class Prober:
    """Probes every ready model version once per round; a round passes only if all answered."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self._pending: dict[Key, tuple[concurrent.futures.Future[InferResponse], float]] = {}
        self._inputs: dict[Key, tuple[int, dict[str, np.ndarray]]] = {}

    def _inputs_for(self, mv: ModelVersion) -> dict[str, np.ndarray]:
        key = (mv.name, mv.version)
        cached = self._inputs.get(key)
        if cached is None or cached[0] != id(mv):  # a reload swapped in a new copy of this version
            cached = (id(mv), sample_inputs(mv))
            self._inputs[key] = cached
        return cached[1]

    def _submit(self, mv: ModelVersion) -> concurrent.futures.Future[InferResponse] | str | None:
        try:
            return self.service.submit(InferRequest(model=mv.name, version=mv.version, inputs=self._inputs_for(mv),
                                                    id=PROBE_ID, source="watchdog"))
        except (ModelNotReadyError, ModelNotFoundError):
            return None  # swapped or unloaded since we listed it: not a health problem
        except OverloadedError:
            return None  # busy, not hung: a hung queue shows up as the previous probe still pending
        except EdgedError as e:
            return str(e)
        except (OSError, KeyError, ValueError) as e:
            return f"probe input unusable: {e}"

    async def probe(self, timeout: float) -> ProbeResult:
        """One round: submit where no probe is pending, then wait up to ``timeout`` for all of them."""
        now = time.monotonic()
        # Pipelines are not probed: their models are, and a pipeline has no sample input of its own.
        versions = [mv for mv in self.service.versions()
                    if mv.state is ModelState.READY and mv.pipeline is None]
        live = {(mv.name, mv.version) for mv in versions}
        for key in [k for k in self._pending if k not in live]:
            del self._pending[key]
        result = ProbeResult(ok=True, checked=len(versions))
        for mv in versions:
            key = (mv.name, mv.version)
            if key in self._pending:
                continue
            sub = self._submit(mv)
            if isinstance(sub, str):
                result.problems[key] = sub
            elif sub is not None:
                self._pending[key] = (sub, now)
        waiting = {key: fut for key, (fut, _) in self._pending.items()}
        if waiting:
            wrapped = {asyncio.wrap_future(f): key for key, f in waiting.items()}
            # asyncio.wait, not wait_for: a timeout must not cancel the probe, it stays pending.
            await asyncio.wait(wrapped, timeout=timeout)
        end = time.monotonic()
        for key, fut in waiting.items():
            if not fut.done():
                since = self._pending[key][1]
                result.problems[key] = f"no answer for {end - since:.1f}s"
                continue
            del self._pending[key]
            exc = fut.exception()
            if exc is None:
                found = self.service.find(*key)
                why = check_response(found, fut.result()) if found is not None else None
                if why:
                    result.problems[key] = why
            elif not isinstance(exc, (ModelNotReadyError, ModelNotFoundError, OverloadedError)):
                result.problems[key] = f"{type(exc).__name__}: {exc}"
        result.ok = not result.problems
        return result
