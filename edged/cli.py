"""The ``edged`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from edged import __version__
from edged.config import Config, load_config, parse_config
from edged.errors import ConfigError, EdgedError, ErrorCode, exit_status

log = logging.getLogger("edged")


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=argparse.SUPPRESS,
                   help="config file (default /etc/edged/edged.toml if present, else built-in defaults)")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edged", description="Inference daemon for edge devices.")
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    _add_config(parser)
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon in the foreground until SIGINT/SIGTERM")
    _add_config(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sync_set", type=_key_value,
                   help="a [registry] sync setting the config file cannot hold yet (e.g. trial_s=2)")

    p = sub.add_parser("detect", help="probe the hardware and show the matching device profile")
    _add_config(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--root", type=Path, default=Path("/"), help="probe this sysroot instead of /")

    p = sub.add_parser("config", help="configuration tools")
    _add_config(p)
    csub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    cp = csub.add_parser("check", help="validate a config file; print every problem with its key path")
    cp.add_argument("path", type=Path)
    _add_config(cp)

    p = sub.add_parser("models", help="model repository tools")
    _add_config(p)
    msub = p.add_subparsers(dest="models_command", required=True, metavar="SUBCOMMAND")
    mp = msub.add_parser("list", help="each model version, its chosen engine and state")
    mp.add_argument("--json", action="store_true")
    mp.add_argument("--remeasure", action="store_true",
                    help="forget the remembered engine choices (select = \"benchmark\") so they are measured again")
    _add_config(mp)

    p = sub.add_parser("infer", help="run one inference and print the outputs")
    _add_config(p)
    p.add_argument("model")
    p.add_argument("--input", "-i", type=Path, required=True,
                   help=".npy for the model's single input, .npz with one array per input name, or an image or "
                        "sound file (JPEG, PNG, WebP, WAV) for a model or pipeline whose one input is BYTES "
                        "(the answer is printed as JSON)")
    p.add_argument("--model-version", type=int, default=None, dest="model_version")
    p.add_argument("--json", action="store_true", help="print exactly the v2 inference response")
    p.add_argument("--transport", choices=["local", "shm", "http", "grpc", "mqtt"], default="local",
                   help="local: load the model in this process; shm, http, mqtt: ask the running daemon "
                        "(addresses from the config)")

    from edged.optimize import command as optimize_command

    optimize_command.register(sub)
    _add_config(sub.choices["optimize"])

    from edged import status as status_command

    status_command.register(sub)
    _add_config(sub.choices["status"])

    from edged.perf import command as perf_command

    perf_command.register(sub)
    _add_config(sub.choices["perf"])
    return parser


def _config(args: argparse.Namespace) -> Config:
    cfg = load_config(getattr(args, "config", None))
    return cfg


def cmd_config_check(args: argparse.Namespace) -> int:
    path: Path = args.path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        print(f"{path}: cannot read: {e.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"{path}: not UTF-8 text (byte {e.start}): not a TOML config file", file=sys.stderr)
        return 1
    try:
        cfg = parse_config(text, source=path)
    except ConfigError as e:
        for problem in e.problems:
            print(f"{path}: {problem}", file=sys.stderr)
        return 1
    problems = []
    from edged.repository.seed import serving_repository

    if not serving_repository(cfg.device.model_repository, cfg.device.model_seed).is_dir():
        problems.append(f"device.model_repository: {cfg.device.model_repository} is not a folder"
                        + (f" (nor is device.model_seed {cfg.device.model_seed})" if cfg.device.model_seed else ""))
    # The broker address and TLS files, checked exactly as the MQTT transport checks them at start.
    from edged.transports.mqtt.connection import MqttOptions

    try:
        MqttOptions.from_config(cfg)
    except ConfigError as e:
        problems += e.problems
    from edged.transports.grpc.server import check_config as check_grpc

    problems += check_grpc(cfg)
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    for warning in secret_exposure(path, cfg) + cleartext_links(cfg):
        print(f"{path}: warning: {warning}", file=sys.stderr)
    if problems:
        return 1
    print(f"{path}: OK")
    return 0


def secret_exposure(path: Path, cfg: Config) -> list[str]:
    """A config holding a secret must not be readable by every user on the device (issue #20)."""
    secrets = [name for name, value in (("[registry] enrollment_token", cfg.registry.enrollment_token),
                                        ("[mqtt] password", cfg.mqtt.password),
                                        ("[control] token", cfg.control.token)) if value]
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return []
    if not secrets or not mode & 0o004:
        return []
    return [f"readable by every user (mode {mode:04o}) but holds {', '.join(secrets)}: "
            f"chmod 0640 and chown root:edged (the daemon's group) so only root and edged can read it"]


def _loopback(host: str | None) -> bool:
    import ipaddress

    if not host:
        return True  # no host: a local socket
    if host.rstrip(".").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cleartext_links(cfg: Config) -> list[str]:
    """Links to another host without TLS: anyone on the path reads and changes what crosses them (issue #36)."""
    from urllib.parse import urlsplit

    out = []
    if cfg.registry.enabled and cfg.registry.url:
        u = urlsplit(cfg.registry.url)
        if u.scheme == "http" and not _loopback(u.hostname):
            out.append(f"[registry] url {cfg.registry.url} is plain HTTP to another host: the device credential, "
                       "its reports and telemetry cross the network in clear, and whoever is on the path can "
                       "answer for the registry (releases stay signed, but it can withhold them); use https://")
    if cfg.mqtt.enabled:
        u = urlsplit(cfg.mqtt.url)
        if u.scheme in ("mqtt", "ws") and cfg.mqtt.tls is None and not _loopback(u.hostname):
            creds = " and the MQTT password" if cfg.mqtt.password else ""
            out.append(f"[mqtt] url {cfg.mqtt.url} has no TLS to another host: requests, replies{creds} cross "
                       "the network in clear; use mqtts:// (or wss://) with [mqtt.tls]")
        elif cfg.mqtt.tls is not None and cfg.mqtt.tls.insecure_skip_verify and not _loopback(u.hostname):
            out.append(f"[mqtt.tls] insecure_skip_verify: the broker at {u.hostname} is not verified, so anyone "
                       "on the path can pose as it")
    return out


def cmd_detect(args: argparse.Namespace) -> int:
    from edged.detect import render_detect
    from edged.hardware.probe import probe
    from edged.profiles import load_profiles, match_profile

    cfg = _config(args)
    if not args.root.is_dir():
        raise EdgedError(f"--root {args.root}: not a folder (a sysroot holding proc/, sys/ and etc/)",
                         code=ErrorCode.INVALID_ARGUMENT)
    facts = probe(args.root, engines=args.root == Path("/"))
    dirs = [cfg.device.profiles_dir] if cfg.device.profiles_dir else []
    match = match_profile(facts, load_profiles(dirs))
    print(render_detect(facts, match, as_json=args.json))
    return 0


def _running_daemon_models(cfg: Any) -> tuple[list[dict[str, Any]], str] | None:
    """The running daemon's own view of its models (its status file), or None when none runs."""
    import time

    from edged.status import liveness
    from edged.telemetry.snapshot import STATUS_FILE, StatusFileError, read_snapshot

    try:
        snap = read_snapshot(cfg.device.runtime_dir / STATUS_FILE)
    except (OSError, StatusFileError):
        return None
    if snap is None or not liveness(snap, time.time())[1]:
        return None
    models: list[dict[str, Any]] = [{"name": m.model, "version": m.version, "state": m.state, "reason": m.reason,
               "backend": m.backend or None, "device": m.device or None, "precision": m.precision or None,
               "variant": None, "skipped": [], **({"warmup": m.warmup} if m.warmup else {}),
               **({"note": m.note} if m.note else {}),
               **({"chosen_how": m.choice} if m.choice else {})} for m in snap.models]
    return models, f"the running daemon (pid {snap.pid})"


def _local_models(cfg: Any) -> tuple[list[dict[str, Any]], str, str]:
    """Load every model exactly as the daemon does, self-test included."""
    from edged.daemon import SELF_TEST_TIMEOUT_S, build_runtime
    from edged.systemd.health import self_test

    rt = build_runtime(cfg)
    try:
        self_test(rt.service, rt.service.versions(), SELF_TEST_TIMEOUT_S)
        return rt.service.statuses(), "loaded here as the daemon loads them (no daemon is running)", rt.profile.name
    finally:
        rt.manager.shutdown()


def cmd_models_list(args: argparse.Namespace) -> int:
    cfg = _config(args)
    running = _running_daemon_models(cfg)
    if args.remeasure:
        select_dir = cfg.cache_dir / "select"
        removed = list(select_dir.glob("*.json")) if select_dir.is_dir() else []
        for f in removed:
            f.unlink(missing_ok=True)
        print(f"forgot {len(removed)} remembered engine choice(s); "
              + ("restart the daemon (or reload the models) to measure again" if running else "measuring again"),
              file=sys.stderr)
    profile = ""
    if running is not None:
        statuses, source = running
    else:
        statuses, source, profile = _local_models(cfg)
    if args.json:
        print(json.dumps({"profile": profile or None, "source": source, "models": statuses}, indent=2))
        return 0
    print(f"models as seen by {source}")
    rows = [("MODEL", "VERSION", "STATE", "ENGINE", "VARIANT", "REASON")]
    for s in statuses:
        engine = f"{s['backend']}/{s['device']}/{s['precision']}" if s["backend"] else "-"
        rows.append((str(s["name"]), str(s["version"]), str(s["state"]), engine, str(s["variant"] or "-"),
                     str(s["reason"] or "")))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + ("  " + r[5] if r[5] else ""))
    for s in statuses:
        skipped: Any = s["skipped"]
        for sk in skipped:
            print(f"  {s['name']} v{s['version']}: skipped {sk['candidate']}: {sk['reason']}")
        if s.get("warmup"):
            print(f"  {s['name']} v{s['version']}: {s['warmup']}")
        if s.get("note"):
            print(f"  {s['name']} v{s['version']}: {s['note']}")
        if s.get("chosen_how"):
            print(f"  {s['name']} v{s['version']}: {s['chosen_how']}")
        for note in s.get("notes") or []:
            print(f"  {s['name']} v{s['version']}: {note}")
        placed: Any = s.get("engine_processes")
        if placed:
            print(f"  {s['name']} v{s['version']}: {_processes_line(placed)}")
    return 0


