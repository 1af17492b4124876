"""TensorRT through an engine worker: for JetPack 5, whose TensorRT bindings exist for Python 3.8 only.

``worker.py`` runs under the device's system Python with only numpy and TensorRT and
speaks the shared-memory protocol (:mod:`edged.protocol.shm_wire`) on a socket pair;
``supervisor.py`` is the daemon's side: an :class:`~edged.backends.base.Engine` that
starts, health-checks and restarts it. docs/jetson.md has the design and its cost.
This package's ``__init__`` and ``worker.py`` must stay Python 3.8 compatible.
"""
