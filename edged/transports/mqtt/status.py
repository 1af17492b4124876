"""Retained availability messages: the device status (also the Last Will) and one per model.

Retained messages let a dashboard that subscribes later see the current state at
once; the Last Will lets the broker say ``offline`` for a daemon that died
without a word (power loss, ``kill -9``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from edged import __version__
from edged.protocol.v2 import dumps


def _now() -> str:
    # A wall-clock timestamp for people and dashboards; never used for durations.
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_offline(device: str, reason: str) -> bytes:
    return dumps({"state": "offline", "device": device, "reason": reason, "version": __version__})


def device_online(device: str, profile: str, models: Iterable[Mapping[str, Any]], *,
                  error: str | None = None) -> bytes:
    """``error``: why requests cannot arrive although the daemon is connected (a refused subscription)."""
    summary = [{"name": m["name"], "version": m["version"], "state": m["state"]} for m in models]
    doc: dict[str, Any] = {"state": "online", "device": device, "profile": profile, "models": summary,
                           "version": __version__, "since": _now()}
    if error is not None:
        doc["error"] = error
    return dumps(doc)


def model_statuses(statuses: Iterable[Mapping[str, Any]],
                   io: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """One status document per model: the version a request without a version gets, all versions,
    and (from ``io``) the served version's input and output tensors, so clients can build requests."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for s in statuses:
        by_model.setdefault(str(s["name"]), []).append(s)
    out: dict[str, dict[str, Any]] = {}
    for name, versions in sorted(by_model.items()):
        ready = [v for v in versions if v["state"] == "ready"]
        current = max(ready or versions, key=lambda v: int(v["version"]))
        out[name] = {
            "model": name,
            "state": current["state"],
            "version": current["version"],
            "backend": current.get("backend"),
            "device": current.get("device"),
            "precision": current.get("precision"),
            "reason": current.get("reason"),
            "versions": [{"version": v["version"], "state": v["state"], "backend": v.get("backend"),
                          "reason": v.get("reason")} for v in versions],
        }
        if io and name in io:
            out[name]["inputs"] = io[name].get("inputs", [])
            out[name]["outputs"] = io[name].get("outputs", [])
    return out
