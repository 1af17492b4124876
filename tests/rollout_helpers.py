"""Helpers for the rollout tests: devices that speak the registry's device API over HTTP, and telemetry."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from edged.protocol.fleet.telemetry import INGEST_PATH
from tests.http_client import web

SHED_RETRY_S = 0.2  # a test device comes back sooner than Retry-After says: a fleet's worth of load it is not


def send_as_a_device(method: str, url: str, headers: dict[str, str], body: dict[str, Any] | None = None,
                     timeout: float = 30.0) -> httpx.Response:
    """A device write, sent again while the registry sheds it (503 ``overloaded``, registry/shed.py), as a
    device keeps what it wanted to send and comes back: the registry sheds device writes whenever its
    loop runs late, which a busy 2-core test machine does now and then in tests that are about rollouts."""
    deadline = time.monotonic() + timeout
    while True:
        r = web().request(method, url, headers=headers, json=body)
        if r.status_code != 503 or b'"overloaded"' not in r.content or time.monotonic() > deadline:
            return r
        time.sleep(SHED_RETRY_S)


class ApiDevice:
    """An enrolled device driven by the test: polls, reports steps, uploads telemetry (no engine)."""

    def __init__(self, url: str, device_id: str, credential: str) -> None:
        self.url, self.id, self.credential = url, device_id, credential
        self.seq = 0
        self.run = uuid.uuid4().hex[:12]
        self.tseq = 0

    @classmethod
    def enroll(cls, url: str, token: str, device_id: str, labels: dict[str, str] | None = None,
               facts: dict[str, Any] | None = None) -> ApiDevice:
        r = web().post(f"{url}/api/v1/enroll", json={"token": token, "device_id": device_id,
                                                     "labels": labels or {}, "facts": facts or {}})
        assert r.status_code == 200, r.text
        return cls(url, device_id, str(r.json()["credential"]))

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credential}"}

    def poll(self, etag: str | None = None) -> httpx.Response:
        h = dict(self.auth)
        if etag:
            h["If-None-Match"] = etag
        return web().get(f"{self.url}/api/v1/device/desired-state", headers=h)

    def desired(self) -> dict[str, Any]:
        r = self.poll()
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def release(self, model: str) -> int | None:
        return next((m["release"] for m in self.desired()["models"] if m["model"] == model), None)

    def reverts(self, model: str) -> list[int]:
        return next((list(v["releases"]) for v in self.desired()["revert"] if v["model"] == model), [])

    def report(  # noqa: PLR0913  one argument per field of the report event a test forges
            self, model: str, step: str, release: int, version: int | None = None,
               reason: str | None = None, *, quality: dict[str, Any] | None = None, logs: list[str] | None = None,
               expect: int = 200) -> httpx.Response:
        self.seq += 1
        event: dict[str, Any] = {"seq": self.seq, "model": model, "step": step, "version": version,
                                 "release": release, "reason": reason, "quality": quality, "at": time.time()}
        if logs is not None:
            event["logs"] = logs
        r = send_as_a_device("POST", f"{self.url}/api/v1/device/reports", self.auth, {"events": [event]})
        assert r.status_code == expect, r.text
        return r

    def blob(self, sha256: str) -> int:
        return send_as_a_device("GET", f"{self.url}/api/v1/blobs/{sha256}", self.auth).status_code

    def telemetry(self, model: str, version: int, *, ok: int, errors: int = 0, latency_s: float = 0.004) -> None:
        """One window of traffic: ``ok`` requests at about ``latency_s`` and ``errors`` failures."""
        from edged.latency_buckets import LATENCY_BUCKETS_S

        counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        counts[next((i for i, b in enumerate(LATENCY_BUCKETS_S) if latency_s <= b), len(LATENCY_BUCKETS_S))] = ok
        self.tseq += 1
        window = {"model": model, "version": version, "backend": "test", "success": ok,
                  "failures": {"internal": errors} if errors else {},
                  "latency": {"counts": counts, "sum_s": ok * latency_s}}
        sample = {"device": self.id, "seq": self.tseq, "run": self.run, "t": time.time(), "window_s": 10.0,
                  "uptime_s": 10.0, "models": [window]}
        r = send_as_a_device("POST", f"{self.url}{INGEST_PATH}", self.auth, {"buffer_id": self.run, "items": [sample]})
        assert r.status_code == 200, r.text
