"""Typed daemon configuration: one TOML file, unknown keys refused.

Every section the product will have exists from the start so that a config
written today stays valid as features land. Relative paths resolve against the
folder of the config file (or the working directory when there is none).
"""

from __future__ import annotations

import os
import socket
import string
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edged import datatypes
from edged.cpus import DEFAULT_SPIN_US
from edged.errors import ConfigError, EdgedError, format_validation_error
from edged.listen import parse_listen
from edged.protocol.mqtt_topics import DEFAULT_REPLY_TOPICS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")
_PACKAGE_ROOT = Path(__file__).resolve().parent


def source_checkout() -> Path | None:
    """The repository root when edged runs from a source checkout (models/ beside the package)."""
    root = _PACKAGE_ROOT.parent
    return root if (root / "models").is_dir() and (root / "pyproject.toml").is_file() else None


def bundled_models_dir() -> Path:
    root = source_checkout()
    return root / "models" if root else Path("/usr/share/edged/models")


def default_state_dir() -> Path:
    # systemd's StateDirectory= sets this; otherwise root uses the FHS place and users their XDG one.
    if env := os.environ.get("STATE_DIRECTORY"):
        return Path(env.split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/edged")
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "edged"


def default_runtime_dir() -> Path:
    if env := os.environ.get("RUNTIME_DIRECTORY"):
        return Path(env.split(":")[0])
    if os.geteuid() == 0:
        return Path("/run/edged")
    xdg = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/edged-{os.geteuid()}"
    return Path(xdg) / "edged"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _check_listen(v: str) -> str:
    """A listen address the HTTP and gRPC servers will accept (refused here, not at their start)."""
    try:
        parse_listen(v)
    except EdgedError:
        raise ValueError(f"{v!r}: expected host:port (port 0-65535), [v6]:port, :port, /path or "
                         "unix:path") from None
    return v


ListenAddress = Annotated[str, AfterValidator(_check_listen)]


class VersionPolicy(_Section):
    """Which versions of a model to serve: the newest N, or an explicit list."""

    latest: int | None = Field(default=None, ge=1, description="serve the newest N versions")
    specific: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, description="serve exactly these")

    @model_validator(mode="after")
    def _one_of(self) -> VersionPolicy:
        if self.latest is not None and self.specific is not None:
            raise ValueError("set either latest or specific, not both")
        if self.latest is None and self.specific is None:
            self.latest = 1
        return self

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.specific is not None:
            return [v for v in ordered if v in set(self.specific)]
        assert self.latest is not None
        return ordered[-self.latest:]


class DeviceSection(_Section):
    id: str = Field(default_factory=socket.gethostname, description="device id used in MQTT topics and the registry")
    state_dir: Path = Field(default_factory=default_state_dir, description="caches, staged downloads, telemetry buffer")
    runtime_dir: Path = Field(default_factory=default_runtime_dir, description="sockets (the shm doorbell)")
    model_repository: Path = Field(default_factory=bundled_models_dir, description="<repo>/<model>/<version>/")
    model_seed: Path | None = Field(default=None, description="copied into model_repository at start when that "
                                                               "does not exist yet (the package's bundled models)")
    profiles_dir: Path | None = Field(default=None, description="extra device profiles; same name overrides")
    profile: str | None = Field(default=None, description="force a device profile by name instead of matching")

    @field_validator("id")
    @classmethod
    def _topic_safe(cls, v: str) -> str:
        if not v or any(c in v for c in "/+#") or len(v) > 128 or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in v):
            raise ValueError("must be 1-128 characters without '/', '+', '#' or control characters")
        return v


class ModelsSection(_Section):
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy, description="default for every model")
    policies: dict[str, VersionPolicy] = Field(default_factory=dict, description="per-model overrides")
    disabled: list[str] = Field(default_factory=list, description="models present in the repository but not loaded")

    def policy_for(self, model: str) -> VersionPolicy:
        return self.policies.get(model, self.version_policy)


