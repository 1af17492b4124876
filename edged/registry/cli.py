"""The ``edged-registry`` command: run the server, and publish to / inspect a running one."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged import __version__
from edged.errors import ConfigError, EdgedError, exit_status

if TYPE_CHECKING:
    from edged.registry.settings import RegistrySettings

URL_ENV = "EDGED_REGISTRY_URL"
CA_ENV = "EDGED_REGISTRY_CA_FILE"
CLIENT_CERT_ENV = "EDGED_REGISTRY_CLIENT_CERT"
CLIENT_KEY_ENV = "EDGED_REGISTRY_CLIENT_KEY"
TOKEN_ENV = "EDGED_REGISTRY_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8700"
def parse_duration(text: str) -> float:
    """``90``, ``15m``, ``2h``, ``90d`` -> seconds, as the rollout step syntax reads them (one grammar)."""
    from edged.registry.step_syntax import duration_s

    try:
        return duration_s(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value")
    return key, value


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL), help=f"registry URL (env {URL_ENV})")
    p.add_argument("--token-file", type=Path, default=None,
                   help=f"file holding your API token or the admin token (else env {TOKEN_ENV})")
    p.add_argument("--ca-file", type=Path, default=os.environ.get(CA_ENV) or None,
                   help=f"CA bundle of an https registry's certificate (env {CA_ENV}; default: the system's)")
    p.add_argument("--client-cert", type=Path, default=os.environ.get(CLIENT_CERT_ENV) or None,
                   help=f"certificate for a registry that requires one (env {CLIENT_CERT_ENV})")
    p.add_argument("--client-key", type=Path, default=os.environ.get(CLIENT_KEY_ENV) or None,
                   help=f"private key of --client-cert (env {CLIENT_KEY_ENV})")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=None, help="registry TOML file ([registry] table)")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--database-url", default=None, help="sqlite:///path or postgresql://user@host/db")
    p.add_argument("--blob-dir", type=Path, default=None)
    p.add_argument("--admin-token-file", type=Path, default=None)
    p.add_argument("--public-key", action="append", default=None, dest="public_keys",
                   help="trusted release key (base64); repeatable")


def build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915  one flat block per command, read as a table
    parser = argparse.ArgumentParser(prog="edged-registry", description="Central model registry for edged devices.")
    parser.add_argument("--version", action="version", version=f"edged-registry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the registry HTTP API")
    _server_args(p)
    p.add_argument("--listen", default=None, help="host:port (default 127.0.0.1:8700); beyond loopback use TLS")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain) to serve HTTPS with")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="require client certificates signed by this CA (devices: [registry] client_cert/client_key)")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p.add_argument("--rollout-tick", type=parse_duration, default=None, dest="rollout_tick_s",
                   help="how often running rollouts are evaluated (default 2s)")
    p.add_argument("--dashboard-poll", type=parse_duration, default=None, dest="dashboard_poll_s",
                   help="how often an open dashboard page asks for changes (default 5s)")
    p.add_argument("--blob-listen", default=None,
                   help="host:port: start a blob server process there and redirect devices' downloads to it")
    p.add_argument("--blob-url", default=None, help="base URL devices fetch blobs from (a proxy in front of it)")

    p = sub.add_parser("serve-blobs", help="serve release files for URLs the API signed (serve --blob-listen "
                                           "starts one itself)")
    _server_args(p)
    p.add_argument("--blob-listen", default=None, help="host:port (or [registry] blob_listen)")
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--tls-client-ca", type=Path, default=None)
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p.add_argument("--exit-with", type=int, default=None, help=argparse.SUPPRESS)

    p = sub.add_parser("migrate", help="upgrade the database schema to the newest version")
    _server_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("keygen", help="create an Ed25519 release-signing key pair")
    p.add_argument("--out", type=Path, required=True, help="private key file (PEM, mode 0600); .pub beside it")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    sub.add_parser("operator-hash", help="read a dashboard operator's password (stdin, or asked for on a "
                                         "terminal) and print its hash for [registry.operators]")

    p = sub.add_parser("push", help="upload a model version folder (model.toml and its files)")
    _client_args(p)
    p.add_argument("folder", type=Path, help="<model>/<version> folder")
    p.add_argument("--model", default=None, help="default: the parent folder's name")
    p.add_argument("--model-version", type=int, default=None, dest="model_version",
                   help="default: the folder's name")

    p = sub.add_parser("release", help="sign a release of a pushed version with your key and publish it")
    _client_args(p)
    p.add_argument("model")
    p.add_argument("model_version", type=int, metavar="VERSION")
    p.add_argument("--key", type=Path, required=True, help="your private signing key (never sent)")
    p.add_argument("--expires", type=parse_duration, default=parse_duration("90d"), help="validity (default 90d)")
    p.add_argument("--label", type=parse_label, action="append", default=[], help="target devices with key=value")
    p.add_argument("--device", action="append", default=[], help="target only these device ids")
    p.add_argument("--notes", default="")
    p.add_argument("--number", type=int, default=None, help="release number (default: the next one)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the signed release here instead of publishing it (to start its rollout from the "
                        "dashboard, so no device sees it ungated)")
    p.add_argument("--check-folder", type=Path, default=None,
                   help="refuse to sign unless this local folder matches the pushed version")

    p = sub.add_parser("revoke", help="withdraw a release (devices are not told to go back: release again)")
    _client_args(p)
    p.add_argument("model")
    p.add_argument("release", type=int)

    p = sub.add_parser("releases", help="list a model's releases")
    _client_args(p)
    p.add_argument("model")

    p = sub.add_parser("models", help="list models and versions")
    _client_args(p)

    p = sub.add_parser("devices", help="list enrolled devices and what they run")
    _client_args(p)
    p.add_argument("--label", type=parse_label, action="append", default=[], help="filter by key=value")

    p = sub.add_parser("device", help="one device with its recent events")
    _client_args(p)
    p.add_argument("device_id")
    p.add_argument("--events", type=int, default=50)

    p = sub.add_parser("status", help="per release: how many devices are in which step")
    _client_args(p)
    p.add_argument("model", nargs="?", default=None)

    p = sub.add_parser("telemetry", help="a model's request rate, error rate and latency percentiles, per version")
    _client_args(p)
    p.add_argument("model")
    p.add_argument("--device", default=None, dest="device_id", help="one device only")
    p.add_argument("--version", type=int, default=None, dest="model_version", help="one version only")
    p.add_argument("--since", type=parse_duration, default=parse_duration("1h"),
                   help="how far back (default 1h; e.g. 15m, 24h, 7d)")
    p.add_argument("--label", type=parse_label, action="append", default=[], help="devices with key=value only")

    p = sub.add_parser("enroll-token", help="create an enrollment token for [registry] enrollment_token")
    _client_args(p)
    p.add_argument("--uses", type=int, default=1, help="devices that may enroll with it (default 1)")
    p.add_argument("--ttl", type=parse_duration, default=parse_duration("24h"))
    p.add_argument("--label", type=parse_label, action="append", default=[], help="label given to those devices")

    p = sub.add_parser("label", help="set (key=value) or remove (key=) admin labels of a device")
    _client_args(p)
    p.add_argument("device_id")
    p.add_argument("labels", type=parse_label, nargs="+")

    p = sub.add_parser("reenroll", help="revoke a device's credential now and print a single-use token that "
                                        "enrolls that device id again (lost state, leaked credential)")
    _client_args(p)
    p.add_argument("device_id")
    p.add_argument("--ttl", type=parse_duration, default=parse_duration("24h"))

    p = sub.add_parser("decommission", help="retire a device: revoke its credential, take it out of every "
                                            "rollout, keep its history")
    _client_args(p)
    p.add_argument("device_id")

    p = sub.add_parser("pin", help="pin one device to a release of a model ('none' unpins)")
    _client_args(p)
    p.add_argument("device_id")
    p.add_argument("model")
    p.add_argument("release")

    from edged.registry import access_cli, rollout_cli

    rollout_cli.add_parser(sub, _client_args, parse_duration, parse_label)
    access_cli.add_parser(sub, _client_args)
    return parser


def _settings(args: argparse.Namespace) -> Any:
    from edged.registry.settings import load_settings

    overrides = {k: getattr(args, k, None) for k in ("data_dir", "database_url", "blob_dir", "admin_token_file",
                                                    "public_keys", "listen", "log_level", "rollout_tick_s",
                                                    "dashboard_poll_s", "tls_cert", "tls_key", "tls_client_ca",
                                                    "blob_listen", "blob_url")}
    return load_settings(args.config, overrides)


# Device polls are answered on the event loop while threads store telemetry uploads and reports.
# A thread that wants the interpreter lock waits up to the switch interval (5 ms by default) for a
# busy one to let go, and a poll lets go of it at every SQLite call and socket write, so under a
# fleet's uploads its waits added up to tens of ms at the p99. Half a millisecond keeps them short
# and cost no CPU at 10,000 devices (docs/dashboard.md, "Pages in their own process").
SWITCH_INTERVAL_S = 0.0005


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from edged.listen import parse_listen
    from edged.logs import setup_logging
    from edged.registry.api import create_app

    settings = _settings(args)
    setup_logging(settings.log_level)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if settings.log_level != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)
    _stack_dumps()
    app = create_app(settings)
    where = parse_listen(settings.listen)
    if settings.tls_cert is None and not isinstance(where, Path) and not _loopback(where[0]):
        logging.getLogger("edged.registry").warning(
            "serving plain HTTP on %s: device credentials and tokens cross the network in clear; give "
            "--tls-cert/--tls-key (or [registry] tls_cert/tls_key), or listen on loopback behind a TLS proxy",
            settings.listen)
    blobs = _start_blob_server(settings) if settings.blob_listen is not None else None
    try:
        _run_uvicorn(app, where, settings)
    finally:
        if blobs is not None:
            _stop(blobs)
    return 0


def _stack_dumps() -> None:
    """SIGUSR1 writes every thread's stack to stderr: what a registry that stopped answering waits on."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _start_blob_server(settings: Any) -> Any:
    """``serve-blobs`` as a child process; if it dies, this one stops too (a supervisor restarts both)."""
    import logging
    import signal
    import subprocess
    import threading

    argv = [sys.executable, "-m", "edged.registry", "serve-blobs", "--data-dir", str(settings.data_dir),
            "--blob-dir", str(settings.blobs), "--blob-listen", settings.blob_listen,
            "--log-level", settings.log_level, "--exit-with", str(os.getpid())]
    for flag, value in (("--tls-cert", settings.tls_cert), ("--tls-key", settings.tls_key),
                        ("--tls-client-ca", settings.tls_client_ca)):
        if value is not None:
            argv += [flag, str(value)]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def watch() -> None:
        code = child.wait()
        if not getattr(child, "stopping", False):
            logging.getLogger("edged.registry").error("the blob server (%s) exited with status %s; stopping",
                                                      settings.blob_listen, code)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="blob-server-watch", daemon=True).start()
    return child


