"""Serve first, choose after; choose again when the traffic changes.

A version whose engine is chosen by measurement (a ``select = "benchmark"`` profile,
or the CPU engines every profile ends in) starts serving at once on the remembered
choice or the profile's first candidate that loads (:class:`Choice`, ``mv.choice``),
behind a :class:`~edged.core.upgrade.SwappableEngine`. This thread, started once the
daemon is READY, then:

- measures the candidates on the shapes the model will see (declared ``[warmup.shapes]``
  or sample data, else the static dimensions, else, for a model with undeclared dynamic
  dimensions, the shapes it has served) at batch 1 and the batch the scheduler forms;
- later compares what the version really serves (``edged.core.traffic``) with what the
  choice was made on, and when the mix moved (shapes or batch sizes), measures again on
  real samples of that traffic, weighted by its share;

and swaps in the winner the way a background TensorRT build is switched in: later
batches go to the new engine, running ones finish on the old one, no request fails.
It measures only when the daemon is not in a burst (engines busy less than half the
time, nothing queued; at most ``MAX_POSTPONE_S`` of waiting), and with
``BenchmarkSettings.duty`` it takes at most that share of the time it runs for.
The engine serving now stays unless another is faster by more than the margin, so
noise never flips a choice back and forth. Benchmark calls go to the engines
directly, never through the scheduler: they are not requests and are not counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from edged.backends.base import Engine
from edged.backends.benchmark import (
    BenchmarkResult,
    BenchmarkSettings,
    CandidateTiming,
    WorkPoint,
    batch_sizes_for,
    choose,
    default_points,
    measure_points,
    mix_score,
    shape_label,
)
from edged.backends.selection import Candidate
from edged.core.model_loader import ModelLoader
from edged.core.model_versions import ModelState, ModelTable, ModelVersion, sample_inputs, synthesized
from edged.core.traffic import Seen, TrafficMix
from edged.core.upgrade import SwappableEngine
from edged.heap import review_soon
from edged.repository.manifest import TensorSpec

log = logging.getLogger(__name__)

POLL_S = 0.5
BURST_BUSY = 0.5  # engines busy more than this share of the last poll: a burst, measuring waits
MAX_POSTPONE_S = 5.0  # ... but not longer than this: steady load is not a burst
MIN_RUNS = 20  # runs of traffic before they may drive a choice ...
MIN_RUNS_SLOW = 3  # ... or this many, once the window is SLOW_WINDOW_S old (models that take long per run)
SLOW_WINDOW_S = 5.0
CHANGE = 0.5  # share of the served samples outside what the choice was measured on that re-measures
COOLDOWN_S = 5.0  # between two measurements of one version
REBASE_RUNS = 2000  # a quiet window this long starts afresh, so a later change shows quickly
MAX_POINTS = 4
SPLIT_SHARE = 0.1  # batch 1 and larger batches each carry this share of samples, or they share one engine
# After READY there is time to measure well: longer than at load, at half duty, stopping early when
# one engine leads every round by far (a close call gets every round).
BACKGROUND = BenchmarkSettings(time_per_candidate_s=1.5, total_s=8.0, rounds=10, margin=0.05, duty=0.5,
                               decided_after=3, clear=0.25, min_rounds=4)


def _class(label: str) -> str:
    """A work point's label with its batch size reduced to one or many (batches of 3 and 4 are alike)."""
    shapes, at, batch = label.partition("@")
    return shapes + ("@1" if not at or batch == "1" else "@n")


