"""The service's façade methods that transports, telemetry, health and sync use instead of reaching into
core: the repository index, readiness, model control and a version loaded aside (the updater's check)."""

from __future__ import annotations

import shutil
from pathlib import Path

from edged.protocol.v2_models import index_response
from edged.repository.digests import DigestCache
from edged.repository.store import load_version
from tests.conftest import MODELS
from tests.device.pipeline.test_fanout import DIGITS_PIPELINE
from tests.in_process import served


def _repo(root: Path) -> Path:
    shutil.copytree(MODELS / "digits", root / "digits")
    (root / "top_digit" / "1").mkdir(parents=True)
    (root / "top_digit" / "1" / "pipeline.toml").write_text(DIGITS_PIPELINE)
    return root


def test_index_readiness_and_model_control(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    with served(repo) as service:
        assert service.ready()
        (repo / "spare" / "1").mkdir(parents=True)  # on disk, never loaded
        index = {(e["name"], e["version"]): e for e in index_response(service.repository_index(), False)}
        assert index[("digits", "1")]["state"] == "READY" and index[("top_digit", "1")]["state"] == "READY"
        assert index[("spare", "")] == {"name": "spare", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
        assert [e["name"] for e in index_response(service.repository_index(), True)] == ["digits", "top_digit"]

        service.unload("digits", by_operator=True)
        assert service.unloaded_by_operator("digits") and service.find("digits") is None
        assert not service.is_ready("digits")
        service.pin("digits", 1)
        assert service.version_policy("digits").specific == [1]
        [mv] = service.load("digits")
        assert mv.state.value == "ready" and service.is_ready("digits", 1)
        assert not service.unloaded_by_operator("digits")
        assert {s["name"] for s in service.statuses()} == {"digits", "top_digit"}


def test_try_load_checks_a_version_without_publishing_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    with served(repo) as service:
        serving = service.find("digits")
        model = service.try_load(load_version("digits", 1, repo / "digits" / "1", DigestCache(None)))
        assert model.reason is None and model.engine is not None and "onnxruntime" in model.engine
        assert service.find("digits") is serving and len(service.versions("digits")) == 1  # nothing published
        pipeline = service.try_load(load_version("top_digit", 1, repo / "top_digit" / "1", DigestCache(None)))
        assert pipeline == ("pipeline", None)
        (repo / "top_digit" / "1" / "model.toml").write_text("")  # a folder that is both: refused as such
        broken = service.try_load(load_version("top_digit", 1, repo / "top_digit" / "1", DigestCache(None)))
        assert broken.engine is None and broken.reason is not None and "both" in broken.reason
