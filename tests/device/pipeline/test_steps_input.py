"""Input and image steps against direct OpenCV/numpy computations on the same data."""

from __future__ import annotations

import io
import struct
import sys
import wave
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, Step, StepInputError
from edged.pipeline.steps import builtin_step

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")


def make_step(kind: str, params: dict[str, object] | None = None, folder: Path = Path(".")) -> Step:
    return builtin_step(kind)(params or {}, folder)


def photo(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def encoded(img_bgr: np.ndarray, ext: str, *params: int) -> bytes:
    ok, buf = cv2.imencode(ext, img_bgr, list(params))
    assert ok
    return bytes(buf)


def bytes_tensor(*items: bytes) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def test_unknown_kind_names_the_builtins() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"unknown step kind 'resise'.*resize"):
        builtin_step("resise")


def test_unknown_param_refused() -> None:
    with pytest.raises(ValueError, match="colour"):
        make_step("decode_image", {"colour": "RGB"})


@pytest.mark.parametrize("ext,params", [(".png", ()), (".webp", (cv2.IMWRITE_WEBP_QUALITY, 101))])
def test_lossless_decode_gives_back_the_pixels(ext: str, params: tuple[int, ...]) -> None:
    rgb = photo()
    step = make_step("decode_image", {"color": "RGB"})
    out = step.run({"image": bytes_tensor(encoded(rgb[:, :, ::-1], ext, *params))})
    np.testing.assert_array_equal(out["pixels"][0], rgb)
    np.testing.assert_array_equal(out["sizes"], [[48, 64]])
    np.testing.assert_array_equal(out["transform"], [[1, 1, 0, 0]])


def test_jpeg_decode_matches_opencv_and_colour_order() -> None:
    data = encoded(photo(), ".jpg")
    direct = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    bgr = make_step("decode_image", {"color": "BGR"}).run({"image": bytes_tensor(data, data)})
    rgb = make_step("decode_image", {"color": "RGB"}).run({"image": bytes_tensor(data)})
    np.testing.assert_array_equal(bgr["pixels"], np.stack([direct, direct]))
    np.testing.assert_array_equal(rgb["pixels"][0], direct[:, :, ::-1])


def test_decode_with_letterbox_mixes_sizes_and_maps_back() -> None:
    a, b = encoded(photo(48, 64), ".png"), encoded(photo(64, 32, seed=1), ".png")
    step = make_step("decode_image", {"color": "BGR", "resize": {"mode": "letterbox", "width": 32, "height": 32}})
    out = step.run({"image": bytes_tensor(a, b)})
    assert out["pixels"].shape == (2, 32, 32, 3)
    # first image: 64x48 -> 32x24, 4 rows of padding on top
    direct = cv2.resize(photo(48, 64), (32, 24), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_array_equal(out["pixels"][0, 4:28], direct)
    assert (out["pixels"][0, :4] == 114).all() and (out["pixels"][0, 28:] == 114).all()
    np.testing.assert_allclose(out["transform"][0], [0.5, 0.5, 0, 4])
    np.testing.assert_allclose(out["transform"][1], [0.5, 0.5, 8, 0])
    # the original corners land on the content's corners
    sx, sy, px, py = out["transform"][1]
    assert (63 * sy + py, 31 * sx + px) == (31.5, 23.5)


def test_mixed_sizes_without_resize_refused() -> None:
    a, b = encoded(photo(48, 64), ".png"), encoded(photo(64, 32), ".png")
    with pytest.raises(StepInputError, match="differ in size"):
        make_step("decode_image").run({"image": bytes_tensor(a, b)})


def huge_png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = zlib.compress(b"\0" * 1024)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat)))


def test_oversized_header_refused_before_decoding() -> None:
    step = make_step("decode_image", {"max_pixels": 10_000_000})
    with pytest.raises(StepInputError, match=r"'image'\[1\].*100000x100000 PNG.*limit") as err:
        step.run({"image": bytes_tensor(encoded(photo(), ".png"), huge_png(100_000, 100_000))})
    assert err.value.context["input"] == "image"


