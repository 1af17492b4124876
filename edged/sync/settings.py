"""The device's sync settings: ``[registry]`` from the config, with defaults for keys it may not define yet."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.config import Config
from edged.errors import ConfigError
from edged.protocol.fleet.release import check_public_keys

# Defaults for the [registry] keys beyond enabled/url/enrollment_token/public_keys/poll_interval_s/labels.
DEFAULTS: dict[str, Any] = {
    "trial_s": 60.0,                 # how long a new version is watched before it is committed
    "trial_min_requests": 20,        # fewer requests than this in the trial: error rate and p99 are not judged
    "trial_max_error_rate": 0.01,    # allowed increase of the error rate over the previous version
    "trial_max_p99_ratio": 3.0,      # allowed p99 latency as a multiple of the previous version's
    "trial_p99_floor_ms": 10.0,      # a p99 below this never fails the trial (histogram buckets are coarse)
    "crash_loop_restarts": 3,        # N starts ...
    "crash_loop_window_s": 600.0,    # ... within M seconds after an activation: serve the last-known-good
    "max_download_mb": 2048.0,       # a release larger than this is refused before downloading
    "request_timeout_s": 30.0,
    "retry_max_s": 300.0,            # cap of the exponential back-off when offline or refused
    "download_chunk_kb": 256,
    "ca_file": None,                 # CA bundle for an https registry (default: the system's)
    "client_cert": None,             # certificate (and key) for a registry that requires client certificates
    "client_key": None,
    "mqtt_nudge": False,             # subscribe to <prefix>/<device>/sync-nudge and <prefix>/fleet/sync-nudge
    "facts_interval_s": 300.0,       # how often the device re-sends its facts and what it serves
}


def _coerce(default: Any, value: Any) -> Any:
    if not isinstance(value, str) or default is None:
        return value
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(value)


@dataclass(frozen=True)
class SyncSettings:
    url: str
    device_id: str
    enrollment_token: str | None
    public_keys: list[str]
    poll_interval_s: float
    labels: dict[str, str]
    state_dir: Path
    repository: Path
    trial_s: float = 60.0
    trial_min_requests: int = 20
    trial_max_error_rate: float = 0.01
    trial_max_p99_ratio: float = 3.0
    trial_p99_floor_ms: float = 10.0
    crash_loop_restarts: int = 3
    crash_loop_window_s: float = 600.0
    max_download_mb: float = 2048.0
    request_timeout_s: float = 30.0
    retry_max_s: float = 300.0
    download_chunk_kb: int = 256
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    mqtt_nudge: bool = False
    facts_interval_s: float = 300.0

    @property
    def sync_dir(self) -> Path:
        return self.state_dir / "sync"

    @property
    def max_download_bytes(self) -> int:
        return int(self.max_download_mb * (1 << 20))

    @classmethod
    def from_config(cls, cfg: Config, overrides: dict[str, Any] | None = None) -> SyncSettings:
        """``overrides`` set keys the config cannot hold yet (tests, the runner's ``--set``)."""
        reg = cfg.registry
        if not reg.url:
            raise ConfigError("registry.url: required when [registry] enabled = true")
        if not reg.url.startswith(("http://", "https://")):
            raise ConfigError("registry.url: must start with http:// or https://")
        check_public_keys(reg.public_keys, "registry.public_keys", "at least one release-signing key is required; "
                          "without it no release could ever be verified")
        extra = {k: getattr(reg, k, v) for k, v in DEFAULTS.items()}
        for k, v in (overrides or {}).items():
            if k not in DEFAULTS:
                raise ConfigError(f"registry.{k}: unknown sync setting (known: {', '.join(sorted(DEFAULTS))})")
            extra[k] = _coerce(DEFAULTS[k], v)
        ca = extra.pop("ca_file")
        cert, key = extra.pop("client_cert"), extra.pop("client_key")
        if bool(cert) != bool(key):
            raise ConfigError("registry.client_cert and registry.client_key go together")
        return cls(url=reg.url.rstrip("/"), device_id=cfg.device.id, enrollment_token=reg.enrollment_token,
                   public_keys=list(reg.public_keys), poll_interval_s=reg.poll_interval_s, labels=dict(reg.labels),
                   state_dir=cfg.device.state_dir, repository=cfg.device.model_repository,
                   ca_file=Path(ca) if ca else None, client_cert=Path(cert) if cert else None,
                   client_key=Path(key) if key else None, **extra)