class HttpSection(_Section):
    enabled: bool = True
    listen: ListenAddress = Field(default="127.0.0.1:8000", description="host:port, or a Unix socket path")
    max_request_mb: float = Field(default=64, gt=0)
    max_connections: int = Field(default=1000, ge=1, description="open connections in all")
    max_client_connections: int = Field(default=64, ge=1, description="open connections per client: peer "
                                        "address over TCP, uid on a Unix socket; a new one replaces the "
                                        "client's longest-idle one")
    header_timeout_s: float = Field(default=10, gt=0, description="a request line and headers (or a first "
                                    "request on a new connection) must arrive within this")
    max_busy_connections: int = Field(default=256, ge=1, description="connections receiving a request body at "
                                      "once, all clients together (whatever their addresses); one more cuts off "
                                      "the slowest body sender")
    body_timeout_s: float = Field(default=10, gt=0, description="longest pause between two parts of a request "
                                  "body (408 and close)")


class GrpcTlsSection(_Section):
    cert_file: Path = Field(description="server certificate chain (PEM)")
    key_file: Path = Field(description="server private key (PEM)")
    client_ca_file: Path | None = Field(default=None, description="set: clients must present a certificate "
                                        "signed by this CA (mutual TLS)")


class GrpcSection(_Section):
    """The v2 gRPC listener; off unless the section is in the file (needs the ``grpc`` extra)."""

    enabled: bool = True
    listen: ListenAddress = Field(default="127.0.0.1:8001", description="host:port, or unix:/path (a Unix socket)")
    max_message_mb: float = Field(default=64, gt=0, le=2047, description="largest request or response message")
    max_stream_inflight: int = Field(default=64, ge=1, le=4096, description="requests of one ModelStreamInfer "
                                     "stream being computed or waiting for their turn to be answered (later ones "
                                     "are not read until a slot frees; answers stay in order)")
    max_connections: int = Field(default=1000, ge=1, description="open gRPC connections; beyond it new ones are "
                                 "closed at once (sized down to the descriptor budget, see [descriptors])")
    max_concurrent_rpcs: int = Field(default=1000, ge=1, description="RPCs (streams) being served at once, all "
                                     "connections together; beyond it RESOURCE_EXHAUSTED")
    max_streams_per_connection: int = Field(default=100, ge=1, description="HTTP/2 MAX_CONCURRENT_STREAMS")
    stream_window_kb: int = Field(default=0, ge=0, le=16384, description="bytes of one RPC's messages grpcio takes in "
                                  "before the daemon has read them (HTTP/2 flow-control window); a message larger "
                                  "than it waits a round trip for more. 0: the request memory budget shared by "
                                  "max_concurrent_rpcs, within 64..4096 KiB")
    idle_timeout_s: float = Field(default=300, gt=0, description="a connection with no RPC for this long is "
                                  "closed (GOAWAY; clients reconnect on their next call)")
    handshake_timeout_s: float = Field(default=10, gt=0, description="a new connection must finish its "
                                       "TLS/HTTP/2 handshake within this")
    message_timeout_s: float = Field(default=30, gt=0, description="a ModelInfer message must arrive whole within "
                                     "this of its RPC's start (its largest possible size is held in the request "
                                     "memory budget meanwhile); DEADLINE_EXCEEDED")
    tls: GrpcTlsSection | None = None


class DescriptorsSection(_Section):
    """The daemon's file-descriptor budget: TCP listeners are capped so that a reserve always remains."""

    raise_soft_limit: bool = Field(default=True, description="raise RLIMIT_NOFILE's soft limit to the hard one "
                                   "at start")
    reserve: int = Field(default=256, ge=16, description="descriptors kept out of the TCP listeners' caps for "
                         "shared memory clients, health checks, model files, MQTT and the registry")


class ControlSection(_Section):
    """Who may change the daemon's state locally (see edged/transports/authority.py and the README)."""

    model_control: Literal["none", "explicit"] = Field(
        default="explicit", description="none: repository load/unload are refused for everyone; explicit: "
        "allowed with the management authority (token, or a trusted Unix-socket peer)")
    token: str | None = Field(default=None, min_length=16, description="management credential, sent as "
                              "'Authorization: Bearer <token>'; unset: no credential is accepted")
    unix_uids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="Unix-socket peers trusted besides root and the daemon's own user")


class TlsSection(_Section):
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure_skip_verify: bool = False


