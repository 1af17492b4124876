"""Issue #36 attacks 3-5: one request memory budget ([limits] memory_mb) for every transport and pipeline.

Against a real ``edged run`` with a small budget (64 MiB) so that the attacks stay small: while each
attack runs beside a well-behaved client (digits over HTTP, and a ``/v2/health/live`` probe), the
daemon's peak RSS (sampled, and the kernel's high-water mark reset at the start) stays within the
budget + the idle RSS + MARGIN, and within 50 MB of idle once the attack is over. The victim must be
answered all along (how fast is a figure for bench/attack_memory.py, not an assert here).

MARGIN covers what no reservation counts: the interpreter's and the allocator's own slack between
two trims, and the transports' socket buffers of connections being refused.
"""

from __future__ import annotations

import contextvars
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edged.errors import OverloadedError, ResourceExhaustedError
from edged.membudget import MIB, SMALL_REQUEST, MemoryBudget, charge, set_current
from tests import memory_attacks as ma
from tests.edged_process import QUICK_CHOICE_EDGED

pytest.importorskip("grpc", reason="the grpc extra is not installed")
pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")

pytestmark = pytest.mark.timeout(240)

BUDGET_MB = 64
MARGIN = 48 * MIB
RETURNED = 50 * MIB


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ma.MemDaemon]:
    with ma.daemon(tmp_path_factory.mktemp("membudget"), BUDGET_MB, edged=QUICK_CHOICE_EDGED) as d:
        yield d


def _under_attack(d: ma.MemDaemon, attack: Callable[[], list[object]]) -> tuple[Counter[object], int, int, ma.Victim]:
    """(answers, peak RSS over idle, RSS over idle once settled, the victim)."""
    idle = ma.idle_rss(d)
    with ma.RssMonitor(d.proc.pid) as mon, ma.Victim(d.port) as victim:
        answers = Counter(attack())
    after = ma.settle(d, idle + RETURNED // 2, within=15)
    return answers, mon.peak - idle, after - idle, victim


def _check(d: ma.MemDaemon, answers: Counter[object], peak: int, after: int, victim: ma.Victim) -> None:
    what = f"answers {dict(answers)}, peak +{peak / MIB:.0f} MiB, after +{after / MIB:.0f} MiB"
    assert peak <= BUDGET_MB * MIB + MARGIN, what
    assert after <= RETURNED, what
    assert victim.answered > 0 and victim.health, what
    assert not [f for f in victim.failed if "health" in f], victim.failed[:3]
    assert d.proc.poll() is None, d.log.read_text()[-2000:]


def test_audio_padding_bomb_is_refused_from_the_headers(small: ma.MemDaemon) -> None:
    """Attack 3: a 30 s clip and 300 one-sample clips (a 1 MB request) would pad to 550 MiB."""
    answers, peak, after, victim = _under_attack(small, lambda: list(ma.audio_bomb(small, 300)))
    _check(small, answers, peak, after, victim)
    assert answers == Counter({400: 1})


def test_audio_within_its_request_limit_many_at_once_is_held_to_the_budget(small: ma.MemDaemon) -> None:
    """Attack 3, concurrent: requests each within max_total_seconds, together over the budget."""
    answers, peak, after, victim = _under_attack(small, lambda: list(ma.audio_bomb(small, 6, concurrency=16)))
    _check(small, answers, peak, after, victim)
    assert set(answers) <= {200, 503} and answers[200] >= 1, answers


def test_concurrent_images_within_the_pixel_limit_are_held_to_the_budget(small: ma.MemDaemon) -> None:
    """Attack 4: 12 requests at once of two flat 1600x1600 PNGs (15 MiB of pixels each request, 37 MiB
    reserved: decoded, stacked and one conversion)."""
    answers, peak, after, victim = _under_attack(small, lambda: list(ma.image_flood(small, 1600, 2, 12)))
    _check(small, answers, peak, after, victim)
    assert set(answers) <= {200, 503} and answers[200] >= 1 and answers[503] >= 1, answers


def test_concurrent_large_grpc_messages_are_held_to_the_budget(small: ma.MemDaemon) -> None:
    """Attack 5: 24 ModelInfer messages of 1.7 MiB at once (the capped max is 7/8 of 64 MiB / 32: 1.75 MiB);
    the calls beyond what the budget holds wait their turn for room, none is refused for it."""
    answers, peak, after, victim = _under_attack(small, lambda: list(ma.grpc_flood(small, 1.7, 24)))
    _check(small, answers, peak, after, victim)
    assert set(answers) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, answers


def test_grpc_message_over_the_budget_cap_is_refused(small: ma.MemDaemon) -> None:
    assert ma.grpc_infer(small.grpc_port, 8 * MIB) == "RESOURCE_EXHAUSTED"
    assert ma.grpc_infer(small.grpc_port, 1024) == "OK"


def test_concurrent_large_http_bodies_are_held_to_the_budget(small: ma.MemDaemon) -> None:
    """Attack 5 over HTTP: 16 bodies of 16 MiB at once; refused ones get a 503 (not a reset)."""
    answers, peak, after, victim = _under_attack(small, lambda: list(ma.http_flood(small, 16, 16)))
    _check(small, answers, peak, after, victim)
    assert set(answers) <= {400, 503} and answers[503] >= 1, answers
    metrics = _metrics(small.port)
    assert metrics["edged_request_memory_limit_bytes"] == BUDGET_MB * MIB
    assert metrics["edged_request_memory_refused_total"] >= answers[503]
    assert metrics["edged_request_memory_used_bytes"] == 0  # every reservation was given back


def test_chunked_body_is_admitted_as_it_grows(small: ma.MemDaemon) -> None:
    """No Content-Length: the reservation grows with the body, and it is refused when it cannot."""
    def send(mib: int) -> int:
        chunk = bytes(MIB)
        return ma.post(small.port, "/v2/models/digits/infer", (chunk for _ in range(mib)),
                       {"Content-Type": "application/json"}, timeout=60, chunked=True)

    assert send(40) == 507  # twice 40 MiB can never fit 7/8 of 64 MiB
    assert send(1) == 400  # fits; not JSON
    assert _metrics(small.port)["edged_request_memory_used_bytes"] == 0


def _metrics(port: int) -> dict[str, float]:
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("edged_request_memory_")}


