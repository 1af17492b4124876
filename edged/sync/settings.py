"""The device's sync settings: the typed ``[registry]`` section plus what the daemon knows (device id, folders)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from edged.config import Config, RegistrySection
from edged.errors import ConfigError, format_validation_error
from edged.protocol.fleet.release import check_public_keys

# The [registry] keys sync reads beyond enabled/url/enrollment_token/public_keys/poll_interval_s/labels;
# their defaults and meaning are those of edged.config.RegistrySection (the one place they are written).
TUNABLE: tuple[str, ...] = tuple(k for k in RegistrySection.model_fields if k not in (
    "enabled", "url", "enrollment_token", "public_keys", "poll_interval_s", "labels"))


def _default(key: str) -> Any:
    return RegistrySection.model_fields[key].default


def _coerce(key: str, value: Any) -> Any:
    """An override as the section's field type would read it (``"0.2"`` -> 0.2, ``"true"`` -> True)."""
    annotation = RegistrySection.model_fields[key].annotation
    assert annotation is not None  # every section field is annotated
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as e:
        raise ConfigError(f"registry.{key}: {'; '.join(format_validation_error(e))}") from None


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
    trial_s: float = _default("trial_s")
    trial_min_requests: int = _default("trial_min_requests")
    trial_max_error_rate: float = _default("trial_max_error_rate")
    trial_max_p99_ratio: float = _default("trial_max_p99_ratio")
    trial_p99_floor_ms: float = _default("trial_p99_floor_ms")
    trial_extend_s: float = _default("trial_extend_s")
    trial_max_quality_drop: float = _default("trial_max_quality_drop")
    crash_loop_restarts: int = _default("crash_loop_restarts")
    crash_loop_window_s: float = _default("crash_loop_window_s")
    max_download_mb: float = _default("max_download_mb")
    request_timeout_s: float = _default("request_timeout_s")
    retry_max_s: float = _default("retry_max_s")
    download_chunk_kb: int = _default("download_chunk_kb")
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    mqtt_nudge: bool = _default("mqtt_nudge")
    facts_interval_s: float = _default("facts_interval_s")

    @property
    def sync_dir(self) -> Path:
        return self.state_dir / "sync"

    @property
    def max_download_bytes(self) -> int:
        return int(self.max_download_mb * (1 << 20))

    @classmethod
    def from_config(cls, cfg: Config, overrides: dict[str, Any] | None = None) -> SyncSettings:
        """``overrides`` set keys the config cannot hold yet (tests, ``edged run --set``)."""
        reg = cfg.registry
        if not reg.url:
            raise ConfigError("registry.url: required when [registry] enabled = true")
        if not reg.url.startswith(("http://", "https://")):
            raise ConfigError("registry.url: must start with http:// or https://")
        check_public_keys(reg.public_keys, "registry.public_keys", "at least one release-signing key is required; "
                          "without it no release could ever be verified")
        extra = {k: getattr(reg, k) for k in TUNABLE}
        for k, v in (overrides or {}).items():
            if k not in TUNABLE:
                raise ConfigError(f"registry.{k}: unknown sync setting (known: {', '.join(sorted(TUNABLE))})")
            extra[k] = _coerce(k, v)
        ca = extra.pop("ca_file")
        cert, key = extra.pop("client_cert"), extra.pop("client_key")
        if bool(cert) != bool(key):
            raise ConfigError("registry.client_cert and registry.client_key go together")
        return cls(url=reg.url.rstrip("/"), device_id=cfg.device.id, enrollment_token=reg.enrollment_token,
                   public_keys=list(reg.public_keys), poll_interval_s=reg.poll_interval_s, labels=dict(reg.labels),
                   state_dir=cfg.device.state_dir, repository=cfg.device.model_repository,
                   ca_file=Path(ca) if ca else None, client_cert=Path(cert) if cert else None,
                   client_key=Path(key) if key else None, **extra)