Policy = Literal["drop_oldest", "latest_per_topic", "queue"]
PLACEHOLDERS = frozenset({"topic", "device", "model", "version", "prefix"})


WILDCARD_RULE = "'+' must fill a whole level and '#' must be the whole last level"


def _wildcards_ok(topic_filter: str) -> bool:
    """MQTT's wildcard rules for a topic filter (stream bindings' inputs, reply namespaces)."""
    levels = topic_filter.split("/")
    return not any(("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+")
                   for i, level in enumerate(levels))


class StreamBinding(BaseModel):
    """One ``[[mqtt.bindings]]`` entry (run by :mod:`edged.transports.mqtt.bindings`)."""

    model_config = ConfigDict(extra="forbid")

    topic: str = Field(description="input topic filter; '+' and '#' wildcards allowed")
    model: str
    version: int | None = Field(default=None, ge=1, description="pin a version; default: the newest ready")
    output_topic: str = Field(
        default="{prefix}/{device}/results/{model}",
        description="template with {topic} (the input topic), {device}, {model}, {version}, {prefix}")
    input_format: Literal["v2", "raw", "media"] = Field(
        default="v2", description="v2: a v2 JSON (or binary-form) request; raw: bare tensor bytes; media: an "
        "encoded image or sound (JPEG, PNG, WebP, WAV) for a model or pipeline with one BYTES input")
    content_type: str | None = Field(default=None, description="media: the payloads' type (image/jpeg, ...); "
                                     "default: the message's MQTT 5 content type, else its first bytes")
    input_name: str | None = Field(default=None, description="raw: the model input the bytes feed")
    datatype: str | None = Field(default=None, description="raw: the v2 datatype of the bytes")
    shape: list[int] | None = Field(default=None, description="raw: full shape incl. batch; one -1 allowed")
    policy: Policy = "latest_per_topic"
    queue_size: int = Field(default=8, ge=1, le=65536)
    qos: Literal[0, 1] = Field(default=0, description="subscription and output QoS")

    @field_validator("topic")
    @classmethod
    def _filter(cls, v: str) -> str:
        if not v or "\0" in v:
            raise ValueError("must be a non-empty topic filter")
        if not _wildcards_ok(v):
            raise ValueError(WILDCARD_RULE)
        return v

    @field_validator("output_topic")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
            static = "".join(lit for lit, _, _, _ in string.Formatter().parse(v))
        except ValueError as e:
            raise ValueError(f"not a valid template: {e}") from None
        unknown = sorted(set(fields) - PLACEHOLDERS)
        if unknown:
            raise ValueError(f"unknown placeholder(s) {unknown}; use {sorted(PLACEHOLDERS)}")
        try:
            v.format(**dict.fromkeys(PLACEHOLDERS, "x"))
        except (ValueError, IndexError, KeyError, AttributeError) as e:
            raise ValueError(f"not a valid template: {e}") from None
        if not v or any(c in static for c in "+#\0"):
            raise ValueError("must be a topic name without wildcards")
        return v

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, v: str | None) -> str | None:
        if v is not None and (v not in datatypes.ALL_DATATYPES or v == "BYTES"):
            raise ValueError(f"must be one of {sorted(set(datatypes.ALL_DATATYPES) - {'BYTES'})}")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(d == 0 or d < -1 for d in v) or v.count(-1) > 1):
            raise ValueError("must be a non-empty list of positive sizes with at most one -1")
        return v

    @model_validator(mode="after")
    def _raw_fields(self) -> StreamBinding:
        raw = (self.input_name, self.datatype, self.shape)
        if self.input_format == "raw" and any(x is None for x in raw):
            raise ValueError("input_format 'raw' needs input_name, datatype and shape")
        if self.input_format != "raw" and any(x is not None for x in raw):
            raise ValueError("input_name, datatype and shape are only for input_format 'raw'")
        if self.content_type is not None:
            if self.input_format != "media":
                raise ValueError("content_type is only for input_format 'media'")
            from edged.protocol.media import MEDIA_TYPES, declared_media_type
            if declared_media_type(self.content_type) is None:
                raise ValueError(f"content_type must be one of {list(MEDIA_TYPES)}")
        return self


