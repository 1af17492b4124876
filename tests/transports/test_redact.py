"""Internal paths never reach clients: a model that failed to load, seen over every transport.

ONNX Runtime's load error names the file ("Load model from /.../model.onnx failed"); that
reason is in the model's status and metadata. HTTP, MQTT and shared memory all answer with
the daemon's directories replaced by ``<internal>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.client.http import HttpClient
from edged.client.shm import ShmClient
from edged.config import Config, parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.transports.http.transport import HttpTransport
from edged.transports.mqtt.transport import MqttTransport
from edged.transports.redact import Scrubber
from edged.transports.shm.transport import ShmTransport
from tests.conftest import MODELS
from tests.mqtt_helpers import Broker, TestClient

ORT = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


def test_scrubber_replaces_the_longest_root_first() -> None:
    s = Scrubber([Path("/var/lib/edged"), Path("/var/lib/edged/models"), None, Path("/")])
    assert s.text("open /var/lib/edged/models/x/1/model.onnx") == "open <internal>/x/1/model.onnx"
    assert s.text("/var/lib/edged/cache") == "<internal>/cache"
    assert s.data(b'{"reason":"/var/lib/edged/models/a"}') == b'{"reason":"<internal>/a"}'
    assert Scrubber().text("/etc/passwd") == "/etc/passwd"  # nothing configured: nothing replaced


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Config, InferenceService, Path]]:
    """digits, plus a 'broken' model whose ONNX file is garbage (its digest matches, so it gets to ORT)."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    shutil.copytree(MODELS / "digits", repo / "broken")
    onnx = repo / "broken" / "1" / "model.onnx"
    old = hashlib.sha256(onnx.read_bytes()).hexdigest()
    onnx.write_bytes(b"this is not an ONNX model")
    toml = repo / "broken" / "1" / "model.toml"
    toml.write_text(toml.read_text().replace(old, hashlib.sha256(onnx.read_bytes()).hexdigest()))
    broker = Broker(tmp_path / "broker").start()
    cfg = parse_config(textwrap.dedent(f"""
        [device]
        id = "dev"
        state_dir = "{tmp_path / 'state'}"
        runtime_dir = "{tmp_path / 'run'}"
        model_repository = "{repo}"
        [http]
        listen = "127.0.0.1:0"
        [mqtt]
        url = "{broker.url}"
        """))
    mgr = ModelManager(repo, cfg.models, ORT)
    mgr.load_all()
    try:
        yield cfg, InferenceService(mgr), repo
    finally:
        mgr.shutdown()
        broker.stop()


def _clean(text: str, repo: Path) -> None:
    assert str(repo) not in text and "/tmp/" not in text, text
    assert "<internal>" in text, text


def test_no_transport_shows_internal_paths(daemon: tuple[Config, InferenceService, Path]) -> None:
    cfg, svc, repo = daemon
    reason = svc.model("broken").reason or ""
    assert str(repo) in reason  # the engine's own message names the file
    loop = asyncio.new_event_loop()  # the HTTP server runs on it, in a thread of its own
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    http, shm, mqtt = HttpTransport(cfg, svc), ShmTransport(cfg, svc), MqttTransport(cfg, svc, "test")
    transports = [http, shm, mqtt]
    try:
        for t in transports:
            asyncio.run_coroutine_threadsafe(t.start(), loop).result(30)
        # HTTP: the repository index and the model's metadata
        with HttpClient(http.address) as c:
            _clean(c.request("POST", "/v2/repository/index", [b"{}"]).body.decode(), repo)
            _clean(c.request("GET", "/v2/models/broken").body.decode(), repo)
        # shared memory: METADATA
        with ShmClient(cfg.shm_socket) as s:
            _clean(json.dumps(s.metadata("broken")), repo)
        # MQTT: the retained model status
        assert mqtt.wait_ready(10)
        sub = TestClient(int(cfg.mqtt.url.rpartition(":")[2])).wait_connected()
        try:
            sub.subscribe("edged/dev/models/broken/status")
            msg = sub.get(10, where=lambda m: bool(m.payload))
            doc = json.loads(msg.payload)
            assert doc["state"] != "ready"
            _clean(msg.payload.decode(), repo)
        finally:
            sub.close()
    finally:
        for t in reversed(transports):
            asyncio.run_coroutine_threadsafe(t.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
