"""The ``edged optimize`` command: argument parsing and the printed summary.

``register(subparsers)`` adds the subcommand to the ``edged`` parser; ``run(args)``
executes it. ``python -m edged.optimize.command ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from edged.errors import EdgedError
from edged.optimize.metrics import METRICS
from edged.optimize.recipes import CALIBRATION_METHODS, DEFAULT_VARIANTS, RECIPES

_BACKENDS = ("onnxruntime", "openvino")


def _csv(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="the FP32 ONNX model")
    p.add_argument("--calibration", type=Path, required=True, metavar="DATA",
                   help="calibration samples: an .npz (one array per input name) or a folder of .npy/.npz files")
    p.add_argument("--out", type=Path, required=True, metavar="REPO/NAME/VERSION",
                   help="version folder to create in a model repository")
    p.add_argument("--eval", type=Path, default=None, metavar="DATA",
                   help="evaluation samples for the accuracy gate (default: the calibration data)")
    p.add_argument("--labels", type=Path, default=None, metavar="FILE.npy",
                   help="per evaluation sample: a class (top1), a box list [K, 5] (map50), a -1-padded id sequence "
                        "(ctc-exact) or the float target (max-abs-error); without it FP32's outputs are the reference")
    p.add_argument("--metric", choices=METRICS, default="top1",
                   help="the gate's task metric: top1 (classes), map50 (boxes), ctc-exact (CTC text), "
                        "max-abs-error (regressors; needs --max-abs-error); default top1")
    p.add_argument("--ctc-blank", type=int, default=0, metavar="ID", help="CTC blank class id (default 0)")
    p.add_argument("--score-threshold", type=float, default=0.25, metavar="S",
                   help="map50: detections below this score are dropped (default 0.25)")
    p.add_argument("--no-accuracy-aware", dest="accuracy_aware", action="store_false",
                   help="do not retry an INT8 variant that fails the gate with the engine's accuracy-aware mode")
    p.add_argument("--accuracy-budget-s", type=float, default=300.0, metavar="S",
                   help="time the accuracy-aware mode may spend per INT8 variant (default 300)")
    p.add_argument("--max-drop", type=float, default=1.0, metavar="POINTS",
                   help="leave out a variant whose top-1 falls more than this many percentage points below "
                        "FP32 (default 1; 0 refuses any drop)")
    p.add_argument("--max-abs-error", type=float, default=None, metavar="X",
                   help="also leave out a variant whose outputs differ from FP32's by more than X anywhere "
                        "(0 refuses any change)")
    p.add_argument("--calibration-method", choices=CALIBRATION_METHODS, default="minmax",
                   help="ONNX Runtime INT8 calibration (default minmax)")
    p.add_argument("--calibration-samples", type=int, default=1000, metavar="N",
                   help="use at most N calibration samples, spread over the set (default 1000)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="max batch for the manifest and timing (default 64 when the ONNX batch dimension is "
                        "dynamic, 0 when it is fixed)")
    p.add_argument("--variants", type=_csv(tuple(RECIPES)), default=DEFAULT_VARIANTS, metavar="LIST",
                   help=f"comma-separated variants to make (default all: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--backends", type=_csv(_BACKENDS), default=_BACKENDS, metavar="LIST",
                   help="backends to time variants on (default onnxruntime,openvino)")
    p.add_argument("--timing-budget-s", type=float, default=1.0, metavar="S",
                   help="time spent timing each variant at each batch size (default 1)")
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: the library's default)")
    p.add_argument("--metric-output", default=None, metavar="NAME",
                   help="output the metric reads (default: the first output)")
    p.add_argument("--description", default=None, help="manifest description")
    p.add_argument("--no-reduce-range", dest="reduce_range", action="store_false",
                   help="8-bit ONNX INT8 weights instead of 7-bit (faster on VNNI CPUs, may saturate elsewhere)")
    p.add_argument("--force", action="store_true", help="replace the version if it exists")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print optimize-report.json instead of the table")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "optimize", help="make quantized variants of an ONNX model, gate them on accuracy, time them",
        description="Make INT8/BF16/FP16 variants of an FP32 ONNX model (ONNX Runtime QDQ INT8, OpenVINO IR "
                    "BF16, FP16 and INT8), leave out those that lose accuracy (after an accuracy-aware retry "
                    "for INT8), time the rest on this device "
                    "and write a model repository version.")
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from edged.optimize.pipeline import optimize
    from edged.optimize.report import render_table, report_dict
    from edged.optimize.results import OptimizeOptions

    try:
        opts = OptimizeOptions(
            model=args.model, calibration=args.calibration, out=args.out, eval=args.eval, labels=args.labels,
            max_drop=args.max_drop, max_abs_error=args.max_abs_error,
            calibration_method=args.calibration_method, calibration_samples=args.calibration_samples,
            max_batch_size=args.max_batch_size, variants=tuple(args.variants), backends=tuple(args.backends),
            timing_budget_s=args.timing_budget_s, threads=args.threads, metric_output=args.metric_output,
            metric=args.metric, ctc_blank=args.ctc_blank, score_threshold=args.score_threshold,
            accuracy_aware=args.accuracy_aware, accuracy_budget_s=args.accuracy_budget_s,
            description=args.description, reduce_range=args.reduce_range, force=args.force,
            progress=not args.quiet,
        )
        result = optimize(opts)
    except EdgedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_dict(result, opts), indent=2, default=str))
    else:
        print(render_table(result))
        print(f"wrote {result.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edged optimize")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
