"""Per model-version scheduler: a bounded queue, dynamic batching and ``instances.count`` workers.

Each request owns a ``concurrent.futures.Future``; a failed batch fails every one
of its requests with the same error. Workers are plain threads because the
engines release the GIL while they compute.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from edged.backends.base import Engine
from edged.core.batch_policy import BatchPolicy
from edged.core.engine_errors import GoodShapes, failure_key
from edged.core.output_shapes import OutputShapeCheck
from edged.core.stats import ModelStats
from edged.core.traffic import TrafficMix
from edged.errors import (
    DeadlineExceededError,
    EdgedError,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    OverloadedError,
)
from edged.protocol.types import InferRequest, InferResponse
from edged.repository.manifest import Batching

log = logging.getLogger(__name__)

# How long after seeing concurrent arrivals the batcher keeps waiting for batches to fill.
_CONCURRENCY_MEMORY_S = 0.1
# typical_run_ns before any lone run has been seen: longer than any caller will block for.
_UNKNOWN_RUN_NS = 1 << 62
# A lone run this long (for the typical input bytes) is a strike against running the model on an event
# loop; a second strike within _STRIKE_MEMORY_S keeps it off the loop for that long after each strike.
# One strike alone is forgiven: a process stalled by its host (a 30 us run once took 50 ms on a loaded
# CI machine) looks the same, and the moving average already keeps the next requests off the loop.
_LONG_RUN_NS = 50_000_000
_STRIKE_MEMORY_S = 600.0


def _nbytes(inputs: Mapping[str, np.ndarray]) -> int:
    n = 0
    for a in inputs.values():  # no generator: this runs on caches an engine run has just evicted
        n += a.nbytes
    return n


@dataclass
class _Item:
    request: InferRequest
    batch: int
    signature: tuple[object, ...]
    enqueued_ns: int
    future: Future[InferResponse] = field(default_factory=Future)
    # A blocking caller's (run_inline): when this copy is unloaded before it starts, the service takes
    # it on to the serving copy, which counts it; this copy does not count it as failed as well.
    handed_on: bool = False


def _signature(req: InferRequest, batched: bool) -> tuple[object, ...]:
    """Requests can share a batch when every input agrees on everything but the batch dimension.
    (Computed for every queued request: the dtype objects themselves, and no sort of one input.)"""
    sig = [(n, a.dtype, a.shape[1:] if batched else a.shape) for n, a in req.inputs.items()]
    if len(sig) > 1:
        sig.sort()  # by name: names are unique, so the dtypes are never compared
    return tuple(sig)


class Scheduler:
    def __init__(self, name: str, version: int, engine: Engine, *, max_batch_size: int,  # noqa: PLR0913  keyword-only options from the model's config
                 batching: Batching | None, instances: int, stats: ModelStats, shapes_vary: bool = True,
                 output_check: OutputShapeCheck | None = None) -> None:
        self.name, self.version = name, version
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batching = batching
        self.max_queue = batching.max_queue_size if batching else 1024
        self.delay_ns = (batching.max_queue_delay_us * 1000) if batching else 0
        self.preferred = sorted(batching.preferred_batch_sizes) if batching else []
        self.stats = stats
        self.policy = BatchPolicy(max_batch_size > 0 and batching is not None)
        stats.batching = self.policy.to_json
        self.good_shapes = GoodShapes(max_batch_size > 0)
        # With every dimension declared (batch aside), validation already pins the shapes a run sees.
        self._record_shapes = self.good_shapes.record if shapes_vary else None
        self.output_check = output_check  # the first answers against the declared outputs, then None
        # The shapes and batch sizes served, for choosing the engine again (edged.core.chooser); None: not noted.
        self.traffic: TrafficMix | None = None
        # The condition's lock, taken directly on the inline path (twice per request): a C-level
        # enter/exit instead of the Condition's Python wrapper.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[_Item] = collections.deque()
        self._running = True
        self._busy = 0
        self._concurrent_until = 0.0
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=8)
        self._instances = instances
        # Moving averages of one request's engine run alone (ns) and of its input bytes; unknown until
        # a run has been seen, so an event loop never runs a model inline before knowing how long it
        # blocks. A request's run is estimated in proportion to its input bytes (dynamic shapes).
        self.typical_run_ns = _UNKNOWN_RUN_NS
        self._typical_bytes = 1
        # A model whose run length depends on the values sent (a loop count, a detector's boxes) comes
        # back under the average's limit after ~40 short runs and would block the loop again at its
        # next long one: the last long run's time, and until when the loop keeps off (0.0: it does not).
        self._last_long_s = float("-inf")
        self._off_loop_until = 0.0
        self._workers = [
            threading.Thread(target=self._work, name=f"edged-{name}-v{version}-{i}", daemon=True)
            for i in range(instances)
        ]
        for w in self._workers:
            w.start()

    # ---- submission -------------------------------------------------------------------------
    def submit(self, req: InferRequest, batch: int, *, handed_on: bool = False) -> Future[InferResponse]:
        """Queue ``req``; ``handed_on``: its caller takes a ModelNotReadyError on to the serving copy (run_inline)."""
        item = _Item(req, batch, _signature(req, self.max_batch_size > 0), time.monotonic_ns(), handed_on=handed_on)
        with self._cv:
            if not self._running:
                raise ModelNotReadyError(f"model {self.name!r} version {self.version} is unloading")
            if len(self._queue) >= self.max_queue:
                if req.source is None:  # an internal caller counts its own refusal (or not at all)
                    self.stats.record_failure("overloaded", total_ns=0, started=False)
                raise OverloadedError(
                    f"model {self.name!r} version {self.version}: queue full ({self.max_queue} requests waiting)")
            if self._queue or self._busy >= self._instances:
                self._concurrent_until = time.monotonic() + _CONCURRENCY_MEMORY_S
            self._queue.append(item)
            self.stats.enter()
            self._cv.notify()
        return item.future

    def run_inline(self, req: InferRequest, batch: int) -> InferResponse:
        """Blocking inference that runs in the caller's thread when the model is idle.

        Handing a request to a worker thread and back costs tens of microseconds of
        wake-ups; a blocking caller (a shm connection thread) skips that when nothing
        is queued and an instance is free. Otherwise it queues like everyone else; if this copy
        is unloaded before the request starts (drain timed out), ModelNotReadyError sends it on
        to the serving copy (InferenceService._dispatch), and only that copy counts it.
        """
        if not self._claim():
            return self.submit(req, batch, handed_on=True).result()
        return self._run_claimed(req, batch, _nbytes(req.inputs))

    def try_inline(self, req: InferRequest, batch: int, max_run_ns: int | None) -> InferResponse | None:
        """Run on the caller's thread if the model is idle and its runs take at most ``max_run_ns``
        (None: however long; a thread that reads requests and may block for a run, not for a queue).

        None: the caller queues it (``submit``). For an event loop, which may block for a
        short run but must never wait for a queue or a long one, nor for an engine restoring itself.
        """
        if self.engine.restoring:
            return None
        nbytes = _nbytes(req.inputs)
        if max_run_ns is not None and not self.short_enough(nbytes, max_run_ns):
            return None
        if not self._claim():
            return None
        return self._run_claimed(req, batch, nbytes)

    def short_enough(self, nbytes: int, max_run_ns: int) -> bool:
        """Whether a request of ``nbytes`` input bytes is expected to run within ``max_run_ns``: by the
        moving average (a host stall lifts it over the limit for several runs) and unless two long
        runs lately keep event loops off the model."""
        typical = self.typical_run_ns
        if typical > max_run_ns or nbytes * typical > max_run_ns * self._typical_bytes:
            return False
        if self._off_loop_until:
            if time.monotonic() < self._off_loop_until:
                return False
            self._off_loop_until = 0.0  # served its time: the average alone decides again
        return True

    def _claim(self) -> bool:
        """Take an instance for the caller if nothing is queued and no traffic overlapped lately."""
        with self._lock:
            if (self._running and not self._queue and self._busy < self._instances
                    and time.monotonic() >= self._concurrent_until):
                self._busy += 1
                return True
            return False

    def _run_claimed(self, req: InferRequest, batch: int, nbytes: int) -> InferResponse:
        """The inline hot path: after the claim, one lock for the statistics' in-flight count and one
        to give the instance back; the run's figures are noted without a lock (ModelStats)."""
        stats = self.stats
        stats.enter()
        start_ns = time.monotonic_ns()
        try:
            if req.deadline is not None and start_ns / 1e9 > req.deadline:
                raise DeadlineExceededError(f"model {self.name!r}: request arrived past its deadline")
            # ``_compute`` for one request: no concatenation, no split
            wanted = req.outputs
            t1 = time.monotonic_ns()
            outs = self._engine_run(req.inputs, wanted)
            t2 = time.monotonic_ns()
            if wanted is not None:
                outs = {n: outs[n] for n in wanted}
            t3 = time.monotonic_ns()
            if req.source is None:
                stats.record_inline(batch, t1 - start_ns, t2 - t1, t3 - t2, t3 - start_ns, end_ns=t3)
            else:
                stats.record_internal(req.source)
            self._note_run(t3 - start_ns, nbytes)
        except EdgedError as e:
            self._count_failure(req, failure_key(e), time.monotonic_ns() - start_ns)
            raise
        except BaseException:
            self._count_failure(req, "internal", time.monotonic_ns() - start_ns)
            raise
        finally:
            with self._lock:
                self._busy -= 1
                if not self._running:
                    self._cv.notify_all()  # drain() waits for inline runs too
                elif self._queue:
                    self._cv.notify()
        return InferResponse(self.name, self.version, outs, req.id)

    def _engine_run(self, inputs: Mapping[str, np.ndarray], wanted: Sequence[str] | None) -> dict[str, np.ndarray]:
        """One engine run; an engine failure becomes the input's fault or an internal one (engine_errors)."""
        try:
            outputs = self.engine.infer(inputs, wanted)
        except Exception as e:
            if isinstance(e, EdgedError) and not isinstance(e, InvalidInputError):
                raise
            raise self.good_shapes.explain(f"model {self.name!r} version {self.version}", inputs, e) from None
        record = self._record_shapes
        if record is not None:
            record(inputs)
        check = self.output_check
        if check is not None and check.see(outputs):
            self.output_check = None
        traffic = self.traffic
        if traffic is not None:
            traffic.record(inputs)
        return outputs

    def _note_run(self, ns: int, nbytes: int) -> None:
        """Fold one lone request's run into the typical figures (plain stores: readers tolerate stale values)."""
        typical = self.typical_run_ns
        if typical == _UNKNOWN_RUN_NS:
            self.typical_run_ns, self._typical_bytes = ns, nbytes or 1
        else:  # an eighth of the way towards the new figures, in integers rounded to the nearest
            self.typical_run_ns = typical + ((ns - typical + 4) >> 3)
            b = self._typical_bytes
            self._typical_bytes = (b + ((nbytes - b + 4) >> 3)) or 1
        if ns > _LONG_RUN_NS and ns * self._typical_bytes > _LONG_RUN_NS * (nbytes or 1):
            self._strike()

    def _strike(self) -> None:
        """A lone run far longer than any loop may block for, its input bytes as usual: the second
        within the memory keeps event loops off the model (a thread of its own may still run it)."""
        now = time.monotonic()
        if now - self._last_long_s < _STRIKE_MEMORY_S:
            if now >= self._off_loop_until:
                log.info("model %r version %s: a second run over %d ms within %d min; event loops hand its "
                         "requests to its worker for the next %d min", self.name, self.version,
                         _LONG_RUN_NS // 1_000_000, _STRIKE_MEMORY_S // 60, _STRIKE_MEMORY_S // 60)
            self._off_loop_until = now + _STRIKE_MEMORY_S
        self._last_long_s = now

    @property
    def instances(self) -> int:
        """Batches it runs at once (the manifest's instances, or the engine's worker processes)."""
        return self._instances

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ---- workers ----------------------------------------------------------------------------
    def _take(self) -> tuple[list[_Item], bool] | None:
        """Block until a batch is ready; None when stopping with an empty queue.

        The flag says whether the run informs the batching policy: a combined run, or a single
        run while others were waiting (one that could have been combined). A single request on
        a quiet queue costs less than one under load and would skew the comparison.
        """
        with self._cv:
            # An inline caller holds an instance slot too: never run more than instances.count at once.
            while not self._queue or self._busy >= self._instances:
                if not self._running and not self._queue:
                    return None
                self._cv.wait()
            combine = self.policy.batch_now()
            batch = self._gather(combine=combine)
            # The instance is this batch's from now: while it fills (the lock released in the wait), an
            # inline caller that finds the queue empty must not take it as well and run beside it.
            self._busy += 1
            if combine and self.delay_ns and self._should_wait(batch):
                deadline = batch[0].enqueued_ns + self.delay_ns
                while self._running:
                    remaining = deadline - time.monotonic_ns()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining / 1e9)
                    batch += self._gather(batch)
                    if not self._should_wait(batch):
                        break
            # What traffic reached: this batch plus whatever is still waiting behind it.
            seen = sum(i.batch for i in batch) + sum(i.batch for i in self._queue)
            self._recent_sizes.append(min(seen, self.max_batch_size or 1))
            return batch, len(batch) > 1 or bool(self._queue)

    def _gather(self, have: list[_Item] | None = None, *, combine: bool = True) -> list[_Item]:
        """Move compatible items from the queue into the batch (called with the lock held)."""
        have = have or []
        if not combine or self.max_batch_size == 0 or self.batching is None:
            return [] if have or not self._queue else [self._queue.popleft()]
        total = sum(i.batch for i in have)
        sig = (have[0] if have else self._queue[0]).signature
        taken: list[_Item] = []
        kept: collections.deque[_Item] = collections.deque()
        while self._queue and total < self.max_batch_size:
            item = self._queue.popleft()
            if item.signature == sig and total + item.batch <= self.max_batch_size:
                taken.append(item)
                total += item.batch
            else:
                kept.append(item)
        if kept:
            kept.extend(self._queue)
            self._queue = kept
        return taken

    def _should_wait(self, batch: list[_Item]) -> bool:
        """Wait for more only while the batch is below the size recent traffic reached.

        Closed-loop callers never outnumber the batches they form, so holding a batch
        for callers that do not exist only adds the full delay; a serial caller (recent
        batches of one) never waits at all.
        """
        total = sum(i.batch for i in batch)
        if self.batching is None or total >= self.max_batch_size:
            return False
        target = max(self._recent_sizes, default=1)
        if self.preferred:
            target = min(target, self.preferred[-1])
        return total < target

    def _work(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            self._serve(*taken)
            # Nothing of the batch outlives _serve: its frame held the requests' inputs, views on a
            # client's shared memory, which a worker waiting in _take kept mapped after the client left.
            del taken

    def _serve(self, batch: list[_Item], informs: bool) -> None:
        """Run one batch taken from the queue, give the instance back, then answer."""
        start_ns = time.monotonic_ns()
        answers: list[tuple[_Item, InferResponse | EdgedError]] = []
        try:
            answers = self._run(batch, start_ns, informs)
        except BaseException as e:  # never let a worker die: fail the batch instead
            log.exception("model=%s version=%s worker error", self.name, self.version)
            answers = [(item, InternalError(f"internal error: {type(e).__name__}"))
                       for item in batch if not item.future.done()]
        finally:
            # The instance is free before anyone hears back: a caller that sends its next request as
            # soon as it has this answer finds the model idle (and runs inline), instead of finding
            # it busy, queueing, and keeping every later request of a serial client queued as well.
            with self._cv:
                self._busy -= 1
                self._cv.notify_all()
        try:
            self._answer(answers, start_ns)
        except BaseException:
            log.exception("model=%s version=%s: answering a batch failed", self.name, self.version)

    def _run(self, batch: list[_Item], start_ns: int,
             informs: bool = False) -> list[tuple[_Item, InferResponse | EdgedError]]:
        """Run one batch; every request's answer (or error) is returned for :meth:`_answer`."""
        now = start_ns / 1e9
        answers: list[tuple[_Item, InferResponse | EdgedError]] = []
        live: list[_Item] = []
        for item in batch:
            dl = item.request.deadline
            if dl is not None and now > dl:
                waited_ms = (start_ns - item.enqueued_ns) / 1e6
                answers.append((item, DeadlineExceededError(
                    f"model {self.name!r}: request waited {waited_ms:.1f} ms, past its deadline")))
            elif not item.future.set_running_or_notify_cancel():
                self._count_failure(item.request, "cancelled", start_ns - item.enqueued_ns)
            else:
                live.append(item)
        if not live:
            return answers
        try:
            results = self._compute([(i.request, i.batch) for i in live], queued=informs)
        except EdgedError as e:
            return answers + [(item, e) for item in live]
        return answers + [(item, InferResponse(self.name, self.version, outs, item.request.id))
                          for item, outs in zip(live, results, strict=True)]

    def _answer(self, answers: list[tuple[_Item, InferResponse | EdgedError]], start_ns: int) -> None:
        """Statistics first, then the answer: a caller that reads them after its answer sees itself counted."""
        for item, answer in answers:
            if isinstance(answer, EdgedError):
                self._fail(item, answer)
                continue
            done_ns = time.monotonic_ns()
            if item.request.source is None:
                self.stats.record_success(queue_ns=start_ns - item.enqueued_ns, total_ns=done_ns - item.enqueued_ns)
            else:
                self.stats.record_internal(item.request.source)
            item.future.set_result(answer)

    def _compute(self, reqs: list[tuple[InferRequest, int]], *, queued: bool = True) -> list[dict[str, np.ndarray]]:
        """Concatenate along the batch dimension, run the engine once, split the outputs back.

        Raises one EdgedError for the whole batch: every request in it fails the same way.
        Only runs made while requests overlapped (``queued``) inform the batching policy: an
        inline run or a lone queued one costs far less than a single run under load, and
        comparing the two would flip the decision with every change in traffic.
        """
        t0 = time.monotonic_ns()
        if len(reqs) == 1:
            inputs = dict(reqs[0][0].inputs)
        else:
            names = list(reqs[0][0].inputs)
            inputs = {n: np.concatenate([r.inputs[n] for r, _ in reqs], axis=0) for n in names}
        wanted = self._wanted_outputs([r for r, _ in reqs])
        t1 = time.monotonic_ns()
        outputs = self._engine_run(inputs, wanted)
        t2 = time.monotonic_ns()
        results: list[dict[str, np.ndarray]] = []
        if len(reqs) == 1:
            r = reqs[0][0]
            results.append(outputs if r.outputs is None else {n: outputs[n] for n in r.outputs})
        else:
            offset = 0
            for r, b in reqs:
                sl = slice(offset, offset + b)
                offset += b
                results.append({n: outputs[n][sl] for n in (r.outputs or outputs)})
        t3 = time.monotonic_ns()
        samples = sum(b for _, b in reqs)
        # Engine runs count what clients sent: a run for internal requests alone (self-test, probe) is not
        # counted, and a shared one counts only its clients' elements.
        clients = [b for r, b in reqs if r.source is None]
        if clients:
            self.stats.record_batch(sum(clients), len(clients), t1 - t0, t2 - t1, t3 - t2)
        if len(reqs) == 1:
            self._note_run(t3 - t0, _nbytes(inputs))
        if queued:
            self.policy.record(samples, len(reqs), t3 - t0)
        return results

    @staticmethod
    def _wanted_outputs(reqs: list[InferRequest]) -> list[str] | None:
        if any(r.outputs is None for r in reqs):
            return None
        names: dict[str, None] = {}
        for r in reqs:
            for n in r.outputs or ():
                names[n] = None
        return list(names)

    def _count_failure(self, req: InferRequest, code: str, total_ns: int) -> None:
        """A started request failed: a client's failure by code, an internal one apart (by source)."""
        if req.source is None:
            self.stats.record_failure(code, total_ns=total_ns)
        else:
            self.stats.record_internal(req.source)

    def _fail(self, item: _Item, err: EdgedError) -> None:
        self._count_failure(item.request, failure_key(err), time.monotonic_ns() - item.enqueued_ns)
        if not item.future.done():
            item.future.set_exception(err)

    # ---- shutdown ---------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Stop taking requests, finish the queued ones and the inline runs under way, stop the workers.
        True when all finished: only then may the engine be freed."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._running = False
            self._cv.notify_all()
        ok = True
        for w in self._workers:
            w.join(None if end is None else max(0.0, end - time.monotonic()))
            ok = ok and not w.is_alive()
        with self._cv:  # a caller's thread running a request inline holds an instance too
            while self._busy > 0:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
            ok = ok and self._busy == 0
        if not ok:
            with self._cv:
                leftover = list(self._queue)
                self._queue.clear()
            for item in leftover:
                err = ModelNotReadyError(f"model {self.name!r} version {self.version} was unloaded")
                if item.handed_on:  # not started here, answered elsewhere: counted there only
                    self.stats.withdraw()
                    item.future.set_exception(err)
                else:
                    self._fail(item, err)
        return ok