def _processes_line(p: dict[str, Any]) -> str:
    """Where the engine runs when it has worker processes ([limits] engine_processes)."""
    if p.get("running"):
        pids = ", ".join(f"{w['pid']}" + (f" ({w['restarts']} restart(s))" if w["restarts"] else "")
                         for w in p["workers"])
        where = f"in {p['count']} engine process(es) of {p['threads']} thread(s) (pids {pids})"
    else:
        where = (f"{p['count']} engine process(es) of {p['threads']} thread(s) start when requests overlap"
                 + (f" (the last start failed: {p['start_error']})" if p.get("start_error") else ""))
    return f"{where}; {p['calls_in_daemon']} lone call(s) ran in the daemon's own copy"


MAX_MEDIA_FILE = 256 << 20  # an image or sound for one request; checked before reading


def _media_file(path: Path) -> str | None:
    """The media type of an image/sound file given as --input (by its first bytes), None for .npy/.npz."""
    from edged.protocol.media import sniff_media_type

    try:
        with path.open("rb") as f:
            return sniff_media_type(f.read(12))
    except OSError as e:
        raise EdgedError(f"{path}: cannot read: {e.strerror}") from None


def _read_media(path: Path, model: str, specs: Any) -> dict[str, Any]:
    from edged.protocol.media import media_input, media_tensor

    name = media_input(model, [(s.name, s.datatype) for s in specs])
    try:
        size = path.stat().st_size
        if size > MAX_MEDIA_FILE:
            raise EdgedError(f"{path}: {size} bytes, more than {MAX_MEDIA_FILE} for one request")
        return {name: media_tensor(path.read_bytes())}
    except OSError as e:
        raise EdgedError(f"{path}: cannot read: {e.strerror}") from None


