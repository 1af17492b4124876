"""Input steps: encoded images and audio in a ``BYTES`` input to arrays; raw tensors through.

Sizes are checked before anything is allocated (image headers are read first, audio
lengths come from the WAV header and the configured maximum), and a library's
complaint about bad data becomes a StepInputError naming the input.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import Field

from edged.datatypes import DataType
from edged.membudget import charge
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import BuiltinStep, StepParams, as_bytes_list, opencv
from edged.pipeline.steps.headers import HeaderError, image_size
from edged.pipeline.steps.image import ResizeParams, resize_one, stack


class DecodeImageParams(StepParams):
    """``color``: channel order of the pixels; ``max_pixels``: the largest width x height taken;
    ``resize``: resize each image as it is decoded (images of one request may then differ in size);
    ``max_total_pixels``: all images of one request together, checked from their headers before any
    is decoded (a few KB of flat PNG can declare 100 MB of pixels: one request of many such images
    must not decode them all)."""

    color: Literal["RGB", "BGR"] = "RGB"
    max_pixels: int = Field(default=40_000_000, gt=0)
    max_total_pixels: int = Field(default=64_000_000, gt=0)
    max_images: int = Field(default=256, gt=0)
    resize: ResizeParams | None = None


class DecodeImage(BuiltinStep):
    """image BYTES [N] (JPEG, PNG, WebP) -> pixels UINT8 [N,H,W,3], sizes INT32 [N,2] (original
    height, width), transform FP32 [N,4] (see image.py)."""

    kind = "decode_image"
    Params = DecodeImageParams
    params: DecodeImageParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        opencv()  # a missing pipeline extra fails the load, explained, not the first request
        port = self.port(inputs, "image", ("BYTES",), rank=(1, 2))
        n = port.shape[0]
        h, w = self.params.resize.out_hw() if self.params.resize else (ANY, ANY)
        return {"pixels": Port("UINT8", (n, h, w, 3)), "sizes": Port("INT32", (n, 2)),
                "transform": Port("FP32", (n, 4))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        items = as_bytes_list(self.array(inputs, "image"), self.kind, "image")
        if len(items) > self.params.max_images:
            raise StepInputError(f"input 'image' holds {len(items)} images, more than {self.params.max_images}",
                                 input="image")
        cv2 = opencv()
        formats: list[str] = []
        total = largest = 0
        for i, data in enumerate(items):  # every header first: nothing is decoded for a request over budget
            try:
                fmt, width, height = image_size(data)
            except HeaderError as exc:
                raise StepInputError(f"input 'image'[{i}]: {exc}", input="image") from None
            if width == 0 or height == 0 or width * height > self.params.max_pixels:
                raise StepInputError(f"input 'image'[{i}]: a {width}x{height} {fmt.upper()} is over the "
                                     f"{self.params.max_pixels}-pixel limit or empty", input="image")
            total += width * height
            if total > self.params.max_total_pixels:
                raise StepInputError(f"input 'image': images 0-{i} declare {total} pixels together, over the "
                                     f"request's {self.params.max_total_pixels}-pixel limit", input="image")
            formats.append(fmt)
            largest = max(largest, width * height)
        # What this request will hold, against the daemon's budget for every request in progress: each
        # decoded image, the stacked batch, and one image's colour conversion at a time.
        charge(3 * (2 * total + largest), f"decoding {len(items)} image(s) of {total} pixels")
        images: list[np.ndarray] = []
        sizes = np.zeros((len(items), 2), dtype=np.int32)
        transforms = np.zeros((len(items), 4), dtype=np.float32)
        for i, (data, fmt) in enumerate(zip(items, formats, strict=True)):
            try:
                img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
            except cv2.error as exc:
                raise StepInputError(f"input 'image'[{i}]: cannot decode the {fmt.upper()}: "
                                     f"{str(exc).strip().splitlines()[-1]}", input="image") from None
            if img is None:
                raise StepInputError(f"input 'image'[{i}]: the {fmt.upper()} is corrupt or truncated",
                                     input="image")
            if img.shape[0] * img.shape[1] > self.params.max_pixels:  # the header lied about the size
                raise StepInputError(f"input 'image'[{i}]: decodes to {img.shape[1]}x{img.shape[0]}, over the "
                                     f"{self.params.max_pixels}-pixel limit", input="image")
            if self.params.color == "RGB":
                img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
            sizes[i] = img.shape[:2]
            transforms[i] = (1.0, 1.0, 0.0, 0.0)
            if self.params.resize is not None:
                img, transforms[i] = resize_one(img, self.params.resize, "image")
            images.append(img)
        return {"pixels": stack(images, self.kind, "image"), "sizes": sizes, "transform": transforms}


class DecodeAudioParams(StepParams):
    """``rate``: the sample rate the next step needs; ``resample``: ``refuse`` a different rate, or
    convert it by ``linear`` interpolation (no band-limiting: fine for speech models at rates
    within 2x, not for music). ``format``: a WAV file, or raw little-endian PCM at ``input_rate``
    with ``input_channels``. Channels are mixed down to mono by their mean."""

    rate: int = Field(gt=0, le=384_000)
    resample: Literal["refuse", "linear"] = "refuse"
    format: Literal["wav", "pcm_s16le", "pcm_f32le"] = "wav"
    input_rate: int | None = Field(default=None, gt=0, le=384_000)
    input_channels: int = Field(default=1, gt=0, le=32)
    max_seconds: float = Field(default=30.0, gt=0)
    max_total_seconds: float = Field(default=240.0, gt=0, description="all clips of one request together, each "
                                     "counted padded to the longest (the size of the samples output)")
    max_clips: int = Field(default=256, gt=0)


_WAV_FLOAT, _WAV_PCM, _WAV_EXTENSIBLE = 3, 1, 0xFFFE


def wav_layout(data: bytes) -> tuple[tuple[int, ...], memoryview]:
    """The fmt fields (tag, channels, rate, byte rate, block align, bits, sub-format) and the sample bytes
    (a view, nothing copied) of a WAV file; ValueError says why not."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos, fmt, body = 12, None, None
    view = memoryview(data)
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        chunk = view[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            if len(chunk) < 16:
                raise ValueError("WAV fmt chunk too short")
            fmt = struct.unpack("<HHIIHH", chunk[:16]) + ((struct.unpack("<H", chunk[24:26])[0],)
                                                          if len(chunk) >= 26 else (0,))
        elif cid == b"data":
            body = chunk  # a truncated last chunk keeps what arrived, as players do
            break
        pos += 8 + size + (size & 1)
    if fmt is None or body is None:
        raise ValueError("WAV without fmt and data chunks")
    return fmt, body


def wav_frames(data: bytes) -> tuple[int, int, int]:
    """(frames, channels, rate) from a WAV file's header, without decoding any sample."""
    (_, channels, rate, _, _, bits, _), body = wav_layout(data)
    if channels == 0 or rate == 0 or bits < 8:
        raise ValueError(f"WAV with {channels} channels at {rate} Hz, {bits} bits")
    return len(body) // ((bits // 8) * channels), channels, rate


def parse_wav(data: bytes) -> tuple[np.ndarray, int]:
    """(samples [T, channels] FP32 in [-1, 1], rate) of a PCM or float WAV file; ValueError says why not."""
    fmt, body = wav_layout(data)
    tag, channels, rate, _, _, bits, sub = fmt
    if tag == _WAV_EXTENSIBLE:
        tag = sub
    if channels == 0 or rate == 0:
        raise ValueError(f"WAV with {channels} channels at {rate} Hz")
    dtype: dict[tuple[int, int], str] = {(_WAV_PCM, 8): "u1", (_WAV_PCM, 16): "<i2", (_WAV_PCM, 32): "<i4",
                                         (_WAV_FLOAT, 32): "<f4", (_WAV_FLOAT, 64): "<f8"}
    if (tag, bits) == (_WAV_PCM, 24):
        frames = len(body) // (3 * channels)
        raw = np.frombuffer(body[:frames * 3 * channels], dtype=np.uint8).reshape(-1, 3)
        ints = (raw[:, 0].astype(np.int32) | raw[:, 1].astype(np.int32) << 8 | raw[:, 2].astype(np.int32) << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        return (ints.astype(np.float32) / (1 << 23)).reshape(frames, channels), rate
    if (tag, bits) not in dtype:
        raise ValueError(f"WAV sample format {tag} with {bits} bits is not supported (PCM 8/16/24/32, float 32/64)")
    width = bits // 8
    frames = len(body) // (width * channels)
    values = np.frombuffer(body[:frames * width * channels], dtype=dtype[(tag, bits)]).reshape(frames, channels)
    if tag == _WAV_FLOAT:
        return values.astype(np.float32), rate
    if bits == 8:
        return (values.astype(np.float32) - 128.0) / 128.0, rate
    return values.astype(np.float32) / float(1 << (bits - 1)), rate


def resample_linear(samples: np.ndarray, source: int, target: int) -> np.ndarray:
    """Mono samples at ``source`` Hz to ``target`` Hz by linear interpolation."""
    if source == target or len(samples) == 0:
        return samples
    n = max(1, round(len(samples) * target / source))
    positions = np.arange(n, dtype=np.float64) * (source / target)
    out: np.ndarray = np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)
    return out


class DecodeAudio(BuiltinStep):
    """audio BYTES [N] -> samples FP32 [N,T] (zero-padded to the longest), lengths INT32 [N]."""

    kind = "decode_audio"
    Params = DecodeAudioParams
    params: DecodeAudioParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "audio", ("BYTES",), rank=(1, 2))
        return {"samples": Port("FP32", (port.shape[0], ANY)), "lengths": Port("INT32", (port.shape[0],))}

    def _one(self, data: bytes, i: int) -> np.ndarray:
        p = self.params
        try:
            if p.format == "wav":
                frames, rate = parse_wav(data)
            else:
                rate = p.input_rate or p.rate
                dt = "<i2" if p.format == "pcm_s16le" else "<f4"
                width = np.dtype(dt).itemsize * p.input_channels
                if len(data) % width:
                    raise ValueError(f"{len(data)} bytes is not a whole number of {width}-byte frames")
                frames = np.frombuffer(data, dtype=dt).reshape(-1, p.input_channels).astype(np.float32)
                if p.format == "pcm_s16le":
                    frames /= 32768.0
        except ValueError as exc:
            raise StepInputError(f"input 'audio'[{i}]: {exc}", input="audio") from None
        seconds = len(frames) / rate
        if seconds > p.max_seconds:
            raise StepInputError(f"input 'audio'[{i}]: {seconds:.1f} s is longer than {p.max_seconds} s",
                                 input="audio")
        if rate != p.rate and p.resample == "refuse":
            raise StepInputError(f"input 'audio'[{i}]: sampled at {rate} Hz, the pipeline takes {p.rate} Hz",
                                 input="audio")
        mono = frames.mean(axis=1, dtype=np.float32) if frames.shape[1] > 1 else frames[:, 0]
        return resample_linear(mono, rate, p.rate)

    def _measure(self, data: bytes, i: int) -> tuple[int, int]:
        """(samples after resampling, samples as sent x channels) of one clip, from its header; the
        per-clip limits are checked here, before anything is decoded."""
        p = self.params
        try:
            if p.format == "wav":
                frames, channels, rate = wav_frames(data)
            else:
                rate, channels = p.input_rate or p.rate, p.input_channels
                frames = len(data) // ((2 if p.format == "pcm_s16le" else 4) * channels)
        except ValueError as exc:
            raise StepInputError(f"input 'audio'[{i}]: {exc}", input="audio") from None
        if frames / rate > p.max_seconds:
            raise StepInputError(f"input 'audio'[{i}]: {frames / rate:.1f} s is longer than {p.max_seconds} s",
                                 input="audio")
        if rate != p.rate and p.resample == "refuse":
            raise StepInputError(f"input 'audio'[{i}]: sampled at {rate} Hz, the pipeline takes {p.rate} Hz",
                                 input="audio")
        out = frames if rate == p.rate or frames == 0 else max(1, round(frames * p.rate / rate))
        return out, frames * channels

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        items = as_bytes_list(self.array(inputs, "audio"), self.kind, "audio")
        p = self.params
        if len(items) > p.max_clips:
            raise StepInputError(f"input 'audio' holds {len(items)} clips, more than {p.max_clips}", input="audio")
        # Every header first: the output is padded to the longest clip, so one long clip among many
        # one-sample ones costs as much as that many long clips; the padded size is the request's.
        sizes = [self._measure(d, i) for i, d in enumerate(items)]
        longest = max((n for n, _ in sizes), default=0)
        padded = longest * len(items)
        if padded > p.max_total_seconds * p.rate:
            raise StepInputError(f"input 'audio': {len(items)} clips padded to the longest ({longest / p.rate:.1f} s) "
                                 f"make {padded / p.rate:.1f} s, over the request's {p.max_total_seconds} s",
                                 input="audio")
        # The padded output, the clips decoded to it, and one clip's conversion (samples, mono, resampled).
        raw = max((m for _, m in sizes), default=0)
        charge(4 * (2 * padded + 3 * raw + longest), f"decoding {len(items)} audio clip(s) padded to {padded} samples")
        clips = [self._one(d, i) for i, d in enumerate(items)]
        lengths = np.array([len(c) for c in clips], dtype=np.int32)
        out = np.zeros((len(clips), int(lengths.max(initial=0))), dtype=np.float32)
        for i, c in enumerate(clips):
            out[i, :len(c)] = c
        return {"samples": out, "lengths": lengths}


class PassThroughParams(StepParams):
    datatype: DataType | None = None


class PassThrough(BuiltinStep):
    """tensor -> tensor unchanged (a raw tensor input, optionally held to one datatype)."""

    kind = "passthrough"
    Params = PassThroughParams
    params: PassThroughParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = inputs.get("tensor")
        if port is None:
            raise PipelineDefinitionError("step 'passthrough': input 'tensor' is not wired")
        if self.params.datatype and port.datatype != self.params.datatype:
            raise PipelineDefinitionError(f"step 'passthrough': input 'tensor' is {port.datatype}, "
                                          f"expected {self.params.datatype}")
        return {"tensor": port}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"tensor": self.array(inputs, "tensor")}


