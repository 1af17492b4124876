"""One engine run for the floor servers: the bundled model in ONNX Runtime, set up as edged's generic
profile sets it up (CPU, default intra-op threads, one inter-op thread, every graph optimization).

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

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])


def engine_run(model: Path) -> Callable[[], None]:
    import numpy as np

    sess = session(model)
    spec = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    feed = {spec.name: x}
    sess.run(None, feed)  # the first run allocates; keep it out of the measurement

    def run() -> None:
        sess.run(None, feed)
    return run


def engine_call(model: Path) -> tuple[str, Callable[[Any], list[Any]], list[str]]:
    """The model's input name, a run on a given input array (its outputs), and the outputs' names: for a
    floor that must decode its input from the request, as a JSON server does."""
    import numpy as np

    sess = session(model)
    spec = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]
    sess.run(None, {spec.name: np.zeros(shape, dtype=np.float32)})  # the first run allocates
    names = [o.name for o in sess.get_outputs()]

    def run(x: Any) -> list[Any]:
        return list(sess.run(None, {spec.name: x}))
    return spec.name, run, names
