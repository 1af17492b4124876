"""``edged status``: a one-screen summary of the running daemon, read from its status snapshot.

The daemon's telemetry agent rewrites ``<runtime_dir>/status.json`` atomically every few
seconds. Reading that file, rather than querying the HTTP API, works whatever the
transports are (HTTP off, on a Unix socket, behind TLS, MQTT only), needs no credentials,
costs the daemon nothing, and still answers usefully when the daemon is hung or gone:
the snapshot's age, its ``state`` and whether its pid is alive say which. The update
state comes from the sync agent's own file in the state dir, so it shows even when the
daemon is down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from edged.config import Config, load_config
from edged.telemetry.snapshot import (
    STATUS_FILE,
    StatusFileError,
    StatusSnapshot,
    TelemetryStatus,
    read_snapshot,
    snapshot_age,
)

STALE_INTERVALS = 3  # a snapshot older than this many rewrite intervals (plus slack) means the daemon is stuck
STALE_SLACK_S = 5.0
EXIT_RUNNING, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3  # 3: "not running", as systemctl status and LSB use it


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("status", help="one-screen summary of the running daemon",
                              description="Profile, models, request rates, latencies, temperatures and update "
                                          "state of the daemon, from the status file it keeps in its runtime dir.")
    p.add_argument("--json", action="store_true", help="machine-readable output")


# ---- liveness ---------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user (the edged service user)
    return True


def liveness(snap: StatusSnapshot, now: float) -> tuple[str, bool]:
    """(description, running) for a snapshot read at wall time ``now``."""
    age = snapshot_age(snap, now)
    if snap.state == "stopped":
        return f"stopped {_ago(age)}", False
    if not _pid_alive(snap.pid):
        return f"not running (pid {snap.pid} is gone; last snapshot {_ago(age)})", False
    if age > STALE_INTERVALS * snap.interval_s + STALE_SLACK_S:
        return f"not responding (last snapshot {_ago(age)}, expected every {snap.interval_s:g} s)", False
    return "running", True


# ---- update state (the sync agent's file) -----------------------------------------------------------
def update_states(cfg: Config) -> dict[str, str]:
    """Per model, what the registry sync is doing; read-only (never repairs or moves the file)."""
    path = cfg.device.state_dir / "sync" / "state.json"
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    from pydantic import ValidationError

    from edged.sync.state import SyncState

    try:
        state = SyncState.model_validate_json(data)
    except ValidationError:
        return {}
    out = {}
    for model, ms in state.models.items():
        parts = []
        if ms.current is not None:
            parts.append(f"v{ms.current.version}" + (f" r{ms.current.release}" if ms.current.release else ""))
        if ms.pending is not None:
            p = ms.pending
            if p.fault:  # the step is not in progress: it failed here and waits for its retry
                parts.append(f"-> v{p.version} r{p.release}: FAILED at {p.step}: {p.fault} (retrying with back-off)")
            else:
                parts.append(f"-> v{p.version} r{p.release}: {p.step}" + (f" ({p.reason})" if p.reason else ""))
        elif ms.rejected:
            last = max(ms.rejected)
            parts.append(f"r{last} rolled back")
        out[model] = " ".join(parts) or "-"
    return out


# ---- formatting -------------------------------------------------------------------------------------
def _ago(seconds: float) -> str:
    return f"{_duration(seconds)} ago"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _mhz(hz: float | None) -> str:
    return "?" if hz is None else f"{hz / 1e6:.0f} MHz"


_UPLOAD_STATES = {"sent": "ok", "empty": "ok", "retry smaller": "ok", "idle": "starting",
                  "not enrolled": "waiting for enrollment", "refused": "refused", "unreachable": "registry unreachable"}


def render(snap: StatusSnapshot, updates: dict[str, str], now: float) -> str:
    what, _running = liveness(snap, now)
    age = snapshot_age(snap, now)
    lines = [f"edged {snap.edged_version} on {snap.device}: {what}, pid {snap.pid}, "
             f"up {_duration(snap.written_at - snap.started_at)}, profile {snap.profile or '?'}",
             f"snapshot {_ago(age)} (rewritten every {snap.interval_s:g} s; rates over the last "
             f"{snap.window_s:.0f} s)", ""]
    lines += _system_lines(snap)
    lines.append("")
    lines += _model_lines(snap, updates)
    if snap.telemetry is not None:
        lines.append("")
        lines.append("telemetry  " + _telemetry_text(snap, snap.telemetry, age))
    if (mq := snap.mqtt) is not None:
        lines.append(f"mqtt       {mq.requests} requests, {mq.replies} answers, {mq.error_replies} error replies "
                     f"({mq.overloaded} overloaded), {mq.replies_dropped} replies dropped, "
                     f"{mq.requests_dropped} requests without a reply address, backlog {mq.backlog}")
    for m in snap.models:
        if m.warmup:
            lines.append(f"note: {m.model} v{m.version}: {m.warmup}")
        if m.note:
            lines.append(f"note: {m.model} v{m.version}: {m.note}")
    for note in snap.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _system_lines(snap: StatusSnapshot) -> list[str]:
    """The host's lines: CPU, memory, disk, the daemon's process, temperatures, accelerators, power."""
    sy = snap.system
    mem = f"memory {_bytes(sy.memory_used)} / {_bytes(sy.memory_total)}"
    swap = f"swap {_bytes(sy.swap_used)} / {_bytes(sy.swap_total)}"
    disk = f"state disk {_bytes(sy.disk_free)} free of {_bytes(sy.disk_total)}"
    lines = [f"system  CPU {_pct(sy.cpu_utilization)} of {sy.cpu_count} core(s), load {sy.load1 or 0:.2f} | "
             f"{mem} | {swap} | {disk}"]
    cores = "-" if sy.process_cpu_cores is None else f"{sy.process_cpu_cores:.2f}"
    lines.append(f"edged   RSS {_bytes(sy.process_rss)}, {sy.process_threads} threads, {cores} core(s) busy")
    if sy.temperatures_c:
        lines.append("temps   " + "  ".join(f"{k} {v:.1f}C" for k, v in sorted(sy.temperatures_c.items())[:8]))
    for a in sy.accelerators:
        extra = []
        if a.memory_used_bytes is not None:
            extra.append(f"memory {_bytes(a.memory_used_bytes)} / {_bytes(a.memory_total_bytes)}")
        if a.power_w is not None:
            extra.append(f"{a.power_w:.1f} W")
        if a.temperature_c is not None:
            extra.append(f"{a.temperature_c:.0f}C")
        lines.append(f"accel   {a.name} ({a.kind}) {_pct(a.utilization)} @ {_mhz(a.freq_hz)} "
                     f"(max {_mhz(a.max_freq_hz)})" + (", " + ", ".join(extra) if extra else ""))
    power = [f"{r.name} {r.power_w:.2f} W" for r in sy.rails if r.power_w is not None]
    if sy.emc_freq_hz is not None:
        power.append(f"EMC {_pct(sy.emc_utilization)} @ {_mhz(sy.emc_freq_hz)}")
    if power:
        lines.append("power   " + "  ".join(power))
    return lines


def _model_lines(snap: StatusSnapshot, updates: dict[str, str]) -> list[str]:
    """The models' table (with models only an update knows of), then each model's engine choice."""
    header = ("MODEL", "VER", "STATE", "ENGINE", "REQ/S", "ERR/S", "P50 ms", "P99 ms", "QUEUED", "OK", "FAILED",
              "UPDATE")
    rows = [header]
    for m in snap.models:
        engine = " ".join(x for x in (m.backend, m.device, m.precision) if x) or "-"
        state = m.state if m.reason is None else f"{m.state}: {m.reason[:40]}"
        rows.append((m.model, str(m.version), state, engine, _rate(m.requests_per_s), _rate(m.errors_per_s),
                     _ms(m.p50_s), _ms(m.p99_s), str(m.in_flight), str(m.success_total), str(m.failures_total),
                     updates.get(m.model, "-")))
    for model in sorted(set(updates) - {m.model for m in snap.models}):
        rows.append((model, "-", "not loaded", "-", "-", "-", "-", "-", "-", "-", "-", updates[model]))
    lines: list[str] = []
    if len(rows) == 1:
        lines.append("no models")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [f"  {m.model} v{m.version}: {m.choice}" for m in snap.models if m.choice]
    return lines


def _telemetry_text(snap: StatusSnapshot, tel: TelemetryStatus, age: float) -> str:
    """The telemetry line after its label: cadence, MQTT, buffer and upload state."""
    if not tel.enabled:
        return "disabled"
    parts = [f"every {tel.interval_s:g} s, {tel.samples_total} sample(s) this run",
             "MQTT on" if tel.mqtt else "MQTT off"]
    if tel.buffer is not None:
        b = tel.buffer
        parts.append(f"buffer {b.samples} ({_bytes(b.bytes)} of {_bytes(b.capacity_bytes)}), "
                     f"{b.dropped_total} dropped")
    if tel.upload is not None:
        u = tel.upload
        # Both wall times come from the daemon's clock: their difference plus the file's age.
        last = _ago(age + snap.written_at - u.last_success_wall) if u.last_success_wall else "never"
        up = f"upload {_UPLOAD_STATES.get(u.state, u.state)}, last acknowledged {last}"
        if u.state in ("not enrolled", "refused", "unreachable") and u.last_error:
            up += f" ({u.last_error[:80]})"
        parts.append(up)
    else:
        parts.append("no upload")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    path = cfg.device.runtime_dir / STATUS_FILE
    updates = update_states(cfg)
    try:
        snap = read_snapshot(path)
    except (OSError, StatusFileError) as e:
        print(f"edged status: cannot read {path}: {e}", file=sys.stderr)
        return EXIT_ERROR
    now = time.time()
    if getattr(args, "json", False):
        doc: dict[str, Any] = {"running": False, "state": "no status file", "snapshot": None, "updates": updates}
        if snap is not None:
            what, running = liveness(snap, now)
            doc.update(running=running, state=what, snapshot=snap.model_dump(mode="json"))
        print(json.dumps(doc, indent=2))
        return EXIT_RUNNING if doc["running"] else EXIT_NOT_RUNNING
    if snap is None:
        print(f"edged is not running: no status file at {path} (the daemon writes it while it runs)")
        for model, text in sorted(updates.items()):
            print(f"update  {model}: {text}")
        return EXIT_NOT_RUNNING
    print(render(snap, updates, now))
    return EXIT_RUNNING if liveness(snap, now)[1] else EXIT_NOT_RUNNING


def _main() -> int:  # pragma: no cover - for trying the command before the CLI wires it
    parser = argparse.ArgumentParser(prog="edged")
    parser.add_argument("--config", "-c", type=Path, default=None)
    register(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
