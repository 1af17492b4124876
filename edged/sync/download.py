"""Fetch a release's files into its staging folder, resuming partial files, verifying each one.

A file gets its real name in the staging folder only after its size and sha256 match the
signed manifest; until then it is ``.parts/<sha256>``. A file whose digest is wrong is
deleted, so the next attempt starts it from zero.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edged.fsutil import fsync_dir, sha256_file
from edged.protocol.fleet.messages import API_PREFIX
from edged.protocol.fleet.release import ReleaseManifest
from edged.sync.capped_http import RegistryHttp, TransferError
from edged.sync.faults import fault_point
from edged.sync.repo import PARTS, file_ok

log = logging.getLogger(__name__)


@dataclass
class DownloadStats:
    files: int = 0
    bytes: int = 0
    resumed_files: int = 0
    reused_files: int = 0


def fetch_release(http: RegistryHttp, token: str, manifest: ReleaseManifest, staged: Path, *, chunk: int,
                  should_stop: Callable[[], bool]) -> DownloadStats:
    stats = DownloadStats()
    parts = staged / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    fault_point("download.start")
    for f in manifest.files:
        final = staged / f.path
        if file_ok(final, f):
            stats.reused_files += 1
            continue
        part = parts / f.sha256
        if part.exists() and part.stat().st_size:
            stats.resumed_files += 1
        got = http.download(f"{API_PREFIX}/blobs/{f.sha256}", token=token, dest=part, size=f.size,
                            etag=f'"{f.sha256}"', chunk=chunk, should_stop=should_stop,
                            on_chunk=lambda: fault_point("download.chunk"))
        stats.bytes += got
        digest = sha256_file(part)
        if digest != f.sha256:
            part.unlink()
            raise TransferError(f"{f.path}: sha256 is {digest[:12]}..., the release says {f.sha256[:12]}...")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        fsync_dir(final.parent)
        stats.files += 1
        fault_point("download.file")
    return stats