class MqttSection(_Section):
    enabled: bool = True
    url: str = Field(default="mqtt://127.0.0.1:1883", description="mqtt:// or mqtts://host:port")
    topic_prefix: str = "edged"
    protocol: Literal["5", "3.1.1"] = "5"
    username: str | None = None
    password: str | None = None
    tls: TlsSection | None = None
    keepalive_s: int = Field(default=30, ge=5)
    max_payload_mb: float = Field(default=16, gt=0)
    client_id: str | None = Field(default=None, description="default edged-<device id>; stable so a restart "
                                  "resumes its session")
    qos: Literal[0, 1] = Field(default=1, description="QoS of request subscriptions and status messages")
    reply_qos: Literal[0, 1, "request"] = Field(
        default=0, description="QoS of inference replies: 0 (at most once, no extra round trip), 1, or "
        "'request' (the request's QoS, at most 1)")
    max_pending_replies: int = Field(
        default=1000, ge=16, le=100_000, description="requests being computed plus replies not yet taken by the "
        "broker; beyond it requests are answered 'overloaded'")
    clean_start: bool = Field(default=True, description="false: persistent session; QoS 1 requests queue at "
                              "the broker while edged is away")
    session_expiry_s: int = Field(default=0, ge=0, description="MQTT 5 session expiry when clean_start = false")
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=30, gt=0)
    bindings: list[StreamBinding] = Field(default_factory=list, description="stream bindings: topic -> model -> topic")
    reply_topics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REPLY_TOPICS), min_length=1, max_length=64,
        description="topic filters a request's response topic (MQTT 5) or reply_to (3.1.1) must match; "
        "{prefix} and {device} are filled in. Any other is refused with a note on {prefix}/{device}/errors. "
        "The daemon's own, other devices' and fleet topics are refused whatever these say")

    @field_validator("reply_topics")
    @classmethod
    def _reply_filters(cls, v: list[str]) -> list[str]:
        for pattern in v:
            static = pattern.replace("{prefix}", "p").replace("{device}", "d")
            levels = static.split("/")
            if not pattern or "\0" in pattern or "{" in static or "}" in static:
                raise ValueError(f"{pattern!r}: a topic filter; only {{prefix}} and {{device}} may be filled in")
            if not _wildcards_ok(static):
                raise ValueError(f"{pattern!r}: {WILDCARD_RULE}")
            if levels[0] in ("+", "#") or levels[0].startswith("$"):
                raise ValueError(f"{pattern!r}: the first level must be a fixed name (not a wildcard or '$')")
        return v

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("mqtt://", "mqtts://", "ws://", "wss://")):
            raise ValueError("must start with mqtt://, mqtts://, ws:// or wss://")
        return v


class ShmSection(_Section):
    enabled: bool = True
    socket: Path | None = Field(default=None, description="Unix socket; default <runtime_dir>/edged.sock")
    socket_mode: int = Field(default=0o660, description="file mode of the socket")
    max_region_mb: float = Field(default=1024, gt=0, description="shared memory one client may map")
    max_segments: int = Field(default=128, ge=1, description="segments one client may register")
    # Bounded: each client's socket send buffer is sized to hold this many unread replies
    # (edged.transports.shm.conn.reply_room: about 2.3 KiB each), pinned in the kernel per client.
    max_inflight: int = Field(default=64, ge=1, le=1024, description="requests one client may have in flight "
                              "(at most 1024: each client's socket buffer holds that many unread replies)")
    system_shm_prefix: str | None = Field(
        default=None, pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.\-]{0,63})?$",
        description="over TCP, system shared memory may only be registered (with the management token) for "
        "/dev/shm segments named with this prefix (\"\": any name) and owned by the daemon's user; unset: off "
        "over TCP")