def distance(a: dict[str, float], b: dict[str, float]) -> float:
    """Total variation distance between two mixes over :func:`_class` labels (0 same, 1 disjoint)."""
    def norm(m: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in m.items():
            out[_class(k)] = out.get(_class(k), 0.0) + v
        total = sum(out.values()) or 1.0
        return {k: v / total for k, v in out.items()}
    na, nb = norm(a), norm(b)
    return 1.0 - sum(min(v, nb.get(k, 0.0)) for k, v in na.items())


def traffic_points(window: Sequence[Seen], batched: bool) -> list[WorkPoint]:
    """The served traffic as work points: per shape and batch class, its share of the samples,
    the batch size it was most often run at and one real sample; the heaviest ``MAX_POINTS``."""
    groups: dict[str, tuple[float, Seen]] = {}
    total = 0.0
    for s in window:
        if s.sample is None:
            continue
        samples = float(s.runs * s.batch)
        total += samples
        key = _class(shape_label(s.sample, s.batch, batched))
        have = groups.get(key)
        if have is None:
            groups[key] = (samples, s)
        else:  # the batch size run most often stands for the class
            groups[key] = (have[0] + samples, s if s.runs > have[1].runs else have[1])
    top = sorted(groups.values(), key=lambda g: -g[0])[:MAX_POINTS]
    kept = sum(w for w, _ in top) or 1.0
    return [WorkPoint(shape_label(s.sample, s.batch, batched), s.sample, s.batch, w / kept)
            for w, s in top if s.sample is not None]


def window_mix(window: Sequence[Seen], batched: bool) -> dict[str, float]:
    return {shape_label(s.sample, s.batch, batched) if s.sample is not None else f"?{i}": float(s.runs * s.batch)
            for i, s in enumerate(window)}


@dataclass
class Choice:
    """How a version's engine is chosen among ``group`` (mv.choice), and the evidence so far."""

    group: list[Candidate]
    proxy: SwappableEngine
    key: str  # the selection key results are remembered under
    state: str = "pending"  # pending | waiting for traffic | measuring | chosen | single (no other loads)
    boot_points: list[WorkPoint] = field(default_factory=list)  # empty: the shapes are not known until served
    basis_window: list[Seen] = field(default_factory=list)  # traffic counted when the last choice was made
    basis_mix: dict[str, float] = field(default_factory=dict)
    window_since: float = field(default_factory=time.monotonic)  # when basis_window was taken
    last_measured: float = 0.0  # monotonic
    measurements: int = 0
    switches: list[dict[str, Any]] = field(default_factory=list)
    due_since: float | None = None
    traffic: TrafficMix | None = None
    unusable: dict[str, str] = field(default_factory=dict)  # candidates that did not load: label -> why
    batched: Candidate | None = None  # the engine runs of several samples go to, when not the serving one
    restore: Candidate | None = None  # a remembered split to set up again once READY

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "candidates": [c.label for c in self.group],
                "batched": self.batched.label if self.batched is not None else None,
                "measurements": self.measurements, "switches": list(self.switches[-5:]),
                "measured_on": {k: round(v, 4) for k, v in self.basis_mix.items()}}