def _read_inputs(path: Path, specs: Any, max_batch_size: int, model: str = "") -> dict[str, Any]:
    import numpy as np

    from edged import datatypes

    if _media_file(path) is not None:
        return _read_media(path, model, specs)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise EdgedError(f"{path}: cannot read as .npy/.npz: {e}") from None
    if isinstance(loaded, np.ndarray):
        if len(specs) != 1:
            raise EdgedError(f"the model has {len(specs)} inputs; give an .npz with arrays named "
                             f"{[s.name for s in specs]}")
        arrays = {specs[0].name: loaded}
    else:
        with loaded:
            arrays = {k: loaded[k] for k in loaded.files}
    out = {}
    for spec in specs:
        if spec.name not in arrays:
            continue
        arr = arrays[spec.name]
        want = datatypes.to_numpy(spec.datatype)
        if arr.dtype != want and np.can_cast(arr.dtype, want, "same_kind"):
            arr = arr.astype(want)
        if max_batch_size > 0 and arr.ndim == len(spec.shape):
            arr = arr[np.newaxis]  # a single sample: add the batch dimension
        out[spec.name] = np.require(arr, requirements="C")  # keeps a scalar a scalar
    for k, v in arrays.items():
        out.setdefault(k, v)
    return out


def _print_outputs(resp: Any, where: str, max_batch_size: int, labels: list[str]) -> None:
    import numpy as np

    print(f"model {resp.model} version {resp.version} {where}")
    for name, arr in resp.outputs.items():
        print(f"{name}: shape {list(arr.shape)} {arr.dtype}")
        if arr.ndim == 2 and arr.dtype.kind == "f" and max_batch_size > 0:
            for i, row in enumerate(arr):
                k = int(np.argmax(row))
                label = f" ({labels[k]})" if k < len(labels) and labels[k] else ""
                print(f"  [{i}] class {k}{label} score {float(row[k]):.4f}")
        else:
            print(np.array2string(arr, threshold=64))