class RegistrySection(_Section):
    enabled: bool = False
    url: str | None = None
    enrollment_token: str | None = None
    public_keys: list[str] = Field(default_factory=list, description="Ed25519 release-signing keys (base64)")
    poll_interval_s: float = Field(default=60, gt=0)
    labels: dict[str, str] = Field(default_factory=dict, description="not sent: labels are operator-owned "
                                                                     "(edged-registry label / enroll-token --label)")
    trial_s: float = Field(default=60, ge=0, description="how long a new version is watched before it is committed")
    trial_min_requests: int = Field(default=20, ge=1, description="below this, error rate and p99 are not judged")
    trial_max_error_rate: float = Field(default=0.01, ge=0, le=1,
                                        description="allowed increase over the previous version's error rate")
    trial_max_p99_ratio: float = Field(default=3.0, gt=1, description="allowed p99 as a multiple of the previous one's")
    trial_p99_floor_ms: float = Field(default=10.0, ge=0, description="a p99 below this never fails a trial")
    trial_max_quality_drop: float = Field(default=0.05, ge=0, le=1,
                                          description="a version that scores this much below the one it replaces "
                                                      "on its evaluation set is rolled back at trial start")
    trial_extend_s: float = Field(default=0, ge=0, description="a trial that saw fewer than trial_min_requests "
                                                               "requests (and has no evaluation set to go by) "
                                                               "waits up to this much longer for traffic; the "
                                                               "commit report says what it was judged on")
    crash_loop_restarts: int = Field(default=3, ge=2, description="N starts within crash_loop_window_s after an "
                                                                  "activation: serve the last-known-good")
    crash_loop_window_s: float = Field(default=600, gt=0)
    max_download_mb: float = Field(default=2048, gt=0, description="a bigger release is refused before downloading")
    request_timeout_s: float = Field(default=30, gt=0)
    retry_max_s: float = Field(default=300, gt=0, description="back-off cap while the registry is unreachable")
    download_chunk_kb: int = Field(default=256, ge=1, le=65536)
    ca_file: Path | None = Field(default=None, description="CA bundle for an https registry (default: system)")
    client_cert: Path | None = Field(default=None, description="PEM certificate this device presents to a registry "
                                                               "that requires client certificates")
    client_key: Path | None = Field(default=None, description="PEM private key of client_cert")
    mqtt_nudge: bool = Field(default=False, description="poll at once on <prefix>/fleet/sync-nudge and "
                                                        "<prefix>/<device>/sync-nudge")
    facts_interval_s: float = Field(default=300, gt=0)


class TelemetrySection(_Section):
    enabled: bool = True
    interval_s: float = Field(default=60, gt=0)
    upload_interval_s: float = Field(default=60, gt=0, description="how often buffered samples go to the registry")
    buffer_mb: float = Field(default=16, gt=0)
    upload: bool = True