def test_many_images_over_the_request_budget_refused_before_any_is_decoded() -> None:
    """Each image is under max_pixels, together they are not: the budget is read from the headers, so a
    request of many small, flat PNGs declaring large sizes decodes nothing (huge_png's bodies are not even
    valid: decoding one would fail with a different error)."""
    step = make_step("decode_image", {"max_pixels": 10_000_000, "max_total_pixels": 25_000_000})
    flat = [huge_png(3000, 3000) for _ in range(3)]  # 9 MP each; 27 MP together
    with pytest.raises(StepInputError, match=r"images 0-2 declare 27000000 pixels together.*25000000") as err:
        step.run({"image": bytes_tensor(*flat)})
    assert err.value.context["input"] == "image"


@pytest.mark.parametrize("data,why", [
    (b"GIF89a....", "not a JPEG, PNG or WebP"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "without a frame header"),
    (b"", "not a JPEG"),
])
def test_bad_headers_refused(data: bytes, why: str) -> None:
    with pytest.raises(StepInputError, match=why):
        make_step("decode_image").run({"image": bytes_tensor(data)})


def test_corrupt_jpeg_body_is_an_input_error() -> None:
    good = encoded(photo(), ".jpg")
    sof = good.index(b"\xff\xc0")
    corrupt = good[:sof + 20] + b"\x00" * 16  # header intact, the scan cut off
    with pytest.raises(StepInputError, match=r"'image'\[0\].*JPEG"):
        make_step("decode_image").run({"image": bytes_tensor(corrupt)})
    # the same step serves the next request
    assert make_step("decode_image").run({"image": bytes_tensor(good)})["pixels"].shape == (1, 48, 64, 3)


@pytest.mark.parametrize("interp,flag", [("linear", "INTER_LINEAR"), ("area", "INTER_AREA"),
                                         ("lanczos", "INTER_LANCZOS4"), ("nearest", "INTER_NEAREST")])
def test_resize_stretch_matches_opencv(interp: str, flag: str) -> None:
    batch = np.stack([photo(seed=0), photo(seed=1)])
    out = make_step("resize", {"width": 40, "height": 30, "interpolation": interp}).run({"pixels": batch})
    for i in range(2):
        direct = cv2.resize(batch[i], (40, 30), interpolation=getattr(cv2, flag))
        np.testing.assert_array_equal(out["pixels"][i], direct)
    np.testing.assert_allclose(out["transform"], [[40 / 64, 30 / 48, 0, 0]] * 2)


def test_short_side_then_center_crop_composes_the_transform() -> None:
    img = photo(48, 64)[None]
    r = make_step("resize", {"mode": "short_side", "short": 24}).run({"pixels": img})
    assert r["pixels"].shape == (1, 24, 32, 3)
    c = make_step("crop", {"width": 24, "height": 24, "center": True}).run(r)
    np.testing.assert_array_equal(c["pixels"][0], r["pixels"][0, :, 4:28])
    np.testing.assert_allclose(c["transform"], [[0.5, 0.5, -4, 0]])
    with pytest.raises(StepInputError, match="does not fit"):
        make_step("crop", {"width": 99, "height": 10}).run(r)


def test_normalize_layout_colour_cast_match_numpy() -> None:
    batch = np.stack([photo(seed=2), photo(seed=3)])
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    n = make_step("normalize", {"mean": mean, "std": std}).run({"pixels": batch})
    expect = (batch.astype(np.float64) / 255.0 - np.array(mean)) / np.array(std)
    assert n["tensor"].dtype == np.float32
    np.testing.assert_allclose(n["tensor"], expect, rtol=0, atol=1e-5)
    chw = make_step("layout", {"target": "CHW"}).run(n)
    np.testing.assert_array_equal(chw["tensor"], n["tensor"].transpose(0, 3, 1, 2))
    back = make_step("layout", {"target": "HWC"}).run(chw)
    np.testing.assert_array_equal(back["tensor"], n["tensor"])
    swapped = make_step("color_order", {"source": "RGB", "target": "BGR"}).run({"pixels": batch})
    np.testing.assert_array_equal(swapped["pixels"], batch[..., ::-1])
    half = make_step("cast", {"datatype": "FP16"}).run(n)
    np.testing.assert_array_equal(half["tensor"], n["tensor"].astype(np.float16))