# ---- the budget itself ---------------------------------------------------------------------------
def test_reservations_refuse_at_once_and_release_once() -> None:
    b = MemoryBudget(64 * MIB)
    big = b.reserve(40 * MIB, "first")
    with pytest.raises(OverloadedError, match="budget is full"):
        b.reserve(20 * MIB, "second")
    with pytest.raises(ResourceExhaustedError, match="more than any request may hold"):
        b.reserve(60 * MIB, "too big")
    # what is refused is named in the error, formatted only then; a name without arguments is taken as is
    with pytest.raises(OverloadedError, match=r"^a 12345-byte body needs 20\.0 MiB"):
        b.reserve(20 * MIB, "a %d-byte body", 12345)
    with pytest.raises(OverloadedError, match=r"^100% of a body needs"):
        b.reserve(20 * MIB, "100% of a body")
    small_ones = [b.reserve(SMALL_REQUEST, "small") for _ in range(4)]  # the small requests' share
    assert b.used == 40 * MIB + 4 * SMALL_REQUEST
    big.release()
    big.release()
    for r in small_ones:
        r.release()
    assert b.used == 0 and b.refused == 4
    with b.reserve(30 * MIB, "again") as r:
        r.shrink(MIB)
        assert b.used == MIB
    assert b.used == 0


def test_a_step_charges_the_request_it_runs_for_in_worker_threads() -> None:
    b = MemoryBudget(8 * MIB)
    res = b.reserve(0, "pipeline")
    set_current(res)
    try:
        seen: list[BaseException] = []

        def step() -> None:
            try:
                charge(7 * MIB, "decoded audio")
            except BaseException as e:  # pragma: no cover - the assert below says what
                seen.append(e)
        t = threading.Thread(target=contextvars.copy_context().run, args=(step,))
        t.start()
        t.join()
        assert not seen and b.used == 7 * MIB
    finally:
        set_current(None)
        res.release()
    charge(100 * MIB, "outside any request")  # nothing to charge: no error
    assert b.used == 0


def test_config_limits_section(tmp_path: Path) -> None:
    from edged.config import parse_config
    from edged.errors import ConfigError
    assert parse_config("[limits]\nmemory_mb = 128\n").limits.memory_mb == 128
    assert parse_config("").limits.memory_mb == 0
    with pytest.raises(ConfigError, match=r"limits\.nope: unknown key"):
        parse_config("[limits]\nnope = 1\n")


# ---- full size (as filed), long: `pytest -m slow` --------------------------------------------------
FULL_BUDGET_MB = 256


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["audio", "images", "grpc", "http"])
def test_full_size_attacks_are_held_to_the_budget(tmp_path: Path, attack: str) -> None:
    """The attacks at the sizes they were filed with, against a 256 MiB budget."""
    runs: dict[str, Callable[[ma.MemDaemon], list[object]]] = {
        "audio": lambda d: list(ma.audio_bomb(d, 400, concurrency=4)),
        "images": lambda d: list(ma.image_flood(d, 5600, 2, 12)),
        "grpc": lambda d: list(ma.grpc_flood(d, 6.9, 16)),  # the largest the budget admits: 7/8 of 256 MiB / 32
        "http": lambda d: list(ma.http_flood(d, 60, 16)),
    }
    with ma.daemon(tmp_path, FULL_BUDGET_MB) as d:
        answers, peak, after, victim = _under_attack(d, lambda: runs[attack](d))
        what = f"answers {dict(answers)}, peak +{peak / MIB:.0f} MiB, after +{after / MIB:.0f} MiB"
        assert peak <= FULL_BUDGET_MB * MIB + MARGIN, what
        assert after <= RETURNED, what
        assert victim.answered > 0 and d.proc.poll() is None, what


