"""``edged-registry rollout create|status|list|pause|resume|abort|rollback|evaluate``.

Steps are written as a comma-separated list: ``1%`` (a share of the target, stable
hashing), ``label:ring=canary`` or ``label:site=a+hw=orin`` (an explicit group),
``devices:cam-1+cam-2``; each may end with ``/min=N``, ``/soak=DURATION``, ``/failure=RATE`` and
``/reporting=N``, which override ``--min-devices``, ``--soak``, ``--max-failure-rate`` and
``--min-reporting`` for that step. ``--start-at`` schedules the start. Example::

    edged-registry rollout create digits 3 --key op.key --steps "devices:lab-1/failure=0,1%/min=5,10%,50%,100%" \\
        --soak 15m --target-profile 'jetson-orin*' --target-label site=plant-4 --max-p99-ratio 1.5 --start-at +2h
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edged.errors import ConfigError
from edged.registry.cli_format import ago, table, until, utc, wrapped
from edged.registry.rollout_wire import PROGRESS, Gates, RolloutCreate, RolloutInfo, RolloutStatus
from edged.registry.step_syntax import parse_steps, start_time
from edged.registry.targets import RolloutTarget

TERMINAL = ("halted", "aborted", "rolled-back", "completed")
HEADINGS = {"pending": "PENDING", "updating": "UPDATING", "in_trial": "IN TRIAL", "committed": "COMMITTED",
            "rolled_back": "ROLLED BACK", "failed": "FAILED", "not_started": "NOT STARTED"}


def _rate(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


def add_parser(sub: Any, client_args: Callable[[argparse.ArgumentParser], None],
               duration: Callable[[str], float], label: Callable[[str], tuple[str, str]]) -> None:
    ro = sub.add_parser("rollout", help="roll a release out in steps with health gates")
    rsub = ro.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")

    p = rsub.add_parser("create", help="sign a release of a pushed version and start its rollout "
                                       "(or roll out an existing release with --release)")
    client_args(p)
    p.add_argument("model")
    p.add_argument("model_version", type=int, nargs="?", default=None, metavar="VERSION")
    p.add_argument("--key", type=Path, default=None, help="your private signing key (never sent)")
    p.add_argument("--release", type=int, default=None, help="roll out this existing release instead of signing")
    p.add_argument("--steps", default="1%,10%,50%,100%", help="default 1%%,10%%,50%%,100%% (see the module help)")
    p.add_argument("--soak", type=duration, default=duration("10m"), help="soak time per step (default 10m)")
    p.add_argument("--min-devices", type=int, default=1, help="per step (default 1)")
    p.add_argument("--target-label", type=label, action="append", default=[], help="key=value (globs allowed)")
    p.add_argument("--target-fact", type=label, action="append", default=[],
                   help="reported fact=value, e.g. jetson.module='*Orin Nano*'")
    p.add_argument("--target-profile", action="append", default=[], help="device profile name (globs allowed)")
    p.add_argument("--target-device", action="append", default=[], help="only these device ids")
    p.add_argument("--max-failure-rate", type=_rate, default=0.1, help="default 0.1; 'none' disables")
    p.add_argument("--max-error-rate", type=_rate, default=None, help="telemetry, over the previous version")
    p.add_argument("--max-p99-ratio", type=_rate, default=None, help="telemetry, against the previous version")
    p.add_argument("--p99-floor-ms", type=float, default=10.0)
    p.add_argument("--min-reporting", type=int, default=3)
    p.add_argument("--min-requests", type=int, default=200)
    p.add_argument("--max-quality-drop", type=_rate, default=None,
                   help="evaluation set: allowed score drop against the last-known-good (e.g. 0.02)")
    p.add_argument("--min-quality", type=_rate, default=None, help="evaluation set: the lowest mean score allowed")
    p.add_argument("--salt", default=None, help="stable-hash salt (default: the model name)")
    p.add_argument("--baseline-version", type=int, default=None)
    p.add_argument("--admit-per-minute", type=float, default=None, metavar="N",
                   help="let each percent step's new devices in at most N a minute (0: all at once; default: the "
                        "registry's rollout_admit_per_minute)")
    p.add_argument("--start-at", default="", metavar="WHEN",
                   help="start later: +2h (from now) or an ISO-8601 time (UTC unless it says otherwise, e.g. "
                        "2026-12-24T18:00Z); until then the rollout is scheduled and admits no device")
    p.add_argument("--notes", default="")
    p.add_argument("--expires", type=duration, default=duration("90d"), help="release validity (default 90d)")
    p.add_argument("--label", type=label, action="append", default=[], help="signed selector, as for release")
    p.add_argument("--device", action="append", default=[], help="signed selector, as for release")
    p.add_argument("--number", type=int, default=None, help="release number (default: the next one)")

    p = rsub.add_parser("status", help="progress per step and the health gates")
    client_args(p)
    p.add_argument("rollout_id", type=int, nargs="?", default=None, help="default: the model's latest rollout")
    p.add_argument("--model", default=None)
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh until the rollout ends")
    p.add_argument("--members", action="store_true", help="also list every member with its progress and trial "
                                                          "figures")

    p = rsub.add_parser("list", help="rollouts, newest last")
    client_args(p)
    p.add_argument("--model", default=None)
    p.add_argument("--state", default=None)

    for action, text in (("pause", "stop taking new steps (members keep updating)"),
                         ("resume", "continue a paused rollout"),
                         ("abort", "stop: no device starts the release any more; those running it keep it"),
                         ("rollback", "stop and tell every member to return to its last-known-good")):
        p = rsub.add_parser(action, help=text)
        client_args(p)
        p.add_argument("rollout_id", type=int)
        p.add_argument("--reason", default="")

    p = rsub.add_parser("evaluate", help="evaluate running rollouts now instead of at the next tick")
    client_args(p)

    p = sub.add_parser("rollback", help="bring an earlier release back to every device, as a new signed release "
                                        "(stops the model's running rollout)")
    client_args(p)
    p.add_argument("model")
    p.add_argument("--to", default="previous", help="the release number to bring back, or 'previous' (default): "
                                                    "the fully rolled-out release before the current one")
    p.add_argument("--key", type=Path, default=None, help="your private signing key (never sent; not needed "
                                                         "with --dry-run)")
    p.add_argument("--reason", default="")
    p.add_argument("--expires", type=duration, default=duration("90d"), help="release validity (default 90d)")
    p.add_argument("--label", type=label, action="append", default=[],
                   help="signed selector (default: the earlier release's)")
    p.add_argument("--device", action="append", default=[], help="signed selector (default: the earlier release's)")
    p.add_argument("--dry-run", action="store_true", help="show which release would come back, sign nothing")


def build_spec(args: argparse.Namespace, duration: Callable[[str], float]) -> RolloutCreate:
    target = RolloutTarget(labels=dict(args.target_label), facts=dict(args.target_fact),
                           profiles=list(args.target_profile), devices=list(args.target_device))
    gates = Gates(max_failure_rate=args.max_failure_rate, max_error_rate=args.max_error_rate,
                  max_p99_ratio=args.max_p99_ratio, p99_floor_ms=args.p99_floor_ms,
                  min_reporting=args.min_reporting, min_requests=args.min_requests,
                  max_quality_drop=args.max_quality_drop, min_quality=args.min_quality)
    steps = parse_steps(args.steps, soak_s=args.soak, min_devices=args.min_devices, duration=duration)
    # Without --release the client signs a new release and puts it in ``signed`` (release 0 is a placeholder).
    return RolloutCreate(model=args.model, release=args.release if args.release is not None else 0, target=target,
                         steps=steps, gates=gates, salt=args.salt, baseline_version=args.baseline_version,
                         notes=args.notes, admit_per_minute=args.admit_per_minute,
                         start_at=start_time(args.start_at))


# ---- display --------------------------------------------------------------------------------------
def format_info(r: RolloutInfo) -> str:
    if r.state == "scheduled":
        step = f"starts {utc(r.start_at)} ({until(r.start_at)})"
    else:
        step = f"step {min(r.step + 1, len(r.steps))}/{len(r.steps)}"
    return (f"rollout {r.id}  model {r.model}  release {r.release} (version {r.version})  {r.state}  {step}"
            + (f"  - {r.reason}" if r.reason and r.state != "running" else ""))


def format_status(st: RolloutStatus) -> str:
    r = st.rollout
    lines = [format_info(r),
             f"target: {r.target.describe()} ({st.targeted} device(s)); gates: {r.gates.describe()}; "
             + (f"scheduled: starts {utc(r.start_at)} ({until(r.start_at)}), no device before then"
              if r.state == "scheduled" else f"started {ago(r.start_at or r.created_at)}")]
    rows: list[tuple[str, ...]] = [("STEP", "SELECT", "SOAK", "STATUS", "DEVICES", *(HEADINGS[p] for p in PROGRESS))]
    for sp in st.steps:
        status: str = sp.status
        if sp.status == "current" and st.soak_left_s is not None and r.state == "paused":
            status = f"paused, {st.soak_left_s:.0f}s of soak left"
        elif sp.status == "current" and st.soak_left_s is not None:
            status = f"soaking, {st.soak_left_s:.0f}s left"
        elif sp.status == "current" and r.admission is not None:
            status = _admitting(st)
        elif sp.status == "current" and r.state == "running":
            status = "updating"
        elif sp.status == "current":
            status = r.state
        rows.append((str(sp.index + 1), sp.select, f"{sp.soak_s:g}s", status, str(sp.members),
                     *(str(sp.counts.get(p, 0)) for p in PROGRESS)))
    rows.append(("", "total", "", "", str(sum(st.totals.values())), *(str(st.totals.get(p, 0)) for p in PROGRESS)))
    lines.append(table(rows))
    for g in st.gates:
        mark = "ok" if g.ok else ("CROSSED" if g.gate != "min_reporting" else "waiting")
        if not g.judged:
            mark = "not judged yet"
        value = "-" if g.value is None else f"{g.value:.3g}"
        limit = "-" if g.limit is None else f"{g.limit:.3g}"
        lines.append(f"gate {g.gate}: {value} (limit {limit}) {mark}: {g.detail}")
    if r.admission is not None and r.admission.reason:
        lines.append(f"admission held: {r.admission.reason}")
    if st.members:
        lines.append(format_members(st))
    return "\n".join(lines)


def _admitting(st: RolloutStatus) -> str:
    """A step still letting its devices in: how many wait, at what pace, until when."""
    a, r = st.rollout.admission, st.rollout
    assert a is not None
    if a.held:
        return f"admission held, {st.not_admitted} waiting"
    pace = f" at {r.admit_per_minute:g}/min" if r.admit_per_minute else ""
    until = f", all in {max(0.0, a.done_at - time.time()):.0f}s" if a.done_at is not None else ""
    return f"admitting{pace}, {st.not_admitted} waiting{until}"


def format_members(st: RolloutStatus) -> str:
    """One line per member (its trial figures where it reported them), its full reason wrapped below."""
    now = time.time()
    head = ("DEVICE", "STEP", "PROGRESS", "LAST REPORT", "WHEN", "REQUESTS", "ERRORS", "P99 MS")
    rows = [(m.device_id, str(m.step + 1), HEADINGS.get(m.progress, m.progress).lower(), m.report or "-",
             ago(m.at, now) if m.at is not None else "-", "-" if m.requests is None else str(m.requests),
             "-" if m.errors is None else str(m.errors),
             "-" if m.p99_ms is None or not m.requests else f"{m.p99_ms:.1f}")
            for m in st.members]
    rendered = table([head, *rows]).split("\n")
    out = [rendered[0]]
    for line, m in zip(rendered[1:], st.members, strict=True):
        out.append(line)
        if m.reason:
            out += wrapped("reason: ", m.reason, 4)
    return "\n".join(out)


def run(args: argparse.Namespace, client: Callable[[], Any], duration: Callable[[str], float],
        emit: Callable[[argparse.Namespace, Any, Callable[[], str]], None]) -> int:
    cmd = args.rollout_command
    with client() as c:
        if cmd == "create":
            spec = build_spec(args, duration)
            if args.release is not None:
                info = c.create_rollout(spec)
            else:
                if args.model_version is None or args.key is None:
                    raise ConfigError("rollout create: give VERSION and --key (sign a new release), or --release N")
                from edged.protocol.fleet.release import TargetSelector, load_private_key

                info = c.release_with_rollout(load_private_key(args.key), args.model, args.model_version, spec,
                                              expires_in_s=args.expires, number=args.number, notes=args.notes,
                                              selector=TargetSelector(labels=dict(args.label),
                                                                      devices=list(args.device)))
            emit(args, info, lambda: format_info(info) + ("" if info.state == "scheduled" else
                                                          f"\n{info.members} device(s) in the first step"))
            return 0
        if cmd == "list":
            items = c.rollouts(args.model, args.state)
            emit(args, items, lambda: "\n".join(format_info(r) for r in items) or "no rollouts")
            return 0
        if cmd == "evaluate":
            changes = c.evaluate_rollouts()
            emit(args, changes, lambda: json.dumps(changes) if changes else "no change")
            return 0
        if cmd == "status":
            rid = args.rollout_id
            if rid is None:
                items = c.rollouts(args.model)
                if not items:
                    raise ConfigError("no rollouts" + (f" of model {args.model!r}" if args.model else ""))
                rid = items[-1].id
            while True:
                st = c.rollout(rid, members=args.members)
                if args.watch is not None and not args.json:
                    print("\033[2J\033[H", end="")
                shown = format_status(st)

                def text(shown: str = shown) -> str:
                    return shown

                emit(args, st, text)
                if args.watch is None or st.rollout.state in TERMINAL:
                    return 0
                time.sleep(args.watch)
        info = c.rollout_action(args.rollout_id, cmd, args.reason)
        emit(args, info, lambda: format_info(info))
        return 0


def run_rollback(args: argparse.Namespace, client: Callable[[], Any],
                 emit: Callable[[argparse.Namespace, Any, Callable[[], str]], None]) -> int:
    with client() as c:
        if args.dry_run:
            plan = c.rollback_plan(args.model, args.to)
            emit(args, plan, lambda: f"model {plan.model}: release {plan.current_release} (version "
                                     f"{plan.current_version}) -> release {plan.to_release} (version {plan.version}) "
                                     f"as new release {plan.next_release}")
            return 0
        if args.key is None:
            raise ConfigError("rollback: --key is required to sign the release that brings the version back")
        from edged.protocol.fleet.release import TargetSelector, load_private_key

        selector = (TargetSelector(labels=dict(args.label), devices=list(args.device))
                    if args.label or args.device else None)
        out = c.rollback(load_private_key(args.key), args.model, args.to, reason=args.reason,
                         expires_in_s=args.expires, selector=selector)
        emit(args, out, lambda: f"model {out.model}: release {out.restores} (version {out.version}) is back as "
                                f"release {out.release}" + (f"; rolled back rollout(s) "
                                                            f"{', '.join(map(str, out.stopped_rollouts))}"
                                                            if out.stopped_rollouts else ""))
        return 0
