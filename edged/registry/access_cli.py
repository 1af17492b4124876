"""``edged-registry token create|list|revoke`` and ``edged-registry audit``: named API tokens, and who did what.

A token is printed once, when it is made; the registry keeps only its sha256. Give it to its
holder as ``EDGED_REGISTRY_TOKEN`` or ``--token-file``: every change they make is in the audit
log under the token's name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from edged.registry.cli_format import ago, table
from edged.registry.roles import ROLES

Printer = Callable[[argparse.Namespace, Any, Callable[[], str]], None]


def add_parser(sub: Any, client_args: Callable[[argparse.ArgumentParser], None]) -> None:
    tok = sub.add_parser("token", help="named API tokens with a role (viewer, releaser, admin)")
    tsub = tok.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    p = tsub.add_parser("create", help="make a token and print it (only this once)")
    client_args(p)
    p.add_argument("name", help="who holds it (the audit log names their actions so)")
    p.add_argument(
        "--role",
        required=True,
        choices=list(ROLES),
        help="viewer: reads everything; releaser: also releases and rollouts; admin: everything",
    )
    p = tsub.add_parser("list", help="every token, with its role and whether it is revoked")
    client_args(p)
    p = tsub.add_parser("revoke", help="revoke a token now (its name stays in the audit log)")
    client_args(p)
    p.add_argument("name")

    p = sub.add_parser("audit", help="who changed what, newest first")
    client_args(p)
    p.add_argument("--limit", type=int, default=50, help="entries to show (default 50, at most 1000)")
    p.add_argument("--offset", type=int, default=0, help="skip this many of the newest first")


def run_token(args: argparse.Namespace, client: Callable[[], Any], out: Printer) -> int:
    with client() as c:
        if args.token_command == "create":
            made = c.create_token(args.name, args.role)
            out(args, made, lambda: made.token)
        elif args.token_command == "revoke":
            info = c.revoke_token(args.name)
            out(args, info, lambda: f"token {info.name} revoked")
        else:
            tokens = c.tokens()
            out(
                args,
                tokens,
                lambda: (
                    table(
                        [("NAME", "ROLE", "CREATED", "BY", "REVOKED")]
                        + [
                            (
                                t.name,
                                t.role,
                                ago(t.created_at),
                                t.created_by,
                                ago(t.revoked_at) if t.revoked_at else "-",
                            )
                            for t in tokens
                        ]
                    )
                    or "no token"
                ),
            )
    return 0


def run_audit(args: argparse.Namespace, client: Callable[[], Any], out: Printer) -> int:
    with client() as c:
        page = c.audit(args.limit, args.offset)
    out(
        args,
        page,
        lambda: (
            table(
                [("WHEN", "ACTOR", "ROLE", "FROM", "ACTION", "TARGET", "REASON")]
                + [(ago(e.at), e.actor, e.role, e.source, e.action, e.target, e.reason) for e in page.entries]
            )
            if page.entries
            else "the audit log is empty"
        ),
    )
    return 0
