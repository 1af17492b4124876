"""One engine run for the floor servers: the bundled model in ONNX Runtime, set up as edged's generic
profile sets it up (CPU, default intra-op threads, one inter-op thread, every graph optimization, the pool's
spin after a run cut to [limits] engine_spin_us's default).

With it, a floor server answers each request after one run of the model on its own event loop, and
does nothing else: no decoding, no validation, no queue, no statistics. That is the least any server
on the same library can take for an inference on this machine, with the engine's threads and the
server's competing for the same cores as they do in edged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def session(model: Path, intra_threads: int = 0) -> Any:
    """An ONNX Runtime CPU session as the generic profile makes it; ``intra_threads`` 0 = the library's
    default (every core), more for an engine that shares the cores with others (bench/floor_procs.py)."""
    import onnxruntime as ort

    from edged.cpus import DEFAULT_SPIN_US

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_threads
    opts.inter_op_num_threads = 1
    # As edged sets it: ONNX Runtime's own spin (~24 ms after every run) would keep a core busy in this
    # process while the suite times edged in turns with it, and edged's in its turns.
    opts.add_session_config_entry("session.intra_op.spin_duration_us", str(DEFAULT_SPIN_US))
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])


def _warm(model: Path) -> tuple[Any, str, Any]:
    """A session, its input's name and a random input of its shape, the first run (which allocates) done."""
    import numpy as np

    sess = session(model)
    spec = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    sess.run(None, {spec.name: x})  # keep the first run's allocations out of the measurement
    return sess, spec.name, x


def engine_run(model: Path) -> Callable[[], None]:
    sess, name, x = _warm(model)
    feed = {name: x}

    def run() -> None:
        sess.run(None, feed)
    return run


def engine_call(model: Path) -> tuple[Callable[[Any], list[Any]], list[str]]:
    """A run on a given input array (its outputs) and the outputs' names: for a floor that must decode
    its input from the request, as a JSON server does."""
    sess, name, _ = _warm(model)
    names = [o.name for o in sess.get_outputs()]

    def run(x: Any) -> list[Any]:
        return list(sess.run(None, {name: x}))
    return run, names