# ---- the decoders' own accounting (in process) -----------------------------------------------------
def _bytes_tensor(*items: bytes) -> object:
    import numpy as np
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def test_audio_padded_size_is_checked_from_the_headers_before_decoding() -> None:
    from edged.pipeline.contract import StepInputError
    from edged.pipeline.steps import builtin_step
    step = builtin_step("decode_audio")({"rate": 16000, "max_total_seconds": 60}, Path("."))
    long, short = ma.wav(16000 * 20), ma.wav(1)
    assert step.run({"audio": _bytes_tensor(long, short, short)})["samples"].shape == (3, 16000 * 20)
    with pytest.raises(StepInputError, match=r"4 clips padded to the longest \(20\.0 s\) make 80\.0 s"):
        step.run({"audio": _bytes_tensor(long, short, short, short)})
    too_many = builtin_step("decode_audio")({"rate": 16000, "max_clips": 2}, Path("."))
    with pytest.raises(StepInputError, match="3 clips, more than 2"):
        too_many.run({"audio": _bytes_tensor(short, short, short)})
    # A header that claims more than the file holds is counted by the bytes present, not the claim.
    lying = bytearray(ma.wav(100))
    lying[40:44] = (1 << 31).to_bytes(4, "little")
    assert step.run({"audio": _bytes_tensor(bytes(lying))})["lengths"].tolist() == [100]


def test_decoders_reserve_what_they_will_hold_before_decoding() -> None:
    from edged.pipeline.steps import builtin_step
    audio = builtin_step("decode_audio")({"rate": 16000}, Path("."))
    image = builtin_step("decode_image")({}, Path("."))
    b = MemoryBudget(16 * MIB)
    other = b.reserve(10 * MIB, "someone else's request")
    res = b.reserve(0, "pipeline")
    set_current(res)
    try:
        with pytest.raises(OverloadedError, match="decoding 4 audio clip"):  # 4 x 10 s padded: 7.3 MiB
            audio.run({"audio": _bytes_tensor(ma.wav(160000), ma.wav(1), ma.wav(1), ma.wav(1))})
        with pytest.raises(OverloadedError, match="decoding 2 image"):
            image.run({"image": _bytes_tensor(ma.flat_png(600, 600), ma.flat_png(600, 600))})
        assert image.run({"image": _bytes_tensor(ma.flat_png(300, 300))})["sizes"].tolist() == [[300, 300]]
        assert res.held == 3 * (2 * 90_000 + 90_000)
    finally:
        set_current(None)
        res.release()
        other.release()
    assert b.used == 0


def test_mqtt_payload_over_the_budget_gets_an_error_reply_and_the_next_is_answered(tmp_path: Path) -> None:
    """MQTT: a payload is reserved before it is decoded (16 MiB budget: at most 14 MiB a request)."""
    import orjson

    from edged.protocol import mqtt as codec
    from tests.mqtt_helpers import TestClient, digits_json, running_broker

    reply_to = "edged/mem-attack/reply/t"  # inside the device's own reply namespace
    with running_broker(tmp_path / "broker") as broker, \
            ma.daemon(tmp_path / "d", 16, mqtt_url=broker.url, settled=False) as d:  # no RSS figure read here
        client = TestClient(broker.port).wait_connected()
        try:
            client.subscribe(reply_to)
            rows = 8 * MIB // 256
            header = orjson.dumps({"id": "big", "reply_to": reply_to, "inputs": [
                {"name": "pixels", "datatype": "FP32", "shape": [rows, 64],
                 "parameters": {"binary_data_size": rows * 256}}]})
            client.publish("edged/mem-attack/infer/digits", codec.PREFIX.pack(len(header)) + header
                           + bytes(rows * 256), qos=1)
            _, head, _ = codec.split(client.get(timeout=20).payload, None)
            reply = orjson.loads(head)
            assert reply["id"] == "big" and reply["code"] == "resource_exhausted", reply
            assert "memory budget" in reply["error"], reply
            assert re.search(r"a \d{7,}-byte MQTT request needs", reply["error"]), reply
            client.publish("edged/mem-attack/infer/digits", digits_json("small", reply_to), qos=1)
            answer = orjson.loads(client.get(timeout=20).payload)
            assert answer["id"] == "small" and "outputs" in answer, answer
            assert d.proc.poll() is None
        finally:
            client.close()
