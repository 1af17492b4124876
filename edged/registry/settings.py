"""Registry server settings: a TOML file (``[registry]`` table) plus environment and command-line overrides.

The admin token is read from a file or the environment and kept only as its hash. The
operator's signing key is never here: only public keys, used to refuse uploads that
were not signed by a trusted operator.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edged.errors import ConfigError, EdgedError, format_validation_error
from edged.fsutil import make_private_dir
from edged.listen import parse_listen
from edged.protocol.fleet.release import check_public_keys
from edged.registry.passwords import NAME, is_password_hash
from edged.registry.roles import ROLES

# A device's stored last-seen time is rewritten at most this often however often it polls: a large
# fleet's polls stay reads (settings.last_seen_resolution_s shortens it for a short online window).
LAST_SEEN_MAX_RESOLUTION_S = 60.0

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ADMIN_TOKEN_ENV = "EDGED_REGISTRY_ADMIN_TOKEN"
MIN_TOKEN_LEN = 16


class RegistrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field(default="127.0.0.1:8700", description="host:port; anything but loopback wants TLS")
    tls_cert: Path | None = Field(default=None, description="PEM certificate chain: serve HTTPS")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    tls_client_ca: Path | None = Field(default=None, description="set: every client (devices, operators) must "
                                                                 "present a certificate this CA signed")
    data_dir: Path = Field(default=Path("/var/lib/edged-registry"), description="blobs and the SQLite database")
    database_url: str | None = Field(default=None, description="default: sqlite:///<data_dir>/registry.db")
    blob_dir: Path | None = Field(default=None, description="default: <data_dir>/blobs; shared by all processes")
    admin_token_file: Path | None = Field(default=None, description=f"else the {ADMIN_TOKEN_ENV} variable")
    public_keys: list[str] = Field(default_factory=list, description="trusted Ed25519 release keys (base64)")
    max_upload_mb: float = Field(default=4096, gt=0)
    blob_listen: str | None = Field(default=None, description="host:port of a blob server process `serve` starts "
                                    "beside the API; devices are redirected there (unset: the API serves blobs)")
    blob_url: str | None = Field(default=None, description="base URL devices fetch blobs from (default: "
                                 "http(s)://<blob_listen>); set it when a proxy or CDN fronts the blob server")
    blob_url_ttl_s: float = Field(default=600.0, ge=10, le=86400, description="how long a signed blob URL works")
    migrate: bool = Field(default=True, description="upgrade the schema at start")
    nudge_mqtt_url: str | None = Field(default=None, description="publish a nudge here when a release is made")
    nudge_topic_prefix: str = "edged"
    rollout_tick_s: float = Field(default=2.0, gt=0, description="how often running rollouts are evaluated")
    rollout_admit_per_minute: float = Field(
        default=1000.0, ge=0, description="a rollout's percent steps let in at most this many new devices a minute "
        "unless the rollout names its own pace (0: all at once); admission also waits while the registry sheds load")
    last_seen_flush_s: float = Field(default=5.0, gt=0, description="how often batched last-seen times are written")
    shed_loop_lag_s: float = Field(default=0.1, ge=0, description="when the event loop runs this late, device "
                                   "reports, facts, telemetry and blob requests answer 503 + Retry-After so polls "
                                   "stay prompt (0: never shed)")
    shed_retry_after_s: int = Field(default=5, ge=1, le=60, description="the Retry-After of a request shed at "
                                    "the lowest level; up to 5x that at the highest")
    log_level: str = "info"
    shutdown_grace_s: float = Field(
        default=10.0, gt=0, le=25, description="on stop, how long requests in progress may finish before the "
        "registry flushes its batched writes and exits (below the unit's TimeoutStopSec=30: an idle TLS "
        "keep-alive connection alone would hold a stop for Python's 30 s TLS shutdown wait)")
    dashboard_poll_s: float = Field(default=5.0, ge=0.5, le=3600,
                                    description="how often an open dashboard page asks for changes")
    dashboard_process: bool = Field(default=True, description="read and render dashboard pages in a process of "
                                    "their own (started at the first page), so that they never hold up device polls")
    dashboard_online_s: float = Field(default=180.0, gt=0,
                                      description="the dashboard shows a device online when it called this recently")
    forwarded_allow_ips: list[str] = Field(
        default_factory=list, max_length=256,
        description="reverse proxies (addresses or networks, \"*\" for any) whose X-Forwarded-For and "
                    "X-Forwarded-Proto are believed; unset: nobody's, the client is the connection's peer (the "
                    "sign-in limit counts per real peer, and loopback is not trusted by default)")
    operators: dict[str, str] = Field(default_factory=dict,
                                      description="dashboard operator accounts: name = password hash printed by "
                                                  "edged-registry operator-hash (the admin token also signs in)")
    operator_roles: dict[str, str] = Field(default_factory=dict,
                                           description="dashboard operators' roles: name = viewer, releaser or admin "
                                                       "(an operator not named here is a releaser)")

    @property
    def last_seen_resolution_s(self) -> float:
        """How old a stored last-seen time may get before a call rewrites it: coarse for the write load,
        but with the flush delay on top still inside the online window, or a device that keeps calling
        would be shown offline between two writes."""
        return min(LAST_SEEN_MAX_RESOLUTION_S, (self.dashboard_online_s - self.last_seen_flush_s) / 2)

    @field_validator("operators")
    @classmethod
    def _operators(cls, v: dict[str, str]) -> dict[str, str]:
        for name, hashed in v.items():
            if not NAME.fullmatch(name) or name == "admin":
                raise ValueError(f"operator {name!r}: a name is 1-64 of a-z 0-9 _ - (starting with a letter or "
                                 "digit), not 'admin'")
            if not is_password_hash(hashed):
                raise ValueError(f"operator {name!r}: not a hash from edged-registry operator-hash")
        return v

    @model_validator(mode="after")
    def _operator_roles(self) -> RegistrySettings:
        for name, role in self.operator_roles.items():
            if name not in self.operators:
                raise ValueError(f"operator_roles: {name!r} is not in operators")
            if role not in ROLES:
                raise ValueError(f"operator_roles: {name!r}: {role!r} is not one of {', '.join(ROLES)}")
        return self

    @model_validator(mode="after")
    def _online_window(self) -> RegistrySettings:
        if self.last_seen_flush_s >= self.dashboard_online_s:
            raise ValueError(f"last_seen_flush_s ({self.last_seen_flush_s:g}) must be below dashboard_online_s "
                             f"({self.dashboard_online_s:g}), or devices that keep calling are shown offline")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> RegistrySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        if self.blob_listen is not None:
            try:
                where = parse_listen(self.blob_listen)
            except EdgedError as e:
                raise ValueError(f"blob_listen: {e}") from None
            if isinstance(where, Path) and self.blob_url is None:
                raise ValueError("blob_listen on a Unix socket needs blob_url (what devices are sent to)")
            if self.blob_listen == self.listen:
                raise ValueError("blob_listen must differ from listen")
        if self.blob_url is not None:
            parts = urlsplit(self.blob_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                raise ValueError(f"blob_url {self.blob_url!r}: expected http(s)://host[:port][/path]")
            if self.tls_cert is not None and parts.scheme != "https":
                raise ValueError("blob_url must be https when the API serves HTTPS (devices refuse a downgrade)")
        return self

    def blob_base(self, request_host: str | None) -> str | None:
        """Where devices fetch blobs (None: from the API itself). A wildcard ``blob_listen`` host is
        replaced by the host the device reached the API at."""
        if self.blob_url is not None:
            return self.blob_url.rstrip("/")
        if self.blob_listen is None:
            return None
        where = parse_listen(self.blob_listen)
        assert not isinstance(where, Path)  # checked above
        host = where[0]
        if host in ("0.0.0.0", "::", "") and request_host:
            host = request_host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls_cert is not None else 'http'}://{host}:{where[1]}"

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn's options, the same for the API and the blob server (TLS and its client-CA rule too).

        log_config None: uvicorn logs through our root handler, one format for everything. Forwarded
        headers are believed only from ``forwarded_allow_ips`` (uvicorn's own default trusts loopback).
        """
        out: dict[str, Any] = {"log_level": self.log_level, "access_log": False, "log_config": None,
                               "timeout_graceful_shutdown": self.shutdown_grace_s,
                               # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise: anyone on
                               # the host could then pose as any address (and evade the sign-in limit)
                               "proxy_headers": bool(self.forwarded_allow_ips),
                               "forwarded_allow_ips": list(self.forwarded_allow_ips)}
        if self.tls_cert is not None:
            out.update(ssl_certfile=str(self.tls_cert), ssl_keyfile=str(self.tls_key))
            if self.tls_client_ca is not None:
                import ssl

                out.update(ssl_ca_certs=str(self.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return out

    def prepare_storage(self) -> None:
        """The blob folder 0700 whatever the umask (the database file: :func:`edged.registry.db.make_engine`)."""
        make_private_dir(self.blobs)

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'registry.db'}"

    @property
    def blobs(self) -> Path:
        return self.blob_dir or self.data_dir / "blobs"

    def admin_token_hash(self) -> str:
        """sha256 of the admin token; a missing or short token is a config error (never a default)."""
        token: str | None
        if self.admin_token_file is not None:
            try:
                token = self.admin_token_file.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(f"admin_token_file: cannot read {self.admin_token_file}: {e.strerror}") from None
        else:
            token = os.environ.get(ADMIN_TOKEN_ENV)
        if not token or len(token) < MIN_TOKEN_LEN:
            raise ConfigError(f"an admin token of at least {MIN_TOKEN_LEN} characters is required "
                              f"(admin_token_file or {ADMIN_TOKEN_ENV})")
        return hashlib.sha256(token.encode("utf-8")).hexdigest()

    def check_keys(self) -> None:
        check_public_keys(self.public_keys, "public_keys", "at least one trusted release-signing key is required "
                          "(`edged-registry keygen` prints one)")


def load_settings(path: Path | None, overrides: dict[str, Any] | None = None) -> RegistrySettings:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: cannot read: {e}") from None
        raw = dict(doc.get("registry", doc))
        base = path.resolve().parent
        for key in ("data_dir", "blob_dir", "admin_token_file", "tls_cert", "tls_key", "tls_client_ca"):
            if key in raw and not Path(raw[key]).is_absolute():
                raw[key] = str(base / raw[key])
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return RegistrySettings.model_validate(raw)
    except ValidationError as e:
        problems = format_validation_error(e)
        raise ConfigError(f"{path or 'registry settings'}: " + "; ".join(problems), problems,
                          **({"file": str(path)} if path else {})) from None
