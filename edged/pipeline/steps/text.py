"""CTC greedy decoding for text recognition (PP-OCR rec and the like).

Per time step the best class; repeats collapse and the blank is dropped. The character
list is a file in the version folder, one character per line; class 0 is the blank and
class ``i`` is line ``i`` (PP-OCR's convention, which also appends a space: ``space = true``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import Field, model_validator

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import FLOATS, BuiltinStep, StepParams, read_labels
from edged.pipeline.steps.classify import bytes_array


class CTCParams(StepParams):
    """The characters come from a file of the version folder (``characters``) or from a model's own
    metadata (``characters_from = "model"``, the ``metadata_key`` entry, one character per line:
    PP-OCR rec models carry theirs as ``character``, which is what RapidOCR reads)."""

    characters: str | None = None
    characters_from: str | None = None
    metadata_key: str = "character"
    space: bool = True
    blank: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_source(self) -> CTCParams:
        if (self.characters is None) == (self.characters_from is None):
            raise ValueError("give exactly one of 'characters' (a file) or 'characters_from' (a model)")
        return self


class CTCDecode(BuiltinStep):
    """logits [N,T,C] (probabilities or logits) -> text BYTES [N] (UTF-8), confidence FP32 [N]
    (mean of the kept steps' best values; 0 for an empty text), json BYTES [N]."""

    kind = "ctc_decode"
    Params = CTCParams
    params: CTCParams

    def __init__(self, params: Any, folder: Path) -> None:
        super().__init__(params, folder)
        self.table: list[str] = []
        if self.params.characters is not None:
            self._set(read_labels(folder, self.params.characters, self.kind))

    def _set(self, chars: list[str]) -> None:
        if self.params.space:
            chars.append(" ")
        chars.insert(self.params.blank, "")
        self.table = chars

    def use_models(self, metadata: Callable[[str], Mapping[str, str]]) -> None:
        """Read the characters from the model named by ``characters_from`` (called by the graph at load)."""
        model = self.params.characters_from
        if model is None:
            return
        text = metadata(model).get(self.params.metadata_key)
        if not text:
            raise PipelineDefinitionError(f"step 'ctc_decode': model {model!r} has no {self.params.metadata_key!r} "
                                          "entry in its metadata")
        self._set(text.splitlines())

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "logits", FLOATS, rank=3)
        source = self.params.characters or f"{self.params.characters_from}'s {self.params.metadata_key}"
        if not self.table:
            raise PipelineDefinitionError(f"step 'ctc_decode': no characters from {source!r}")
        if port.shape[2] not in (ANY, len(self.table)):
            raise PipelineDefinitionError(f"step 'ctc_decode': input 'logits' has {port.shape[2]} classes, the "
                                          f"character list {source!r} gives {len(self.table)}")
        n = port.shape[0]
        return {"text": Port("BYTES", (n,)), "confidence": Port("FP32", (n,)), "json": Port("BYTES", (n,))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = self.array(inputs, "logits", ndim=3)
        if logits.shape[2] != len(self.table):
            raise StepInputError(f"step 'ctc_decode': input 'logits' has {logits.shape[2]} classes, expected "
                                 f"{len(self.table)}", input="logits")
        best = logits.argmax(axis=2)
        value = logits.max(axis=2)
        keep = best != self.params.blank
        keep[:, 1:] &= best[:, 1:] != best[:, :-1]
        texts, confs = [], np.zeros(len(logits), dtype=np.float32)
        for i in range(len(logits)):
            texts.append("".join(self.table[c] for c in best[i, keep[i]]))
            confs[i] = float(value[i, keep[i]].mean()) if keep[i].any() else 0.0
        docs = [orjson.dumps({"text": t, "confidence": float(c)}) for t, c in zip(texts, confs, strict=True)]
        return {"text": bytes_array([t.encode() for t in texts], (len(texts),)), "confidence": confs,
                "json": bytes_array(docs, (len(docs),))}
