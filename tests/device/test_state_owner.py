"""Issue #20 item 5 as the attack: more ``edged run`` on a state folder a running daemon owns.

Each refused duplicate used to count as a crash in the trial's crash-loop counter and rewrite a stale
copy of the state file; three of them rolled a healthy release back. Now the owner's lock comes first.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from edged.config import load_config
from edged.owner import LOCK_FILE, StateOwnedError, claim_state_dir
from edged.protocol.fleet.release import SignedRelease
from edged.sync.settings import SyncSettings
from edged.sync.state import STATE_FILE, ModelSync, Pending, StateStore, SyncState, VersionRef
from tests.conftest import EDGED, REPO_ROOT
from tests.http_client import web
from tests.http_helpers import copy_models
from tests.netutil import free_port
from tests.registry_helpers import Keys, device_toml, wait_for

pytestmark = pytest.mark.timeout(180)


def test_duplicate_starts_change_nothing_in_the_owners_state(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "digits")
    port = free_port()
    dead = free_port()  # nothing listens: the registry is unreachable, the owner keeps its trial
    cfg_path = device_toml(tmp_path, repo, f"http://127.0.0.1:{dead}", [Keys.make(tmp_path).public], token=None,
                           http_port=port, poll_s=3600)
    settings = SyncSettings.from_config(load_config(cfg_path))
    signed = SignedRelease(manifest="e30=", signature="", key_id="")
    # Version 1 is on trial (release 2) over a committed version 1 from release 1: what the owner serves.
    StateStore(settings.sync_dir).save(SyncState(models={"digits": ModelSync(
        current=VersionRef(version=1, release=1), lkg=VersionRef(version=1, release=1),
        pending=Pending(release=2, version=1, step="trial", signed=signed))}))
    state_file = settings.sync_dir / STATE_FILE
    log = tmp_path / "owner.log"
    with log.open("wb") as out:
        owner = subprocess.Popen([*EDGED, "run", "--config", str(cfg_path)], stdout=out, stderr=subprocess.STDOUT,
                                 cwd=REPO_ROOT)
    try:
        def live() -> bool:
            assert owner.poll() is None, log.read_text()[-3000:]
            try:
                return web().get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(live, 90, 0.1, "the owning daemon's HTTP endpoint")
        pending = StateStore(settings.sync_dir).load().models["digits"].pending
        assert pending is not None and len(pending.starts) == 1  # the owner's own start was counted
        before = state_file.read_bytes()
        before_stat = state_file.stat()
        for _ in range(3):  # the three: enough to roll the trial back when each counts
            t0 = time.monotonic()
            dup = subprocess.run([*EDGED, "run", "--config", str(cfg_path)], capture_output=True, text=True,
                                 timeout=60, cwd=REPO_ROOT, check=False)
            assert dup.returncode != 0
            assert "already owns the device state" in dup.stderr and f"pid {owner.pid}" in dup.stderr, dup.stderr
            assert time.monotonic() - t0 < 30
            assert state_file.read_bytes() == before
        after = state_file.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before_stat.st_ino, before_stat.st_mtime_ns)  # not rewritten
        pending = StateStore(settings.sync_dir).load().models["digits"].pending
        assert pending is not None and pending.step == "trial" and len(pending.starts) == 1
        assert owner.poll() is None and live()
    finally:
        owner.terminate()
        owner.wait(30)
    # The owner gone (however it went), the folder can be owned again.
    claim_state_dir(settings.state_dir).close()


def test_lock_is_released_with_its_holder_and_names_it(tmp_path: Path) -> None:
    first = claim_state_dir(tmp_path / "state")
    try:
        # Another process (not another descriptor of ours: flock is per open file) is refused.
        probe = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; from edged.owner import claim_state_dir\n"
                   "try:\n    claim_state_dir(Path(sys.argv[1]))\nexcept Exception as e:\n    print(e); sys.exit(3)",
             str(tmp_path / "state")], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, check=False)
        assert probe.returncode == 3 and "already owns" in probe.stdout, probe
        with pytest.raises(StateOwnedError):
            claim_state_dir(tmp_path / "state")
        assert (tmp_path / "state" / LOCK_FILE).read_text().strip().isdigit()
    finally:
        first.close()
    claim_state_dir(tmp_path / "state").close()