class EngineChooser:
    """One background thread for every version with a :class:`Choice`."""

    def __init__(self, table: ModelTable, loader: ModelLoader, *, settings: BenchmarkSettings = BACKGROUND,
                 poll_s: float = POLL_S) -> None:
        self.table = table
        self.loader = loader
        self.settings = settings
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_busy: tuple[float, int] | None = None
        self._lock = threading.Lock()  # one measurement at a time (the thread, or run_once from a caller)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="edged-engine-choice", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 60.0) -> threading.Thread | None:
        """Stop measuring; the chooser's thread if it is still running after ``wait_s``.

        It gives up between engine calls, but a candidate's load or warm-up is one call it cannot leave
        (minutes for a big model's compile): the daemon's stop waits only ``wait_s`` for it."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return None
        thread.join(wait_s)
        if thread.is_alive():
            return thread
        self._thread = None
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.run_once()
            except Exception:  # the chooser must never take serving down
                log.exception("engine choice pass failed")

    # ---- one pass -----------------------------------------------------------------------------
    def run_once(self, *, force: bool = False) -> int:
        """Measure every version that is due (``force``: ignore bursts and the cooldown); how many were."""
        busy = self._busy()
        done = 0
        with self._lock:
            for mv in self.table.all():
                choice = mv.choice
                if not isinstance(choice, Choice) or mv.state is not ModelState.READY or choice.proxy.closed:
                    continue
                if mv.upgrade is not None and mv.upgrade.state == "building":
                    continue  # a TensorRT build will be judged against the engine serving now
                if choice.restore is not None:
                    self._restore_split(mv, choice, choice.restore)
                    continue
                due = self._due(mv, choice, force=force)
                if due is None:
                    choice.due_since = None
                    continue
                now = time.monotonic()
                if choice.due_since is None:
                    choice.due_since = now
                if busy and not force and now - choice.due_since < MAX_POSTPONE_S:
                    continue  # never during a burst; steady load is not a burst
                points, basis, why = due
                self.measure(mv, choice, points, basis=basis, why=why)
                choice.due_since = None
                done += 1
                busy = self._busy()  # the traffic while it measured decides whether the next may go
                if self._stop.is_set():
                    break
        if done:  # engines were opened and dropped: collect what they left, freeze what stays (edged/heap.py)
            review_soon()
        return done

    def _busy(self) -> bool:
        """Whether the engines were busy more than BURST_BUSY of the time since the last look, or a queue waits."""
        total = 0
        queued = False
        for mv in self.table.all():
            if mv.stats is not None:
                total += mv.stats.busy_ns()
            if mv.scheduler is not None and mv.scheduler.queued:
                queued = True
        now = time.monotonic()
        last, self._last_busy = self._last_busy, (now, total)
        if last is None or now <= last[0]:
            return queued
        return queued or (total - last[1]) / 1e9 / (now - last[0]) > BURST_BUSY

    def _due(self, mv: ModelVersion, choice: Choice, *, force: bool
             ) -> tuple[list[WorkPoint], str, str] | None:
        batched = mv.max_batch_size > 0
        window = TrafficMix.since(choice.traffic.snapshot(), choice.basis_window) if choice.traffic else []
        runs = sum(s.runs for s in window)
        if runs >= MIN_RUNS_SLOW and time.monotonic() - choice.window_since >= SLOW_WINDOW_S:
            runs = max(runs, MIN_RUNS)  # few runs, but of a slow model: enough to go on
        if choice.state in ("pending", "waiting for traffic"):
            return _first_due(choice, window, runs, batched=batched, force=force)
        if runs < MIN_RUNS or choice.state == "single":
            return None
        if not force and time.monotonic() - choice.last_measured < COOLDOWN_S:
            return None
        moved = distance(window_mix(window, batched), choice.basis_mix)
        if moved <= CHANGE:
            if runs >= REBASE_RUNS and choice.traffic is not None:
                choice.basis_window, choice.window_since = choice.traffic.snapshot(), time.monotonic()
            return None
        points = traffic_points(window, batched)
        if not points:
            return None
        served = ", ".join(f"{p.label} {p.weight:.0%}" for p in points)
        return points, "traffic", f"traffic moved ({moved:.0%} of samples unlike the last measurement): {served}"

    # ---- measuring and switching --------------------------------------------------------------
    def measure(self, mv: ModelVersion, choice: Choice, points: list[WorkPoint], *, basis: str, why: str) -> None:
        """Load the other candidates, time them all on ``points``, switch to the winners, remember them.

        Batch-1 runs and runs of several samples may get different engines: where one engine wins on
        the batch-1 points and another on the batched ones, each by more than the margin, and both carry
        at least ``SPLIT_SHARE`` of the samples, larger batches go to the second (``SwappableEngine``).
        """
        serving = mv.candidate
        if serving is None or not points:
            return
        choice.state = "measuring"
        t0 = time.monotonic()
        # What serves now: batch-1 runs on ``serving``, larger ones on ``choice.batched`` when split.
        held: dict[str, tuple[Candidate, Engine]] = {serving.label: (serving, choice.proxy.current)}
        if choice.batched is not None and choice.proxy.batched is not None:
            held[choice.batched.label] = (choice.batched, choice.proxy.batched)
        opened, load_failures = self._open_others(mv, choice, held)
        if len(held) < 2:  # nothing to compare with: the engine serving stays
            choice.state = "single"
            # Never measured again: the scheduler need not note the traffic of every run any more.
            choice.traffic = None
            if mv.scheduler is not None:
                mv.scheduler.traffic = None
            choice.last_measured = time.monotonic()
            self.loader.explain(mv, choice.group, BenchmarkResult(
                key=choice.key, chosen=serving.label, timings=[], batch_sizes=[], failures=load_failures))
            return
        order = {c.label: i for i, c in enumerate(choice.group)}
        engines = sorted(held.values(), key=lambda ce: order.get(ce[0].label, 0))
        batched = mv.max_batch_size > 0
        try:
            timings, failures = measure_points(engines, points, batched=batched, settings=self.settings,
                                               stop=self._stop.is_set)
        except BaseException:
            for engine in opened.values():
                engine.unload()
            raise
        if self._stop.is_set():  # the daemon is stopping: change nothing
            for engine in opened.values():
                engine.unload()
            choice.state = "chosen" if choice.measurements else "pending"
            return
        one, many = self._winners(timings, points, serving.label,
                                  choice.batched.label if choice.batched is not None else serving.label)
        if one is None:
            one = serving.label
        many_label = many if many is not None and many != one else None
        new_current = held[one][1]
        new_batched = held[many_label][1] if many_label is not None else None
        for label, engine in opened.items():
            if label not in (one, many_label):
                engine.unload()
        before = (serving.label, choice.batched.label if choice.batched is not None else None)
        if (one, many_label) != before:
            old = choice.proxy.install(new_current, new_batched)
            if old is None:  # unloaded meanwhile
                choice.state = "chosen"
                return
            for engine in old:
                engine.unload()
            _note_switch(mv, choice, before, held[one][0], held[many_label][0] if many_label is not None else None,
                         why)
        result = BenchmarkResult(
            key=choice.key, chosen=one, timings=timings, batch_sizes=sorted({p.batch for p in points}),
            seconds=time.monotonic() - t0, complete=True, failures=load_failures + failures,
            workload={p.label: p.weight for p in points}, basis=basis, reason=why, measured_at=time.time(),
            chosen_batched=many_label)
        mv.benchmark = result
        self.loader.explain(mv, choice.group, result)
        self.loader.remember(mv, result)
        choice.basis_window = choice.traffic.snapshot() if choice.traffic is not None else []
        choice.window_since = time.monotonic()
        choice.basis_mix = dict(result.workload)
        choice.last_measured = time.monotonic()
        choice.measurements += 1
        choice.state = "chosen"
        log.info("model=%s version=%s engine choice (%s): %s", mv.name, mv.version, why,
                 ", ".join(f"{t.candidate} {t.throughput_per_s:.0f}/s" for t in timings))

    def _open_others(self, mv: ModelVersion, choice: Choice, held: dict[str, tuple[Candidate, Engine]]
                     ) -> tuple[dict[str, Engine], list[tuple[str, str]]]:
        """Open the group's candidates not ``held`` yet (added to it); returns those opened here and why
        the others could not be (remembered in ``choice.unusable``, so they are not tried again)."""
        opened: dict[str, Engine] = {}
        load_failures: list[tuple[str, str]] = []
        for cand in choice.group:
            if cand.label in held:
                continue
            if cand.label in choice.unusable:
                load_failures.append((cand.label, choice.unusable[cand.label]))
                continue
            got = self.loader.open_alternate(mv, cand)
            if isinstance(got, str):
                choice.unusable[cand.label] = got
                load_failures.append((cand.label, got))
                continue
            mismatch = _io_mismatch(mv, got.inputs, got.outputs)
            if mismatch:
                got.engine.unload()
                choice.unusable[cand.label] = mismatch
                load_failures.append((cand.label, f"not usable in place of the serving engine: {mismatch}"))
                continue
            opened[cand.label] = got.engine
            held[cand.label] = (cand, got.engine)
        return opened, load_failures

    def _restore_split(self, mv: ModelVersion, choice: Choice, cand: Candidate) -> None:
        """Load the remembered engine for runs of several samples and route them to it again."""
        choice.restore = None
        got = self.loader.open_alternate(mv, cand)
        if isinstance(got, str) or _io_mismatch(mv, got.inputs, got.outputs):
            if not isinstance(got, str):
                got.engine.unload()
            log.warning("model=%s version=%s: the remembered engine for batches, %s, is not usable; one "
                        "engine serves every batch until measured again", mv.name, mv.version, cand.label)
            return
        old = choice.proxy.install(choice.proxy.current, got.engine)
        if old is None:
            return
        for engine in old:
            engine.unload()
        choice.batched = cand
        if mv.benchmark is not None:
            self.loader.explain(mv, choice.group, mv.benchmark)
        log.info("model=%s version=%s: batches of 2+ on %s again (remembered)", mv.name, mv.version, cand.label)

    def _winners(self, timings: Sequence[CandidateTiming], points: Sequence[WorkPoint], one_now: str,
                 many_now: str) -> tuple[str | None, str | None]:
        """The engine for batch-1 runs and the one for larger runs (None: no such points / nothing timed)."""
        if not timings:
            return None, None
        overall = choose(timings, self.settings.margin, incumbent=one_now).candidate
        classes = {True: [p for p in points if p.batch == 1], False: [p for p in points if p.batch > 1]}
        shares = {k: sum(p.weight for p in v) for k, v in classes.items()}
        if min(shares.values()) < SPLIT_SHARE:
            return overall, overall
        picks = {}
        for k, pts in classes.items():
            w = {p.label: p.weight for p in pts}
            scored = [replace(t, throughput_per_s=mix_score({p: t.points[p] for p in w if p in t.points}, w))
                      for t in timings]
            picks[k] = choose(scored, self.settings.margin, incumbent=one_now if k else many_now).candidate
        return picks[True], picks[False]


def _io_mismatch(mv: ModelVersion, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str | None:
    """Why another engine cannot replace the serving one unseen by clients, or None.

    Inputs must be the same (validation was planned on them). Outputs must have the same names and
    datatypes; their declared shapes may differ, since engines infer output dimensions differently
    from the same file (one says ``[1, -1]``, another ``[-1, 1, 8210]``) and answers carry their shapes.
    """
    if list(inputs) != list(mv.inputs):
        return "its inputs differ from the serving engine's"
    if [(t.name, t.datatype) for t in outputs] != [(t.name, t.datatype) for t in mv.outputs]:
        return "its outputs differ from the serving engine's (names or datatypes)"
    return None


def _first_due(choice: Choice, window: Sequence[Seen], runs: int, *, batched: bool, force: bool
               ) -> tuple[list[WorkPoint], str, str] | None:
    """A model not measured yet: on its declared shapes when it has them, else once traffic came."""
    if choice.state == "pending" and choice.boot_points:
        return choice.boot_points, "declared", "first choice, on the shapes the model declares"
    if runs >= MIN_RUNS or (force and runs):
        return traffic_points(window, batched), "traffic", "first choice, on the shapes served so far"
    choice.state = "waiting for traffic"
    return None


def _note_switch(mv: ModelVersion, choice: Choice, before: tuple[str, str | None], current: Candidate,
                 batched: Candidate | None, why: str) -> None:
    """Record a switch that took effect: the candidates serving now, and a line in the model's history."""
    mv.candidate = current
    choice.batched = batched
    if mv.stats is not None:
        mv.stats.backend = mv.candidate.backend
    to = current.label + (f" (batches of 2+: {batched.label})" if batched is not None else "")
    choice.switches.append({"from": before[0] + (f" (batches of 2+: {before[1]})" if before[1] else ""),
                            "to": to, "why": why, "at": round(time.time(), 1)})
    log.info("model=%s version=%s switched engine to %s (%s)", mv.name, mv.version, to, why)

