"""Raw media requests: an encoded image or sound sent as it is (no v2 envelope), answered as plain JSON.

A camera or microphone client publishes the JPEG/PNG/WebP/WAV bytes themselves (MQTT, the
shm socket, ``edged infer --input photo.jpg``). The bytes become the one element of the
model's (or pipeline's) single ``BYTES`` input, shape ``[1]``; the answer is one JSON object
with every output as plain JSON, ``BYTES`` elements that hold JSON documents (the steps'
``json`` outputs) embedded as JSON, other text as strings.

The media type comes from a declared content type (MQTT 5 Content Type or a
``Content-Type`` user property) or, when none is declared, from the payload's magic
bytes. A v2 request never starts with those bytes (JSON starts with ``{`` or whitespace,
the prefixed binary form with a zero byte), so sniffing cannot misread one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from edged.errors import InvalidInputError

CONTENT_TYPE_PROPERTY = "Content-Type"
MEDIA_TYPES = ("image/jpeg", "image/png", "image/webp", "audio/wav")
_ALIASES = {"image/jpg": "image/jpeg", "audio/x-wav": "audio/wav", "audio/wave": "audio/wav",
            "audio/vnd.wave": "audio/wav"}


def declared_media_type(content_type: str | None) -> str | None:
    """The media type a declared content type names; None for anything else (a v2 request)."""
    if not content_type:
        return None
    ct = content_type.split(";", 1)[0].strip().lower()
    ct = _ALIASES.get(ct, ct)
    return ct if ct in MEDIA_TYPES else None


def sniff_media_type(payload: bytes | bytearray | memoryview) -> str | None:
    head = bytes(payload[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "audio/wav"
    return None


def media_type(payload: bytes | bytearray | memoryview, content_type: str | None) -> str | None:
    """What raw media the payload is: the declared type, else the sniffed one; None: a v2 request."""
    return declared_media_type(content_type) or sniff_media_type(payload)


def media_input(model: str, inputs: Sequence[tuple[str, str]]) -> str:
    """The name of the one ``BYTES`` input that takes raw media; ``inputs`` are (name, datatype)."""
    names = [name for name, datatype in inputs if datatype == "BYTES"]
    if len(names) != 1 or len(inputs) != 1:
        raise InvalidInputError(f"{model!r} cannot take a raw image or sound: that needs exactly one input, "
                                f"of datatype BYTES (it has {[f'{n} {d}' for n, d in inputs]}); send a v2 request")
    return names[0]


def media_tensor(payload: bytes | bytearray | memoryview) -> np.ndarray:
    """The raw bytes as a ``BYTES`` tensor of shape ``[1]`` (no copy beyond one ``bytes``)."""
    if len(payload) == 0:
        raise InvalidInputError("the raw media payload is empty")
    out = np.empty(1, dtype=object)
    out[0] = bytes(payload)
    return out


def _element(value: Any) -> Any:
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
        if text[:1] in ("[", "{"):
            try:
                return json.loads(text)
            except ValueError:
                pass
        return text
    return value


def _plain(arr: Any) -> Any:
    if not isinstance(arr, np.ndarray):
        return _element(arr)
    if arr.dtype != object:
        return arr.tolist()
    if arr.ndim == 0:
        return _element(arr.item())
    return [_plain(row) for row in arr]


def answer(model: str, version: int, outputs: dict[str, np.ndarray], *, request_id: str | None = None,
           media: str | None = None) -> dict[str, Any]:
    """The plain-JSON answer to a raw media request (outputs keep their batch dimension of 1)."""
    body: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if request_id is not None:
        body["id"] = request_id
    if media is not None:
        body["content_type"] = media
    body["outputs"] = {name: _plain(arr) for name, arr in outputs.items()}
    return body
