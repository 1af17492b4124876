"""What a hostile or broken registry sends a device never grows the device's sync state.

Only a release that passed its signed checks, or a model the device already serves, gets a saved
entry; the desired state is bounded and its model names checked; what a poll changes without being
a step of an update is written once per poll, not once per entry.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from edged.protocol.fleet.messages import MAX_DESIRED, MAX_REASON, DesiredState
from edged.sync import state as state_module
from edged.sync.desired import DesiredStateError, DesiredStatePoller
from edged.sync.update.undo import KEEP_REFUSALS
from tests.polling import wait_until
from tests.registry_helpers import InProcessDevice, Keys, device_toml

DIGITS = Path(__file__).parents[2] / "models" / "digits"
GARBAGE = {"manifest": "eyJ4IjogMX0=", "signature": "AAAA", "key_id": "0000000000000000"}
NAMES_PER_POLL = 100


def _desired(models: list[dict[str, Any]] | None = None, revert: list[dict[str, Any]] | None = None) -> str:
    return json.dumps({"device_id": "dev-h", "models": models or [], "revert": revert or []})


class _Registry(http.server.BaseHTTPRequestHandler):
    """Enrolls anyone, takes every report, and answers each poll with new model names: reverts of twenty
    releases each, and releases whose signature verifies with no key. The served model ("digits") gets a
    revert of more releases than a device keeps, and a release that fails its checks, at every poll."""

    protocol_version = "HTTP/1.1"
    polls = 0
    reports = 0

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.endswith("/enroll"):
            self._send(b'{"device_id": "dev-h", "credential": "c"}')
            return
        if self.path.endswith("/reports"):
            type(self).reports += len(json.loads(body)["events"])
        self._send(b'{"accepted": 0}')

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(b'{"accepted": 0}')

    def do_GET(self) -> None:
        type(self).polls += 1
        tag = uuid.uuid4().hex[:8]
        names = [f"stranger-{tag}-{i}" for i in range(NAMES_PER_POLL)]
        models = [{"model": n, "version": 1, "release": 1, "signed": GARBAGE} for n in names]
        models.append({"model": "digits", "version": 9, "release": 5000, "signed": GARBAGE})
        revert = [{"model": n, "releases": list(range(1, 21)), "reason": "r"} for n in names]
        revert.append({"model": "digits", "releases": list(range(1, 101)), "reason": "halted"})
        self._send(_desired(models, revert).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def registry() -> Iterator[tuple[str, type[_Registry]]]:
    handler = type("Registry", (_Registry,), {"polls": 0, "reports": 0})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def test_a_hostile_registry_cannot_grow_the_state_nor_have_it_rewritten_per_entry(
        tmp_path: Path, registry: tuple[str, type[_Registry]], monkeypatch: pytest.MonkeyPatch) -> None:
    url, handler = registry
    writes: list[str] = []
    write = state_module.atomic_write_text

    def counted(path: Path, text: str, mode: int = 0o644) -> None:
        writes.append(path.name)
        write(path, text, mode=mode)

    monkeypatch.setattr(state_module, "atomic_write_text", counted)
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(DIGITS, repo / "digits")  # served from the repository: the one model with an entry
    cfg = device_toml(tmp_path, repo, url, [Keys.make(tmp_path).public], token="tok", device_id="dev-h", poll_s=0.05)
    dev = InProcessDevice(cfg).start()
    try:
        wait_until(lambda: handler.polls >= 10, 60, 0.05, "ten polls")
        ctx = dev.agent.updater.ctx
        with ctx.store.lock:
            models = dict(ctx.state.models)
            polls, saves = handler.polls, len(writes)
        assert list(models) == ["digits"]
        digits = models["digits"]
        assert len(digits.rejected) == KEEP_REFUSALS and 5000 in digits.refused
        assert len(ctx.strangers) <= 1024
        # One write for what a poll refused, one once its reports are sent (the first poll adopts "digits"
        # too); never one per entry, which was two per refused name and one per reverted name.
        assert saves <= 3 * polls + 5, (saves, polls)
        # the refusals still reach the registry (a wrong key on the device shows there)
        wait_until(lambda: handler.reports >= 5 * NAMES_PER_POLL, 30, 0.05, "the refusals reported")
    finally:
        dev.stop()
    state = state_module.StateStore(tmp_path / "state" / "sync").load()
    assert list(state.models) == ["digits"]


@pytest.mark.parametrize(("body", "why"), [
    (_desired(revert=[{"model": "../../../evil", "releases": [1]}]), "revert.0.model"),
    (_desired([{"model": "a/b", "version": 1, "release": 1, "signed": GARBAGE}]), "models.0.model"),
    (_desired(revert=[{"model": "m", "releases": list(range(MAX_DESIRED + 1))}]), "revert.0.releases"),
    (_desired(revert=[{"model": f"m{i}", "releases": [1]} for i in range(MAX_DESIRED + 1)]), "revert"),
    (_desired([{"model": f"m{i}", "version": 1, "release": 1, "signed": GARBAGE}
               for i in range(MAX_DESIRED + 1)]), "models"),
])
def test_a_desired_state_out_of_bounds_is_refused_whole(body: str, why: str) -> None:
    class Auth:
        def request(self, method: str, path: str, *, headers: Any = None) -> tuple[int, dict[str, str], bytes]:
            return 200, {"etag": '"x"'}, body.encode()

    poller = DesiredStatePoller(Auth(), "dev-h")  # type: ignore[arg-type]
    with pytest.raises(DesiredStateError, match=f"{why}: "):
        poller.poll()
    assert poller.last is None  # nothing of it is acted on


def test_what_a_desired_state_may_hold() -> None:
    ok = DesiredState.model_validate_json(_desired(revert=[
        {"model": "digits_v2.onnx-x", "releases": list(range(MAX_DESIRED)), "reason": "x" * (MAX_REASON * 4)}]))
    assert len(ok.revert[0].reason) == MAX_REASON  # informative only: cut, not refused
    with pytest.raises(ValidationError):
        DesiredState.model_validate_json(_desired(revert=[{"model": ".hidden", "releases": [1]}]))
