"""First start of a packaged device: copy the bundled models into the writable repository.

The package ships models read-only (``/usr/share/edged/models``, under ``ProtectSystem=strict``
nothing there can change); registry updates stage, install and remove versions in the
repository, so the daemon serves a copy under its state dir. The copy appears with one
rename (:func:`edged.fsutil.publish_dir`): a crash or power loss mid-copy leaves either no
repository (the next start copies again) or a complete one, never half of it. An existing
repository is never touched: after the first start it belongs to the device and its updates.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from edged.fsutil import publish_dir

log = logging.getLogger(__name__)


def serving_repository(repo: Path, seed: Path | None) -> Path:
    """Where to read models from: the repository, or before the daemon's first start the seed (read only).

    Commands other than the daemon (``edged infer`` in process, ``edged models list``) never
    create the repository: made by root, the daemon's user could not update it later.
    """
    if seed is not None and not repo.exists() and seed.is_dir():
        return seed
    return repo


def seed_repository(repo: Path, seed: Path | None) -> bool:
    """Copy ``seed`` to ``repo`` when ``repo`` does not exist yet; True when it did so."""
    if seed is None or repo.exists() or not seed.is_dir():
        return False
    repo.parent.mkdir(parents=True, exist_ok=True)
    tmp = repo.parent / f".{repo.name}.seeding"
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier start died while copying
    shutil.copytree(seed, tmp, symlinks=False, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    publish_dir(tmp, repo)
    log.info("model repository %s created from the bundled models in %s", repo, seed)
    return True
