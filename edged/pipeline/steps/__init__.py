"""Built-in pipeline steps, looked up by the ``kind`` a pipeline file names.

Each family lives in its own module and is imported only when a pipeline uses one of
its steps, so a daemon serving plain models never loads OpenCV.
"""

from __future__ import annotations

import importlib

from edged.pipeline.contract import PipelineDefinitionError, Step

# kind -> "module:Class" (modules under edged.pipeline.steps)
_BUILTIN: dict[str, str] = {
    "decode_image": "decode:DecodeImage",
    "decode_audio": "decode:DecodeAudio",
    "passthrough": "decode:PassThrough",
    "resize": "image:Resize",
    "crop": "image:Crop",
    "color_order": "image:ColorOrder",
    "normalize": "image:Normalize",
    "layout": "image:Layout",
    "cast": "image:Cast",
    "softmax": "classify:Softmax",
    "topk": "classify:TopK",
    "threshold": "classify:Threshold",
    "detect_decode": "detect:DetectDecode",
    "ctc_decode": "text:CTCDecode",
    "crop_boxes": "crop:CropBoxes",
    "db_decode": "ocr:DBDecode",
    "rotate_by_class": "ocr:RotateByClass",
    "collect": "ocr:Collect",
}


def builtin_kinds() -> list[str]:
    return sorted(_BUILTIN)


def builtin_step(kind: str) -> type[Step]:
    """The class of the built-in step ``kind``; PipelineDefinitionError names the known kinds otherwise."""
    target = _BUILTIN.get(kind)
    if target is None:
        raise PipelineDefinitionError(f"unknown step kind {kind!r}; built-in kinds: {', '.join(builtin_kinds())}")
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    cls: type[Step] = getattr(module, class_name)
    return cls
