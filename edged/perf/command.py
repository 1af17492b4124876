"""The ``edged perf`` command: parse options, find the daemon, sweep the load levels, write the results.

Addresses default to what the daemon's own config says (``--config``, else
/etc/edged/edged.toml, else the built-in defaults), so on a device ``edged perf -m
digits --transport shm`` needs nothing more. ``python -m edged.perf`` runs it standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from edged.errors import EdgedError

if TYPE_CHECKING:
    from edged.perf.measure import LevelResult
    from edged.perf.report import RunInfo

TRANSPORTS = ("http", "shm", "grpc", "mqtt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model name")
    p.add_argument("-x", "--model-version", type=int, default=None, dest="model_version",
                   help="model version (default: the one the daemon serves)")
    p.add_argument("--transport", "-i", choices=TRANSPORTS, default="http", help="how to reach the daemon "
                   "(default http)")
    p.add_argument("-u", "--url", default=None, metavar="ADDRESS",
                   help="the transport's address: http or grpc host:port or Unix socket, shm socket path, "
                        "mqtt://host:port (default: from the daemon's config)")
    p.add_argument("--http-url", default=None, metavar="HOST:PORT",
                   help="HTTP endpoint for the daemon's statistics when the load goes over shm, grpc or mqtt (default: "
                        "the config's [http] listen when enabled; 'none' to skip)")
    p.add_argument("--streaming", action="store_true",
                   help="grpc: send over one ModelStreamInfer stream per load thread instead of unary calls")
    p.add_argument("--device-id", default=None, help="mqtt: the daemon's device id (default: from the config)")
    p.add_argument("--topic-prefix", default=None, help="mqtt: topic prefix (default: from the config)")
    p.add_argument("--qos", type=int, choices=(0, 1, 2), default=1,
                   help="mqtt: QoS of the requests (default 1); replies come at the daemon's [mqtt] reply_qos")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency-range", default=None, metavar="START:END:STEP",
                      help="closed loop: requests kept in flight, START to END by STEP, or a list 1,2,4,8 "
                           "(default 1)")
    load.add_argument("--request-rate-range", default=None, metavar="START:END:STEP",
                      help="open loop: requests per second, START to END by STEP, or a list")
    p.add_argument("--request-distribution", choices=("constant", "poisson"), default="constant",
                   help="open loop: gaps between requests (default constant)")
    p.add_argument("--max-threads", type=int, default=8, metavar="N",
                   help="open loop: sending threads, one connection each (default 8)")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="samples per request (default 1)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2",
                   help="sample shape of an input with dynamic dimensions (repeatable)")
    p.add_argument("--input-data", default="random", metavar="FILE|random|zero",
                   help=".npy (single input), .npz (one array per input; many samples are sent in turn), "
                        "perf_analyzer's JSON, an image or sound file (JPEG, PNG, WebP, WAV) for a pipeline or "
                        "model whose one input is BYTES, or generated data (default random)")
    p.add_argument("--input-tensor-format", choices=("binary", "json"), default="binary",
                   help="http and mqtt: tensors as binary (default) or as JSON numbers")
    p.add_argument("-p", "--measurement-interval", type=float, default=2000, metavar="MS",
                   help="length of one measurement window (default 2000 ms)")
    p.add_argument("-s", "--stability-percentage", type=float, default=10, metavar="PCT",
                   help="windows are stable when throughput and latency are within PCT%% of the mean of the last "
                        "three (default 10)")
    p.add_argument("-r", "--max-trials", type=int, default=10, metavar="N",
                   help="at most N windows per level; then the last three are reported as unstable (default 10)")
    p.add_argument("--percentile", type=int, default=None, metavar="P",
                   help="use the P-th percentile latency for stability and the plot (default: the mean)")
    p.add_argument("--request-timeout", type=float, default=30, metavar="S", help="per request (default 30 s)")
    p.add_argument("-f", "--filename", type=Path, default=None, metavar="CSV", help="write the results as CSV")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw latency against throughput")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per measurement window")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "perf", help="load a running daemon over shm, http, grpc or mqtt and measure latency and throughput",
        description="Load generator for a running edged (like Triton's perf_analyzer): closed-loop concurrency or "
                    "open-loop request-rate sweeps, windows repeated until stable, client latency percentiles "
                    "next to the daemon's queue/compute split, CSV/JSON output and a PNG plot.")
    add_arguments(p)


def _check(args: argparse.Namespace) -> None:
    from edged.errors import InvalidInputError

    if args.measurement_interval < 50:
        raise InvalidInputError("--measurement-interval must be at least 50 ms")
    if args.max_trials < 3:
        raise InvalidInputError("--max-trials must be at least 3 (stability compares three windows)")
    if not 0 < args.stability_percentage <= 100:
        raise InvalidInputError("--stability-percentage must be in (0, 100]")
    if args.percentile is not None and not 1 <= args.percentile <= 99:
        raise InvalidInputError("--percentile must be between 1 and 99")
    if args.max_threads < 1:
        raise InvalidInputError("--max-threads must be >= 1")
    if args.request_timeout <= 0:
        raise InvalidInputError("--request-timeout must be > 0")
    if args.streaming and args.transport != "grpc":
        raise InvalidInputError("--streaming applies to grpc only")


def _config(args: argparse.Namespace) -> Any:
    from edged.config import load_config

    return load_config(getattr(args, "config", None))


def _target(args: argparse.Namespace, cfg: Any) -> Any:
    from edged import reach
    from edged.perf import targets

    binary = args.input_tensor_format == "binary"
    if args.transport == "http":
        return targets.HttpTarget(args.url or reach.http_address_of(cfg), args.model, args.model_version,
                                  args.request_timeout, binary=binary)
    if args.transport == "shm":
        if args.input_tensor_format != "binary":
            from edged.errors import InvalidInputError

            raise InvalidInputError("--input-tensor-format json applies to http and mqtt, not shm")
        return targets.ShmTarget(args.url or reach.shm_address_of(cfg), args.model, args.model_version,
                                 args.request_timeout)
    if args.transport == "grpc":
        if args.input_tensor_format != "binary":
            from edged.errors import InvalidInputError

            raise InvalidInputError("--input-tensor-format json applies to http and mqtt, not grpc")
        return targets.GrpcTarget(args.url or reach.grpc_address_of(cfg), args.model, args.model_version,
                                  args.request_timeout, streaming=args.streaming)
    settings = reach.MqttSettings.from_config(cfg, url=args.url, device_id=args.device_id,
                                                topic_prefix=args.topic_prefix)
    return targets.MqttTarget(settings, args.model, args.model_version, args.request_timeout, binary=binary,
                              qos=args.qos)


def _stats_reader(args: argparse.Namespace, cfg: Any, target: Any) -> Any:
    from edged.perf.server_stats import StatsReader

    if args.transport == "http":
        url, why = target.address, ""
    elif args.http_url and args.http_url.lower() != "none":
        url, why = args.http_url, ""
    elif args.http_url is None and cfg.http.enabled:
        from edged.reach import http_address_of

        url, why = http_address_of(cfg), ""
    else:
        url, why = None, "no HTTP endpoint to read /v2/models/{m}/stats from (pass --http-url HOST:PORT)"
    reader = StatsReader(url, args.model, args.model_version, unavailable_reason=why)
    reader.snapshot()  # a first read tells whether it is reachable
    return reader


def run(args: argparse.Namespace) -> int:
    out: TextIO = sys.stderr if args.json == "-" else sys.stdout
    try:
        return _run(args, out)
    except EdgedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, out: TextIO) -> int:
    from edged.perf import report
    from edged.perf.inputs import build_inputs, parse_shapes
    from edged.perf.load import ClosedLoop, Load, OpenLoop
    from edged.perf.measure import Settings, measure_level
    from edged.perf.ranges import concurrency_levels, rate_levels

    _check(args)
    open_loop = args.request_rate_range is not None
    levels: list[float] = list(rate_levels(args.request_rate_range)) if open_loop else \
        [float(c) for c in concurrency_levels(args.concurrency_range or "1")]
    cfg = _config(args)
    target = _target(args, cfg)
    info = target.model_info()
    requests = build_inputs(info, args.input_data, batch_size=args.batch_size, shapes=parse_shapes(args.shape))
    stats = _stats_reader(args, cfg, target)
    settings = Settings(interval_s=args.measurement_interval / 1e3, stability_pct=args.stability_percentage,
                        max_trials=args.max_trials, percentile=args.percentile, batch_size=args.batch_size)
    run_info = report.RunInfo(target.transport, target.address, args.model, args.model_version,
                              "" if stats.available else stats.reason)
    shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in requests[0].items())
    print(f"edged perf: model {args.model} over {target.transport} ({target.address}); "
          f"{'open loop, request rate' if open_loop else 'closed loop, concurrency'} "
          f"{', '.join(f'{x:g}' for x in levels)}", file=out)
    print(f"  inputs: {shapes}" + (f"; {len(requests)} distinct requests" if len(requests) > 1 else ""), file=out)
    print(f"  windows of {args.measurement_interval:g} ms until 3 agree within {args.stability_percentage:g}% "
          f"(at most {args.max_trials}); latency for stability: "
          f"{f'p{args.percentile}' if args.percentile else 'mean'}", file=out)
    print("  server-side statistics: " + (f"from {stats.url}" if stats.available else
                                           f"unavailable: {stats.reason}"), file=out)
    results: list[LevelResult] = []
    status = 0
    for level in levels:
        load: Load = OpenLoop(target, requests, level, distribution=args.request_distribution,
                              max_threads=args.max_threads) if open_loop else \
            ClosedLoop(target, requests, int(level))
        print(f"{report.level_label_for(load.mode, level)}:", file=out)

        def on_window(n: int, w: Any) -> None:
            if not args.quiet:
                print(report.window_line(n, w, args.batch_size), file=out, flush=True)

        try:
            load.start()
            try:
                result = measure_level(load, settings, stats, on_window)
            finally:
                load.stop()
        except KeyboardInterrupt:
            print("interrupted: writing what was measured so far", file=sys.stderr)
            status = 130
            break
        print(report.level_text(result), file=out, flush=True)
        if args.transport == "mqtt":
            _mqtt_notes(target, result, out)
        if result.requests == 0:
            print(f"error: no request succeeded at {report.level_label(result)}: "
                  f"{result.first_error or 'no reply within the windows'}", file=sys.stderr)
            status = 1
            results.append(result)
            break
        results.append(result)
    if stats.available is False and run_info.server_stats != stats.reason:
        run_info = report.RunInfo(run_info.transport, run_info.address, run_info.model, run_info.version,
                                  stats.reason)
    stats.close()
    _write_results(args, out, run_info, results, levels, open_loop=open_loop)
    return status


def _write_results(args: argparse.Namespace, out: TextIO, run_info: RunInfo, results: list[LevelResult],
                   levels: list[float], *, open_loop: bool) -> None:
    """The summary table, then the CSV, JSON and plot files asked for (nothing without results)."""
    from edged.fsutil import atomic_write_bytes, atomic_write_text
    from edged.perf import report

    if results:
        print("\n" + report.summary_table(results), file=out)
    if args.filename is not None and results:
        atomic_write_text(args.filename, report.to_csv(run_info, results))
        print(f"wrote {args.filename}", file=out)
    if args.json is not None and results:
        doc = report.to_json(run_info, _settings_dict(args, levels), results)
        if args.json == "-":
            sys.stdout.write(doc)
        else:
            atomic_write_text(Path(args.json), doc)
            print(f"wrote {args.json}", file=out)
    if args.plot is not None and results:
        from edged.perf.plot import latency_throughput_png

        metric = results[0].latency_metric
        points = [(r.throughput, r.latency_us / 1e3, f"{r.level:g}") for r in results]
        what = "request rate" if open_loop else "concurrency"
        atomic_write_bytes(args.plot, latency_throughput_png(
            points, title=f"{args.model} over {run_info.transport}: {metric} latency vs throughput",
            x_label=f"throughput (infer/s); points labelled with the {what}", y_label=f"{metric} latency (ms)"))
        print(f"wrote {args.plot}", file=out)


def _mqtt_notes(target: Any, result: Any, out: TextIO) -> None:
    """The QoS actually used, and the broker's delayed-ACK stall when the round trips show it."""
    from edged.transports.mqtt.stall import perf_warning

    got = "unknown (no reply)" if target.reply_qos is None else str(target.reply_qos)
    print(f"  MQTT: requests at QoS {target.qos}, replies delivered at QoS {got}", file=out)
    own = result.server.request_us / 1e6 if result.server is not None else None
    warning = perf_warning([result.percentiles_us[p] / 1e6 for p in (50, 90)], own)
    if warning is not None:
        print(f"  warning: {warning}", file=out, flush=True)


def _settings_dict(args: argparse.Namespace, levels: list[float]) -> dict[str, Any]:
    return {
        "mode": "request_rate" if args.request_rate_range is not None else "concurrency", "levels": levels,
        "batch_size": args.batch_size, "input_data": args.input_data,
        "input_tensor_format": args.input_tensor_format, "measurement_interval_ms": args.measurement_interval,
        "stability_percentage": args.stability_percentage, "max_trials": args.max_trials,
        "percentile": args.percentile, "request_distribution": args.request_distribution,
        "max_threads": args.max_threads, **({"qos": args.qos} if args.transport == "mqtt" else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edged perf")
    parser.add_argument("--config", "-c", type=Path, default=argparse.SUPPRESS,
                        help="the daemon's config file, for its addresses")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