def test_bind_types_ports_and_refuses_miswiring() -> None:
    decode = make_step("decode_image", {"resize": {"width": 608, "height": 800}})
    ports = decode.bind({"image": Port("BYTES", (ANY,))})
    assert ports["pixels"] == Port("UINT8", (ANY, 800, 608, 3))
    norm = make_step("normalize").bind({"pixels": ports["pixels"]})
    assert make_step("layout").bind(norm)["tensor"] == Port("FP32", (ANY, 3, 800, 608))
    with pytest.raises(PipelineDefinitionError, match="'image' is FP32, expected BYTES"):
        decode.bind({"image": Port("FP32", (ANY,))})
    with pytest.raises(PipelineDefinitionError, match="input 'pixels' is not wired"):
        make_step("normalize").bind({"tensor": ports["pixels"]})


def wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def test_wav_decode_mixes_down_pads_and_checks_rate() -> None:
    rng = np.random.default_rng(4)
    stereo = rng.integers(-30000, 30000, (800, 2))
    mono = rng.integers(-30000, 30000, (500, 1))
    step = make_step("decode_audio", {"rate": 8000})
    out = step.run({"audio": bytes_tensor(wav(stereo, 8000), wav(mono, 8000))})
    np.testing.assert_array_equal(out["lengths"], [800, 500])
    np.testing.assert_allclose(out["samples"][0], stereo.mean(axis=1) / 32768.0, atol=1e-6)
    np.testing.assert_allclose(out["samples"][1, :500], mono[:, 0] / 32768.0, atol=1e-6)
    assert not out["samples"][1, 500:].any()
    with pytest.raises(StepInputError, match=r"'audio'\[0\]: sampled at 16000 Hz, the pipeline takes 8000"):
        step.run({"audio": bytes_tensor(wav(mono, 16000))})
    resampled = make_step("decode_audio", {"rate": 8000, "resample": "linear"}).run(
        {"audio": bytes_tensor(wav(mono, 16000))})
    expect = np.interp(np.arange(250) * 2.0, np.arange(500), mono[:, 0] / 32768.0)
    np.testing.assert_allclose(resampled["samples"][0], expect, atol=1e-6)


def test_audio_limits_and_garbage() -> None:
    step = make_step("decode_audio", {"rate": 8000, "max_seconds": 0.05})
    with pytest.raises(StepInputError, match=r"longer than 0\.05 s"):
        step.run({"audio": bytes_tensor(wav(np.zeros((800, 1)), 8000))})
    with pytest.raises(StepInputError, match="not a RIFF/WAVE"):
        step.run({"audio": bytes_tensor(b"ID3\x04garbage")})
    raw = make_step("decode_audio", {"rate": 8000, "format": "pcm_s16le"})
    pcm = np.arange(-5, 5, dtype="<i2")
    np.testing.assert_allclose(raw.run({"audio": bytes_tensor(pcm.tobytes())})["samples"][0], pcm / 32768.0)
    with pytest.raises(StepInputError, match="whole number"):
        raw.run({"audio": bytes_tensor(b"\x00\x01\x02")})


def test_missing_pipeline_extra_is_explained_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "cv2", None)  # what `import cv2` meets without the extra
    with pytest.raises(MissingDependencyError, match=r"edged\[pipeline\]"):
        make_step("decode_image").bind({"image": Port("BYTES", (ANY,))})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_images_are_input_errors_or_pixels(data: st.DataObject) -> None:
    """Cut, flipped or garbage bytes of real JPEG/PNG/WebP files: pixels or a StepInputError, nothing else."""
    ext = data.draw(st.sampled_from([".jpg", ".png", ".webp"]))
    good = encoded(photo(24, 32), ext)
    cut = data.draw(st.integers(0, len(good)))
    damaged = bytearray(good[:cut])
    for _ in range(data.draw(st.integers(0, 4))):
        if damaged:
            damaged[data.draw(st.integers(0, len(damaged) - 1))] = data.draw(st.integers(0, 255))
    step = make_step("decode_image", {"max_pixels": 4096})
    try:
        out = step.run({"image": bytes_tensor(bytes(damaged))})
    except StepInputError as exc:
        assert "'image'[0]" in str(exc)
    else:
        h, w = out["sizes"][0]
        assert out["pixels"].shape == (1, h, w, 3) and h * w <= 4096
