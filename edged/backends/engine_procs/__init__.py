"""Engine instances in worker processes (issue 41): one interpreter's lock no longer caps the engine.

``worker.py`` is a process that loads one in-process engine (ONNX Runtime, OpenVINO) and serves it
over the shared-memory wire of the TensorRT engine worker; ``pool.py`` is the daemon's side: an
:class:`~edged.backends.base.Engine` over N such workers that the scheduler runs N batches at once on.
docs/benchmarks.md "Serving across processes" has the design, the alternatives and their cost.
"""
