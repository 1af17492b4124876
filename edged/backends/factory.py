"""Backend lookup by name, from :data:`~edged.backends.specs.SPECS`; each library is imported only when
its backend is used."""

from __future__ import annotations

import threading

from edged.backends.base import Backend
from edged.backends.specs import spec_for

_instances: dict[str, Backend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> Backend:
    """The one instance of backend ``name``; EngineUnavailableError for an unknown name or a missing module."""
    spec = spec_for(name)
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            backend = _instances[name] = spec.backend_class()()
        return backend
