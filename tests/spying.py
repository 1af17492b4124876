"""Watching which way real code went, without standing in for it."""

from __future__ import annotations

from typing import Any

import pytest


def results_of(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[Any]:
    """Wrap ``owner.name`` (a module's function, looked up there by its callers) so that each call still
    runs the real function; returned: the list its results are appended to, in call order."""
    real = getattr(owner, name)
    results: list[Any] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(owner, name, watched)
    return results