def attach(mv: ModelVersion, loader: ModelLoader) -> Choice | None:
    """Give a READY version a Choice (and its engine a SwappableEngine) when there is a choice to make."""
    group = loader.choice_group(mv)
    if not group:
        return None
    choice = Choice(group, loader.proxy(mv), mv.selection_key)
    if mv.benchmark is not None:  # measured while loading, or remembered: chosen until traffic says otherwise
        choice.state = "chosen"
        if mv.benchmark.chosen_batched and mv.max_batch_size > 0:
            choice.restore = next((c for c in group if c.label == mv.benchmark.chosen_batched), None)
        choice.basis_mix = dict(mv.benchmark.workload)
        choice.last_measured = time.monotonic()
    else:
        choice.boot_points = boot_points(mv)
    mv.choice = choice
    return choice


def boot_points(mv: ModelVersion) -> list[WorkPoint]:
    """Work points from what the model declares (or its static dimensions); empty when they would be made up."""
    if synthesized(mv):
        return []
    try:
        sample = sample_inputs(mv)
    except (OSError, KeyError, ValueError):
        return []
    batched = mv.max_batch_size > 0
    if batched:
        sample = {n: a[:1] for n, a in sample.items()}
    return default_points(sample, batch_sizes_for(mv.manifest, mv.max_batch_size, mv.batching), batched)
