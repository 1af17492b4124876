"""``python -m edged.sync_runner --config PATH``: the daemon with the sync agent, boot checks first.

``edged run`` does the same; this entry point also takes ``--set`` sync settings the config
file cannot hold yet, and is what the fault-injection tests start.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from edged.config import load_config
from edged.daemon import Daemon
from edged.errors import EdgedError, exit_status
from edged.sync.settings import SyncSettings


def main(argv: list[str] | None = None) -> int:
    from edged.logs import setup_logging

    p = argparse.ArgumentParser(prog="python -m edged.sync_runner")
    p.add_argument("--config", "-c", type=Path, required=True)
    p.add_argument("--log-level", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a [registry] sync setting the config file cannot hold yet (e.g. trial_s=2)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        setup_logging(args.log_level or cfg.logging.level)
        settings = None
        if cfg.registry.enabled:
            overrides = dict(item.split("=", 1) for item in args.set)
            settings = SyncSettings.from_config(cfg, overrides)  # the daemon runs the boot checks with them
        return asyncio.run(Daemon(cfg, sync_settings=settings).serve())
    except EdgedError as e:
        return exit_status(e)


if __name__ == "__main__":
    raise SystemExit(main())
