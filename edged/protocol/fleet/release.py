"""Signed release manifests: what a device may install, signed with the operator's Ed25519 key.

The signature covers the exact manifest bytes, which travel base64-encoded inside the
envelope, so neither side ever re-serialises what was signed. The operator signs on their
own machine (``edged-registry release --key``); the registry only stores the envelope and
checks it against its configured public keys; devices check it again against theirs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edged.errors import ConfigError, EdgedError, ErrorCode, format_validation_error
from edged.protocol.names import MANIFEST_NAME, PIPELINE_NAME, valid_model_name

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

RELEASE_FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20  # a release lists files, not data: anything bigger is an attack or a bug
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ReleaseError(EdgedError):
    """A release manifest is malformed, unsigned, badly signed, expired or out of order."""

    code = ErrorCode.FAILED_PRECONDITION


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Frozen):
    path: str = Field(description="POSIX path relative to the version folder")
    sha256: Sha256
    size: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _safe(cls, v: str) -> str:
        p = PurePosixPath(v)
        if (not v or p.is_absolute() or any(part in ("", ".", "..") for part in v.split("/"))
                or "\\" in v or len(v) > 512 or p.parts[0].startswith(".")
                or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in v)):  # NUL, newline and every control char
            raise ValueError("must be a plain relative path inside the version folder")
        return v


class TargetSelector(_Frozen):
    """Which devices a release is for: all of ``labels`` must match, and the id must be listed when any are."""

    labels: dict[str, str] = Field(default_factory=dict)
    devices: list[str] = Field(default_factory=list)

    def matches(self, device_id: str, labels: dict[str, str]) -> bool:
        if self.devices and device_id not in self.devices:
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())


class ReleaseManifest(_Frozen):
    format: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    release: int = Field(ge=1, description="per model, strictly increasing; devices refuse lower numbers")
    issued_at: int = Field(description="Unix seconds")
    expires_at: int = Field(description="Unix seconds; devices refuse the release afterwards")
    selector: TargetSelector = Field(default_factory=TargetSelector)
    files: list[FileEntry] = Field(min_length=1)
    notes: str = Field(default="", max_length=4096)

    @field_validator("model")
    @classmethod
    def _name(cls, v: str) -> str:
        if not valid_model_name(v):
            raise ValueError("not a valid model name")
        return v

    @model_validator(mode="after")
    def _check(self) -> ReleaseManifest:
        paths = [f.path for f in self.files]
        if len(paths) != len(set(paths)):
            raise ValueError("files has duplicate paths")
        if (MANIFEST_NAME in paths) == (PIPELINE_NAME in paths):
            raise ValueError(f"files must include {MANIFEST_NAME} (a model) or {PIPELINE_NAME} (a pipeline), "
                             "not both")
        folded = {p.lower() for p in paths}
        dirs = {str(PurePosixPath(p).parent).lower() for p in paths}
        if folded & dirs:
            raise ValueError("a file path is also used as a folder")
        if self.expires_at <= self.issued_at:
            raise ValueError("expires_at must be after issued_at")
        return self

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode("ascii")


class SignedRelease(_Frozen):
    """The envelope stored by the registry and served to devices."""

    manifest: str = Field(description="base64 of the exact signed manifest bytes (canonical JSON)")
    signature: str = Field(description="base64 Ed25519 signature over the manifest bytes")
    key_id: str = Field(description="first 16 hex digits of sha256 of the raw public key")

    def manifest_bytes(self) -> bytes:
        if len(self.manifest) > MAX_MANIFEST_BYTES * 4 // 3 + 4:
            raise ReleaseError("release manifest is too large")
        try:
            return base64.b64decode(self.manifest, validate=True)
        except (binascii.Error, ValueError):
            raise ReleaseError("release manifest is not valid base64") from None

    def unverified(self) -> ReleaseManifest:
        """Parse without checking the signature: for display only, never for installing."""
        return parse_manifest_bytes(self.manifest_bytes())


def parse_manifest_bytes(data: bytes) -> ReleaseManifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ReleaseError("release manifest is too large")
    try:
        return ReleaseManifest.model_validate_json(data)
    except ValidationError as e:
        raise ReleaseError("release manifest is invalid: " + "; ".join(format_validation_error(e))) from None


# ---- keys ---------------------------------------------------------------------------------------
def key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


def decode_public_key(b64: str) -> bytes:
    try:
        raw = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ReleaseError("public key is not valid base64") from None
    if len(raw) != 32:
        raise ReleaseError(f"an Ed25519 public key is 32 bytes, this one is {len(raw)}")
    return raw


def check_public_keys(keys: Sequence[str], where: str, missing: str) -> None:
    """The trusted release-signing keys of a config, checked alike by the device and the registry."""
    if not keys:
        raise ConfigError(f"{where}: {missing}")
    for i, k in enumerate(keys):
        try:
            decode_public_key(k)
        except ReleaseError as e:
            raise ConfigError(f"{where}[{i}]: {e}") from None


def generate_private_key() -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def public_key_b64(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def load_private_key(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ReleaseError(f"{path}: not a readable unencrypted PEM private key ({type(e).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ReleaseError(f"{path}: not an Ed25519 key")
    return key


# ---- sign / verify ------------------------------------------------------------------------------
def sign_release(manifest: ReleaseManifest, key: Ed25519PrivateKey) -> SignedRelease:
    data = manifest.canonical_bytes()
    return SignedRelease(manifest=base64.b64encode(data).decode("ascii"),
                         signature=base64.b64encode(key.sign(data)).decode("ascii"),
                         key_id=key_id(base64.b64decode(public_key_b64(key))))


def verify_release(signed: SignedRelease, public_keys: list[str]) -> ReleaseManifest:
    """Check the signature against any trusted key, then parse. Raises ReleaseError."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not public_keys:
        raise ReleaseError("no release-signing public key is configured")
    data = signed.manifest_bytes()
    try:
        sig = base64.b64decode(signed.signature, validate=True)
    except (binascii.Error, ValueError):
        raise ReleaseError("release signature is not valid base64") from None
    for b64 in public_keys:
        raw = decode_public_key(b64)
        try:
            Ed25519PublicKey.from_public_bytes(raw).verify(sig, data)
        except InvalidSignature:
            continue
        return parse_manifest_bytes(data)
    raise ReleaseError("release signature does not verify with any trusted public key")