def _infer_remote(args: argparse.Namespace) -> tuple[Any, int]:
    from edged.protocol.types import InferResponse
    from edged.remote_model import RemoteModel, specs_from_metadata

    remote = RemoteModel(_config(args), args.transport)
    try:
        meta = remote.metadata(args.model, args.model_version)
        specs, mbs = specs_from_metadata(meta)
        inputs = _read_inputs(args.input, specs, mbs, args.model)
        outputs = remote.infer(args.model, inputs, args.model_version)
    finally:
        remote.close()
    version = meta.get("version") or (meta.get("versions") or ["0"])[-1]
    return InferResponse(args.model, int(args.model_version or version), outputs), mbs


def cmd_infer(args: argparse.Namespace) -> int:
    from edged.protocol.types import InferRequest
    from edged.protocol.v2 import response_json

    labels: list[str] = []
    if args.transport != "local":
        resp, mbs = _infer_remote(args)
        where = f"via {args.transport}"
    else:
        from edged.daemon import build_runtime

        rt = build_runtime(_config(args), only=args.model)
        try:
            mv = rt.service.ready_model(args.model, args.model_version)
            inputs = _read_inputs(args.input, mv.inputs, mv.max_batch_size, args.model)
            resp = rt.service.infer(InferRequest(model=args.model, version=args.model_version, inputs=inputs))
        finally:
            rt.manager.shutdown()
        mbs = mv.max_batch_size
        where = "as a pipeline" if mv.pipeline is not None else f"on {mv.candidate.label if mv.candidate else '?'}"
        if mv.entry.manifest is not None and mv.manifest.labels:
            labels = (mv.entry.path / mv.manifest.labels).read_text().split("\n")
    media_type = _media_file(args.input)
    if args.json:
        print(json.dumps(response_json(resp)))
    elif media_type is not None:
        from edged.protocol.media import answer

        print(json.dumps(answer(resp.model, resp.version, resp.outputs, media=media_type), indent=1))
    else:
        _print_outputs(resp, where, mbs, labels)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from edged.daemon import run
    from edged.native_stderr import capture

    cfg = _config(args)
    overrides = dict(args.sync_set)
    native = capture()  # engine libraries' stderr (ONNX Runtime's coloured lines) into the daemon log
    try:
        return run(cfg, overrides)
    finally:
        if native is not None:
            native.close()


# What the 'device' extra brings (pyproject.toml): a command that needs one of them says which extra to install.
DEVICE_EXTRA_MODULES = frozenset({"onnxruntime", "paho", "psutil", "prometheus_client"})


def main(argv: list[str] | None = None) -> int:
    from edged.logs import setup_logging

    args = build_parser().parse_args(argv)
    level = args.log_level
    try:
        if args.command == "config":
            return cmd_config_check(args)
        cfg_level = None
        if level is None and args.command == "run":
            cfg_level = _config(args).logging.level
        setup_logging(level or cfg_level or ("info" if args.command == "run" else "warning"))
        from edged import status as status_command
        from edged.optimize import command as optimize_command
        from edged.perf import command as perf_command

        handlers = {"run": cmd_run, "detect": cmd_detect, "infer": cmd_infer, "optimize": optimize_command.run,
                    "status": status_command.run, "perf": perf_command.run}
        if args.command == "models":
            return cmd_models_list(args)
        return handlers[args.command](args)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in DEVICE_EXTRA_MODULES:
            raise
        print(f"error: edged {args.command} needs {top!r}, part of the 'device' extra, which is not installed "
              "here: pip install 'edged[device]', or use ./install.sh or the .deb", file=sys.stderr)
        return 1
    except EdgedError as e:
        return exit_status(e)
    except KeyboardInterrupt:
        return 130
