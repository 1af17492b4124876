"""``python -m edged.sync_runner --config PATH``: the daemon with the sync agent, boot checks first.

``edged run`` does the same once the daemon wires the agent in; this entry point makes
the order explicit (crash-loop check and version pins before any model is loaded) and
is what the fault-injection tests start.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from edged.config import Config, load_config
from edged.daemon import Daemon, Runtime
from edged.errors import EdgedError, exit_status
from edged.sync.settings import SyncSettings
from edged.transports.base import Transport


class SyncDaemon(Daemon):
    def __init__(self, cfg: Config, settings: SyncSettings | None) -> None:
        super().__init__(cfg)
        self.sync_settings = settings

    def _make_transports(self, rt: Runtime) -> list[Transport]:
        from edged.sync.agent import SyncAgent, device_facts

        out = super()._make_transports(rt)
        if self.sync_settings is not None:
            out = [t for t in out if not isinstance(t, SyncAgent)]  # ours carries the --set options
            out.append(SyncAgent(self.cfg, rt.service, settings=self.sync_settings,
                                 facts=device_facts(rt.facts, rt.profile.name)))
        return out


def main(argv: list[str] | None = None) -> int:
    from edged.logs import setup_logging
    from edged.sync.boot import prepare_boot

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
            settings = SyncSettings.from_config(cfg, overrides)
            prepare_boot(cfg, settings)
        return asyncio.run(SyncDaemon(cfg, settings).serve())
    except EdgedError as e:
        return exit_status(e)


if __name__ == "__main__":
    raise SystemExit(main())
