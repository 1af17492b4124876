"""Code run in a fresh interpreter, for what an import or a call must not load into the process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable


def imported_by(code: str, modules: Iterable[str]) -> list[str]:
    """Which of ``modules`` are in ``sys.modules`` after ``code`` ran in a new interpreter (its own
    asserts fail the call)."""
    wanted = sorted(modules)
    check = f"{code}\nimport sys\nprint(' '.join(m for m in {wanted!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", check], check=True, timeout=60, capture_output=True, text=True)
    return out.stdout.split()