class LimitsSection(_Section):
    """What requests may hold together (see edged/membudget.py), and the daemon's threads and processes."""

    @field_validator("engine_processes")
    @classmethod
    def _processes(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= 64:
            raise ValueError("engine_processes must be between 0 and 64, or \"auto\"")
        return v

    memory_mb: float = Field(default=0, ge=0, description="memory every request in progress may hold together: "
                             "bodies in flight, decoded tensors, decoded images and audio, padding; a request that "
                             "does not fit now is answered 'overloaded'. 0: a quarter of the device profile's "
                             "memory budget (at least 64 MB)")
    engine_threads: int = Field(default=0, ge=0, le=1024, description="each engine's CPU thread pool; 0: the "
                                "device profile's threads, else the engine's default (a thread per physical core), "
                                "capped at the CPUs this process may use (its affinity and cgroup CPU quota)")
    engine_processes: int | Literal["auto"] = Field(
        default="auto", description="CPU engines (ONNX Runtime, OpenVINO) run in this many worker processes per "
        "model version, each with an equal share of the engine threads, so one Python interpreter's lock does "
        "not cap the engine on a many-core CPU; 0: in the daemon's process. auto: a process per 4 usable CPUs "
        "from 12 usable CPUs up, else 0")
    engine_spin_us: int = Field(default=DEFAULT_SPIN_US, ge=-1, le=1_000_000, description="how long an idle "
                                "engine's pool threads spin for more work before they sleep, in microseconds "
                                "(ONNX Runtime); -1: the library's own (about 24 ms after every run: a 30 fps "
                                "stream keeps most of a core busy spinning); 0: they sleep at once (every run "
                                "wakes them)")
    engine_pool: Literal["per_model", "shared"] = Field(
        default="per_model", description="ONNX Runtime's threads in the daemon's process: per_model, a pool for "
        "each model version (sized and spin-bounded as above); shared, one pool for all of them (engine_threads, "
        "else the profile's threads, else the CPUs this process may use), for devices that run several models in "
        "turn (a pipeline's steps): none waits for its own threads to wake while the others spin, but the pool "
        "spins the library's ~24 ms after each run, a model's own intra_op_threads no longer applies, and "
        "instances running at once share it. Engines in worker processes keep a pool each. Needs a restart")
    decode_threads: int = Field(default=0, ge=0, le=256, description="threads that decode and encode large "
                                "requests off the transports' event loop; 0: half the CPUs this process may use "
                                "(at least one). Two more are kept for control calls (model loads, file work)")


class LoggingSection(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class Config(_Section):
    device: DeviceSection = Field(default_factory=DeviceSection)
    models: ModelsSection = Field(default_factory=ModelsSection)
    http: HttpSection = Field(default_factory=HttpSection)
    mqtt: MqttSection = Field(default_factory=MqttSection)
    shm: ShmSection = Field(default_factory=ShmSection)
    grpc: GrpcSection | None = Field(default=None, description="absent: no gRPC listener")
    descriptors: DescriptorsSection = Field(default_factory=DescriptorsSection)
    control: ControlSection = Field(default_factory=ControlSection)
    registry: RegistrySection = Field(default_factory=RegistrySection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    source: Path | None = Field(default=None, exclude=True, description="the file this came from")

    @property
    def shm_socket(self) -> Path:
        return self.shm.socket or self.device.runtime_dir / "edged.sock"

    @property
    def cache_dir(self) -> Path:
        return self.device.state_dir / "cache"


def _resolve_paths(cfg: Config, base: Path) -> Config:
    def fix(p: Path | None) -> Path | None:
        return None if p is None else (p if p.is_absolute() else (base / p).resolve())

    d = cfg.device
    d.state_dir, d.runtime_dir, d.model_repository = fix(d.state_dir), fix(d.runtime_dir), fix(d.model_repository)  # type: ignore[assignment]
    d.profiles_dir = fix(d.profiles_dir)
    d.model_seed = fix(d.model_seed)
    cfg.shm.socket = fix(cfg.shm.socket)
    def fix_listen(listen: str) -> str:  # ``unix:relative.sock`` is a path like any other in the file
        return f"unix:{fix(Path(listen[5:]))}" if listen.startswith("unix:") else listen

    cfg.http.listen = fix_listen(cfg.http.listen)
    if cfg.grpc:
        cfg.grpc.listen = fix_listen(cfg.grpc.listen)
    cfg.registry.ca_file = fix(cfg.registry.ca_file)
    cfg.registry.client_cert, cfg.registry.client_key = fix(cfg.registry.client_cert), fix(cfg.registry.client_key)
    if cfg.grpc and cfg.grpc.tls:
        g = cfg.grpc.tls
        g.cert_file, g.key_file, g.client_ca_file = fix(g.cert_file), fix(g.key_file), fix(g.client_ca_file)  # type: ignore[assignment]
    if cfg.mqtt.tls:
        t = cfg.mqtt.tls
        t.ca_file, t.cert_file, t.key_file = fix(t.ca_file), fix(t.cert_file), fix(t.key_file)
    return cfg


def parse_config(text: str, *, source: Path | None = None) -> Config:
    where = str(source) if source else "<config>"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}", [f"(file): not valid TOML: {e}"],
                          **({"file": str(source)} if source else {})) from None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        problems = format_validation_error(e)
        raise ConfigError(f"{where}: {len(problems)} problem(s): " + "; ".join(problems), problems,
                          **({"file": str(source)} if source else {})) from None
    cfg.source = source
    base = source.resolve().parent if source else Path.cwd()
    return _resolve_paths(cfg, base)


def load_config(path: Path | None) -> Config:
    """Load ``path``; with None, the default file if it exists, else built-in defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.is_file():
            return _resolve_paths(Config(), Path.cwd())
        path = DEFAULT_CONFIG_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file", [f"(file): {path} does not exist"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}", [f"(file): cannot read: {e}"]) from None
    return parse_config(text, source=path)