def _stop(child: Any) -> None:
    import subprocess

    child.stopping = True
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def cmd_serve_blobs(args: argparse.Namespace) -> int:
    import logging

    from edged.listen import parse_listen
    from edged.logs import setup_logging
    from edged.registry.blobserve import create_blob_app, exit_with_parent
    from edged.registry.settings import load_settings

    overrides = {k: getattr(args, k, None) for k in ("data_dir", "blob_dir", "blob_listen", "log_level", "tls_cert",
                                                    "tls_key", "tls_client_ca")}
    settings = load_settings(args.config, overrides)
    if settings.blob_listen is None:
        raise ConfigError("serve-blobs: give --blob-listen (or [registry] blob_listen)")
    setup_logging(settings.log_level)
    settings.prepare_storage()
    app = create_blob_app(settings)
    if args.exit_with is not None:
        exit_with_parent(args.exit_with)
    logging.getLogger("edged.registry").info("blob server on %s", settings.blob_listen)
    _run_uvicorn(app, parse_listen(settings.blob_listen), settings)
    return 0


def _run_uvicorn(app: Any, where: tuple[str, int] | Path, settings: RegistrySettings) -> None:
    """The API and the blob server alike: on a Unix socket or host:port, with the settings' options."""
    import uvicorn

    if isinstance(where, Path):
        uvicorn.run(app, uds=str(where), **settings.uvicorn_options())
    else:
        uvicorn.run(app, host=where[0], port=where[1], **settings.uvicorn_options())


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_migrate(args: argparse.Namespace) -> int:
    from edged.registry.db import make_engine
    from edged.registry.migrate import current_revision, upgrade

    settings = _settings(args)
    engine = make_engine(settings.db_url)
    upgrade(engine)
    rev = current_revision(engine)
    _print(args, {"revision": rev}, lambda: f"schema at revision {rev}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from edged.fsutil import atomic_write_bytes, atomic_write_text
    from edged.protocol.fleet.release import generate_private_key, private_key_pem, public_key_b64

    out: Path = args.out
    if out.exists():
        print(f"{out} exists; refusing to overwrite a signing key", file=sys.stderr)
        return 1
    key = generate_private_key()
    atomic_write_bytes(out, private_key_pem(key), mode=0o600)
    pub = public_key_b64(key)
    atomic_write_text(out.with_name(out.name + ".pub"), pub + "\n")
    _print(args, {"public_key": pub, "private_key_file": str(out), "public_key_file": str(out) + ".pub"},
           lambda: pub)
    return 0


def _client(args: argparse.Namespace) -> Any:
    from edged.registry.admin_client import RegistryClient

    if args.token_file is not None:
        token = args.token_file.read_text(encoding="utf-8").strip()
    else:
        token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(f"no token: give --token-file or set {TOKEN_ENV}")
    return RegistryClient(args.url, token, ca_file=args.ca_file, client_cert=args.client_cert,
                          client_key=args.client_key, source="cli")


def _print(args: argparse.Namespace, obj: Any, text: Callable[[], str]) -> None:
    from pydantic import BaseModel

    if args.json:
        data = [o.model_dump(mode="json") for o in obj] if isinstance(obj, list) else (
            obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj)
        print(json.dumps(data, indent=2))
    else:
        print(text())


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def cmd_operator_hash(args: argparse.Namespace) -> int:
    from edged.registry.passwords import hash_password

    if sys.stdin.isatty():
        import getpass

        password = getpass.getpass("operator password: ")
        if getpass.getpass("again: ") != password:
            print("the two passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    try:
        print(hash_password(password))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    folder: Path = args.folder.resolve()
    model = args.model or folder.parent.name
    version = args.model_version if args.model_version is not None else int(folder.name) if folder.name.isdigit() \
        else None
    if version is None:
        raise ConfigError(f"{folder.name!r} is not a version number; give --model-version")
    with _client(args) as c:
        info = c.push_folder(folder, model, version)
    _print(args, info, lambda: f"model {model} version {version}: {len(info.files)} files, {info.total_size} bytes"
           + (" (created)" if info.created else " (already there, identical)"))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from edged.protocol.fleet.release import TargetSelector, load_private_key

    key = load_private_key(args.key)
    selector = TargetSelector(labels=dict(args.label), devices=list(args.device))
    if args.out is not None:
        from edged.fsutil import atomic_write_text

        with _client(args) as c:
            signed = c.sign(key, args.model, args.model_version, expires_in_s=args.expires, selector=selector,
                            notes=args.notes, number=args.number)
        atomic_write_text(args.out, signed.model_dump_json(indent=1))
        print(f"release {signed.unverified().release} of model {args.model} signed, not published: {args.out}")
        return 0
    with _client(args) as c:
        info = c.release(key, args.model, args.model_version, expires_in_s=args.expires, selector=selector,
                         notes=args.notes, number=args.number, check_folder=args.check_folder)
    _print(args, info, lambda: f"release {info.release} of model {info.model}: version {info.version}, "
           f"signed by key {info.key_id}, expires {_utc(info.expires_at)}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.revoke(args.model, args.release)
    _print(args, info, lambda: f"release {info.release} of model {info.model} revoked")
    return 0


def _utc(t: float) -> str:
    from edged.registry.cli_format import utc

    return utc(t)


def cmd_releases(args: argparse.Namespace) -> int:
    from edged.registry.cli_format import utc

    with _client(args) as c:
        rels = c.releases(args.model)
    rows = [("RELEASE", "VERSION", "STATE", "EXPIRES", "KEY", "SELECTOR", "NOTES")]
    rows += [(str(r.release), str(r.version), r.state or ("revoked" if r.revoked else "-"), utc(r.expires_at),
              r.key_id, json.dumps(r.selector.model_dump(), separators=(",", ":")), r.notes or "-")
             for r in rels]
    _print(args, rels, lambda: _table(rows))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    with _client(args) as c:
        models = c.models()
    rows = [("MODEL", "VERSIONS", "LATEST RELEASE")]
    rows += [(m.name, ",".join(map(str, m.versions)), str(m.latest_release or "-")) for m in models]
    _print(args, models, lambda: _table(rows))
    return 0


def _model_lines(d: Any) -> list[tuple[str, Any, Any]]:
    """Per model of a device: (model, what it serves, its last report), models from either side."""
    serving = {sv.model: sv for sv in d.serving}
    reports = {m.model: m for m in d.models}
    return [(name, serving.get(name), reports.get(name)) for name in sorted(set(serving) | set(reports))]


def _report(m: Any) -> str:
    if m is None or m.state is None:
        return "-"
    return f"{m.state} r{m.release}" if m.release is not None else m.state


def cmd_devices(args: argparse.Namespace) -> int:
    from edged.registry.cli_format import ago, table, version_ref, wrapped

    with _client(args) as c:
        devs = c.devices(dict(args.label))

    def text() -> str:
        now = time.time()
        head = ("DEVICE", "MODEL", "SERVING", "ENGINE", "DESIRED", "LAST REPORT", "LAST CONTACT")
        blocks: list[tuple[tuple[str, ...], list[str]]] = []
        for d in devs:
            seen = ago(d.last_seen_at, now)
            lines = _model_lines(d)
            if not lines:
                blocks.append(((d.device_id, "-", "-", "-", "-", "-", seen), []))
            for name, sv, rep in lines:
                serving = "not serving" if sv is None or sv.state == "not serving" else (
                    version_ref(sv.version, sv.release) + (" trial" if sv.state == "trial" else "")
                    + (" local" if sv.state == "local" else ""))
                desired = version_ref(sv.desired_version, sv.desired_release) if sv is not None else "-"
                row = (d.device_id, name, serving, (sv.engine if sv else None) or "-", desired, _report(rep), seen)
                reason = wrapped("reason: ", rep.reason, 4) if rep is not None and rep.reason else []
                blocks.append((row, reason))
        if not blocks:
            return "no devices"
        rendered = table([head, *(r for r, _ in blocks)]).split("\n")
        out = [rendered[0]]
        for line, (_row, reason) in zip(rendered[1:], blocks, strict=True):
            out += [line, *reason]
        return "\n".join(out)

    _print(args, devs, text)
    return 0


def cmd_device(args: argparse.Namespace) -> int:
    from edged.registry.cli_format import ago, utc, version_ref, wrapped

    with _client(args) as c:
        d = c.device(args.device_id, args.events)

    def text() -> str:
        now = time.time()
        lines = [f"device {d.device_id}",
                 f"  last contact {ago(d.last_seen_at, now)} ({utc(d.last_seen_at)}), enrolled {utc(d.enrolled_at)}",
                 f"  labels {json.dumps(d.labels, sort_keys=True)}",
                 f"  profile {d.facts.get('profile', 'unknown')}"]
        for name, sv, rep in _model_lines(d):
            lines.append(f"model {name}")
            if sv is not None and sv.state != "not serving":
                lines.append(f"  serving {version_ref(sv.version, sv.release)} ({sv.state}), engine {sv.engine or '-'}")
            else:
                lines.append("  serving nothing")
            if sv is not None:
                lines.append(f"  desired {version_ref(sv.desired_version, sv.desired_release)}"
                             if sv.desired_release is not None else "  desired: nothing offered")
            if rep is not None and rep.state is not None:
                lines.append(f"  last report {_report(rep)} (v{rep.version}) {ago(rep.updated_at, now)}"
                             + (f", pinned to r{rep.pinned_release}" if rep.pinned_release else ""))
                if rep.reason:
                    lines += wrapped("reason: ", rep.reason, 4)
        if d.events:
            lines.append(f"events (last {len(d.events)}, oldest first)")
        for e in d.events:
            lines.append(f"  #{e.seq} {ago(e.received_at, now):>9}  {e.model} {e.step} "
                         f"{version_ref(e.version, e.release)}")
            if e.reason:
                lines += wrapped("reason: ", e.reason, 6)
            if e.logs:
                lines.append(f"      the device's last {len(e.logs)} log line(s):")
                lines += [f"        | {line}" for line in e.logs]
        return "\n".join(lines)

    _print(args, d, text)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.status(args.model)

    def text() -> str:
        lines = [f"{st.devices} device(s)"]
        for m in st.models:
            lines.append(f"model {m.model}")
            later = 0  # devices on releases above this one
            shown: list[str] = []
            for r in reversed(m.releases):
                counts = ", ".join(f"{k} {v}" for k, v in sorted(r.devices.items()))
                if not counts:
                    earlier = f"; {r.committed_ever} device(s) committed it earlier" if r.committed_ever else ""
                    counts = (f"no device on it now{earlier}" if later or r.committed_ever else "no reports yet")
                later += sum(r.devices.values())
                state = r.state or ("revoked" if r.revoked else "")
                shown.append(f"  release {r.release} (version {r.version}{', ' + state if state else ''}): "
                             f"{counts}")
            lines += reversed(shown)
        return "\n".join(lines)

    _print(args, st, text)
    return 0


def cmd_telemetry(args: argparse.Namespace) -> int:
    from edged.registry.cli_format import table

    since = time.time() - args.since
    with _client(args) as c:
        def one(version: int | None) -> Any:
            return c.telemetry_summary(args.model, version=version, device_id=args.device_id, since=since,
                                       labels=dict(args.label))

        total = one(args.model_version)
        per_version = [one(v) for v in total.versions] if args.model_version is None else [total]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    def text() -> str:
        scope = (f"device {args.device_id}" if args.device_id else "all devices") + (
            "".join(f", {k}={v}" for k, v in args.label))
        if not total.samples:
            return f"no telemetry for model {args.model} ({scope}) in the last {args.since:g}s"
        head = ("VERSION", "DEVICES", "REQUESTS", "REQ/S", "ERRORS", "ERROR RATE", "P50 MS", "P90 MS", "P99 MS",
                "ENGINES")
        rows = [head]
        for sm, name in [*((x, str(x.version)) for x in per_version),
                         *([(total, "all")] if len(per_version) > 1 else [])]:
            rows.append((name, str(sm.devices), str(sm.success + sm.failures),
                         "-" if sm.rate_per_s is None else f"{sm.rate_per_s:.2f}", str(sm.failures),
                         "-" if sm.error_rate is None else f"{sm.error_rate:.2%}", ms(sm.p50_s), ms(sm.p90_s),
                         ms(sm.p99_s), ",".join(sm.backends) or "-"))
        lines = [f"model {args.model}, {scope}, last {args.since:g}s "
                 f"({total.samples} window(s) over {total.span_s or 0:.0f}s)", table(rows)]
        codes = ", ".join(f"{k} {v}" for k, v in total.failures_by_code.items())
        if codes:
            lines.append(f"errors by code: {codes}")
        return "\n".join(lines)

    _print(args, per_version if args.model_version is not None or len(per_version) < 2 else [*per_version, total],
           text)
    return 0


def cmd_enroll_token(args: argparse.Namespace) -> int:
    with _client(args) as c:
        tok = c.enrollment_token(args.uses, args.ttl, dict(args.label))
    _print(args, tok, lambda: tok.token)
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    labels: dict[str, str | None] = {k: (v or None) for k, v in args.labels}
    with _client(args) as c:
        d = c.set_labels(args.device_id, labels)
    _print(args, d, lambda: f"device {d.device_id} labels {json.dumps(d.labels)}")
    return 0


def cmd_reenroll(args: argparse.Namespace) -> int:
    with _client(args) as c:
        tok = c.reenroll(args.device_id, args.ttl)
    _print(args, tok, lambda: tok.token)
    return 0


def cmd_decommission(args: argparse.Namespace) -> int:
    with _client(args) as c:
        d = c.decommission(args.device_id)
    _print(args, d, lambda: f"device {d.device_id} decommissioned on {d.labels.get('decommissioned')}: its "
           "credential is revoked, it is in no rollout, its history is kept")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    release = None if args.release.lower() == "none" else int(args.release)
    with _client(args) as c:
        d = c.pin(args.device_id, args.model, release)
    _print(args, d, lambda: f"device {d.device_id}: model {args.model} pinned to {release or 'nothing'}")
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from edged.registry import rollout_cli

    return rollout_cli.run(args, lambda: _client(args), parse_duration, _print)


def cmd_rollback(args: argparse.Namespace) -> int:
    from edged.registry import rollout_cli

    return rollout_cli.run_rollback(args, lambda: _client(args), _print)


def cmd_token(args: argparse.Namespace) -> int:
    from edged.registry import access_cli

    return access_cli.run_token(args, lambda: _client(args), _print)


def cmd_audit(args: argparse.Namespace) -> int:
    from edged.registry import access_cli

    return access_cli.run_audit(args, lambda: _client(args), _print)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": cmd_serve, "serve-blobs": cmd_serve_blobs, "migrate": cmd_migrate, "keygen": cmd_keygen,
    "operator-hash": cmd_operator_hash,
    "push": cmd_push, "release": cmd_release,
    "revoke": cmd_revoke, "releases": cmd_releases, "models": cmd_models, "devices": cmd_devices,
    "device": cmd_device, "status": cmd_status, "telemetry": cmd_telemetry, "enroll-token": cmd_enroll_token,
    "label": cmd_label,
    "reenroll": cmd_reenroll, "decommission": cmd_decommission,
    "pin": cmd_pin, "rollout": cmd_rollout, "rollback": cmd_rollback,
    "token": cmd_token, "audit": cmd_audit,
}


# What the 'registry' extra brings (pyproject.toml): a command that needs one of them says which extra to install.
REGISTRY_EXTRA_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "httpx", "psycopg",
                                    "jinja2"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in REGISTRY_EXTRA_MODULES:
            raise
        print(f"error: edged-registry {args.command} needs {top!r}, part of the 'registry' extra, which is not "
              "installed here: pip install 'edged[registry]' (in edged's environment), or sudo ./install.sh "
              "--registry for a registry service of its own", file=sys.stderr)
        return 1
    except EdgedError as e:
        return exit_status(e)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `edged-registry devices --json | head`: the reader had enough, not an error to show
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush at exit goes nowhere, silently
        return 141  # as a process killed by SIGPIPE (128 + 13), which pipelines expect
