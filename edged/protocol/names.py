"""Names both wings check alike: a model's name and the files that make a version folder a model or a
pipeline. A leaf of the contract, so that the fleet messages (protocol.fleet) and the repository
(repository.manifest) read one definition without protocol importing the repository."""

from __future__ import annotations

import re

MANIFEST_NAME = "model.toml"
PIPELINE_NAME = "pipeline.toml"  # a version folder holds one of the two: a model or a pipeline (edged.pipeline)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def valid_model_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))
