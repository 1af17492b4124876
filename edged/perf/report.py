"""What ``edged perf`` prints and writes: a line per window, a summary table, CSV and JSON.

The CSV has a fixed set of columns (empty cells where a value does not apply or
the server side was unavailable) so that scripts can read any run the same way.
Durations are in microseconds, as in perf_analyzer's CSV.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edged.perf.measure import LevelResult, Window

CSV_COLUMNS = (
    "transport", "model", "mode", "concurrency", "request_rate", "batch_size",
    "throughput_infer_per_s", "requests_per_s", "requests", "errors", "delayed",
    "p50_us", "p90_us", "p95_us", "p99_us", "avg_us", "latency_metric", "latency_us",
    "windows", "stable",
    "server_request_us", "server_queue_us", "server_compute_input_us", "server_compute_infer_us",
    "server_compute_output_us", "server_avg_batch",
)


@dataclass(frozen=True)
class RunInfo:
    transport: str
    address: str
    model: str
    version: int | None
    server_stats: str  # "" when available, else why not


def _num(x: float, digits: int = 1) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def level_label_for(mode: str, level: float) -> str:
    return f"concurrency {int(level)}" if mode == "concurrency" else f"request rate {level:g}/s"


def level_label(r: LevelResult) -> str:
    return level_label_for(r.mode, r.level)


def row(info: RunInfo, r: LevelResult) -> dict[str, str]:
    s = r.server
    return {
        "transport": info.transport, "model": info.model, "mode": r.mode,
        "concurrency": str(int(r.level)) if r.mode == "concurrency" else "",
        "request_rate": f"{r.level:g}" if r.mode == "request_rate" else "",
        "batch_size": str(r.batch_size),
        "throughput_infer_per_s": _num(r.throughput, 2), "requests_per_s": _num(r.request_rate, 2),
        "requests": str(r.requests), "errors": str(r.errors), "delayed": str(r.delayed),
        **{f"p{p}_us": _num(v) for p, v in r.percentiles_us.items()},
        "avg_us": _num(r.avg_us), "latency_metric": r.latency_metric, "latency_us": _num(r.latency_us),
        "windows": str(r.windows), "stable": "true" if r.stable else "false",
        "server_request_us": _num(s.request_us) if s else "", "server_queue_us": _num(s.queue_us) if s else "",
        "server_compute_input_us": _num(s.compute_input_us) if s else "",
        "server_compute_infer_us": _num(s.compute_infer_us) if s else "",
        "server_compute_output_us": _num(s.compute_output_us) if s else "",
        "server_avg_batch": _num(s.avg_batch, 2) if s else "",
    }


def to_csv(info: RunInfo, results: Sequence[LevelResult]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in results:
        w.writerow(row(info, r))
    return buf.getvalue()


def to_json(info: RunInfo, settings: dict[str, Any], results: Sequence[LevelResult]) -> str:
    doc = {
        "transport": info.transport, "address": info.address, "model": info.model, "version": info.version,
        "settings": settings,
        "server_stats": "available" if not info.server_stats else f"unavailable: {info.server_stats}",
        "results": [{**row(info, r), "window_throughputs": [round(x, 2) for x in r.window_throughputs],
                     "first_error": r.first_error} for r in results],
    }
    return json.dumps(doc, indent=2) + "\n"


def window_line(n: int, w: Window, batch: int) -> str:
    lat = sorted(w.latencies_ns)
    p50 = lat[len(lat) // 2] / 1e6 if lat else math.nan
    err = f", {w.errors} errors" if w.errors else ""
    return f"    window {n}: {w.requests * batch / w.seconds:9.1f} infer/s, p50 {p50:.3f} ms{err}"


def level_text(r: LevelResult) -> str:
    p = r.percentiles_us
    lines = [f"  {level_label(r)}: {r.throughput:.1f} infer/s ({r.requests} requests"
             + (f", {r.errors} errors" if r.errors else "")
             + (f", {r.delayed} delayed" if r.delayed else "") + ")"
             + ("" if r.stable else f"  [not stable after {r.windows} windows]"),
             f"    client latency: p50 {p[50] / 1e3:.3f} ms  p90 {p[90] / 1e3:.3f}  p95 {p[95] / 1e3:.3f}  "
             f"p99 {p[99] / 1e3:.3f}  avg {r.avg_us / 1e3:.3f} ms"
             + (f"  ({r.latency_metric} {r.latency_us / 1e3:.3f} ms)" if r.latency_metric not in ("avg", "p50",
                                                                                              "p90", "p95", "p99")
                else "")]
    s = r.server
    if s is not None:
        lines.append(f"    server: {s.request_us / 1e3:.3f} ms per request = queue {s.queue_us / 1e3:.3f} ms + "
                     f"compute {s.compute_us / 1e3:.3f} ms (input {s.compute_input_us / 1e3:.3f}, infer "
                     f"{s.compute_infer_us / 1e3:.3f}, output {s.compute_output_us / 1e3:.3f}); "
                     f"{s.avg_batch:.2f} inferences per engine run; transport+client: "
                     f"{max(0.0, r.avg_us - s.request_us) / 1e3:.3f} ms")
    if r.delayed > 0.1 * max(1, r.requests):
        lines.append(f"    warning: {r.delayed} requests left more than 1 ms after their scheduled time: the "
                     "client could not keep the rate (raise --max-threads, or the daemon is saturated)")
    if r.errors and r.first_error:
        lines.append(f"    first error: {r.first_error}")
    return "\n".join(lines)


def summary_table(results: Sequence[LevelResult]) -> str:
    head = ("level", "infer/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "queue ms", "compute ms", "stable")
    rows: list[tuple[str, ...]] = [head]
    for r in results:
        p, s = r.percentiles_us, r.server
        rows.append((f"{int(r.level)}" if r.mode == "concurrency" else f"{r.level:g}/s", f"{r.throughput:.1f}",
                     *(f"{p[k] / 1e3:.3f}" for k in (50, 90, 95, 99)),
                     f"{s.queue_us / 1e3:.3f}" if s else "-", f"{s.compute_us / 1e3:.3f}" if s else "-",
                     "yes" if r.stable else "no"))
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True)) for x in rows)
