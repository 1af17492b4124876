"""Operator-side client of the registry API (used by ``edged-registry``): push folders, sign releases.

Signing happens here, on the operator's machine, with their private key; the registry
only ever sees the signed envelope.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import TypeAdapter

from edged.errors import EdgedError, ErrorCode
from edged.fsutil import sha256_file
from edged.protocol.fleet.messages import (
    API_PREFIX,
    DeviceInfo,
    EnrollmentTokenRequest,
    EnrollmentTokenResponse,
    LabelsUpdate,
    MissingBlobsResponse,
    ModelInfo,
    NextRelease,
    PinRequest,
    PushVersionRequest,
    ReenrollRequest,
    RegistryStatus,
    ReleaseInfo,
    VersionInfo,
)
from edged.protocol.fleet.release import FileEntry, ReleaseManifest, SignedRelease, TargetSelector, sign_release
from edged.registry.access_wire import CLIENT_HEADER, AuditPage, TokenCreate, TokenCreated, TokenInfo
from edged.registry.rollout_wire import (
    RollbackPlan,
    RollbackRequest,
    RollbackResult,
    RolloutAction,
    RolloutCreate,
    RolloutInfo,
    RolloutStatus,
)

if TYPE_CHECKING:
    import httpx
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from edged.registry.telemetry_ingest import ModelSummary

CHUNK = 1 << 20
_T = TypeVar("_T")


class RegistryClientError(EdgedError):
    def __init__(self, message: str, status: int = 0, code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        super().__init__(message, code=code)
        self.status = status


def folder_files(folder: Path) -> list[tuple[FileEntry, Path]]:
    """Every regular file under a version folder (hidden names skipped), with its digest and size."""
    if not folder.is_dir():
        raise RegistryClientError(f"{folder} is not a folder", code=ErrorCode.INVALID_ARGUMENT)
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_symlink():
            raise RegistryClientError(f"{p}: symbolic links are not pushed; copy the file in",
                                      code=ErrorCode.INVALID_ARGUMENT)
        if p.is_file():
            out.append((FileEntry(path=rel.as_posix(), sha256=sha256_file(p), size=p.stat().st_size), p))
    return out


class RegistryClient:
    def __init__(self, url: str, token: str, *, timeout: float = 60.0, ca_file: Path | None = None,
                 client_cert: Path | None = None, client_key: Path | None = None, source: str | None = None) -> None:
        """``ca_file``: the CA bundle that signed an https registry's certificate (default: the system's);
        ``client_cert``/``client_key``: for a registry that requires client certificates; ``source``: "cli"
        when the ``edged-registry`` command calls (the audit log says so)."""
        import ssl

        import httpx

        self.url = url.rstrip("/")
        verify: ssl.SSLContext | bool = True
        if ca_file is not None or client_cert is not None:
            verify = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            if client_cert is not None:
                verify.load_cert_chain(str(client_cert), str(client_key) if client_key else None)
        headers = {"Authorization": f"Bearer {token}", **({CLIENT_HEADER: source} if source else {})}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=10.0), verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        import httpx

        try:
            r = self._http.request(method, API_PREFIX + path, **kw)
        except httpx.HTTPError as e:
            raise RegistryClientError(f"registry at {self.url} unreachable: {e}") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                msg, code = err["message"], err["code"]
            except Exception:
                msg, code = r.text[:500], ""
            kind = {400: ErrorCode.INVALID_ARGUMENT, 401: ErrorCode.INVALID_ARGUMENT, 404: ErrorCode.NOT_FOUND,
                    409: ErrorCode.FAILED_PRECONDITION}.get(r.status_code, ErrorCode.UNAVAILABLE)
            raise RegistryClientError(f"registry refused ({r.status_code} {code}): {msg}", r.status_code, kind)
        return r

    # ---- publishing -------------------------------------------------------------------------
    def upload_blob(self, path: Path, entry: FileEntry) -> None:
        def body() -> Iterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        self._call("PUT", f"/blobs/{entry.sha256}", content=body(),
                   headers={"Content-Length": str(entry.size), "Content-Type": "application/octet-stream"})

    def missing(self, shas: list[str]) -> list[str]:
        r = self._call("POST", "/blobs/missing", json={"sha256": shas})
        return MissingBlobsResponse.model_validate_json(r.content).missing

    def push_folder(self, folder: Path, model: str, version: int) -> VersionInfo:
        """Upload the files the registry lacks, then create the version (idempotent)."""
        files = folder_files(folder)
        missing = set(self.missing([e.sha256 for e, _ in files]))
        for entry, path in files:
            if entry.sha256 in missing:
                self.upload_blob(path, entry)
                missing.discard(entry.sha256)
        req = PushVersionRequest(files=[e for e, _ in files])
        r = self._call("PUT", f"/models/{model}/versions/{version}", content=req.model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return VersionInfo.model_validate_json(r.content)

    def version(self, model: str, version: int) -> VersionInfo:
        return VersionInfo.model_validate_json(self._call("GET", f"/models/{model}/versions/{version}").content)

    def next_release(self, model: str) -> int:
        return NextRelease.model_validate_json(self._call("GET", f"/models/{model}/next-release").content).release

    def release(self, key: Ed25519PrivateKey, model: str, version: int, *, expires_in_s: float,
                selector: TargetSelector | None = None, notes: str = "", number: int | None = None,
                check_folder: Path | None = None) -> ReleaseInfo:
        """Build the manifest from the pushed version, sign it here, upload it; retries a number race."""
        info = self.version(model, version)
        if check_folder is not None:
            self._check_folder(check_folder, info)
        def post(signed: SignedRelease) -> ReleaseInfo:
            r = self._call("POST", "/releases", content=signed.model_dump_json(),
                           headers={"Content-Type": "application/json"})
            return ReleaseInfo.model_validate_json(r.content)

        return self._sign_and_post(key, info, expires_in_s=expires_in_s, selector=selector, notes=notes,
                                   number=number, post=post)

    def sign(self, key: Ed25519PrivateKey, model: str, version: int, *, expires_in_s: float,
             selector: TargetSelector | None = None, notes: str = "", number: int | None = None) -> SignedRelease:
        """A signed release of a pushed version, not published: for a rollout started elsewhere (the dashboard)."""
        return self._sign_and_post(key, self.version(model, version), expires_in_s=expires_in_s, selector=selector,
                                   notes=notes, number=number, post=lambda signed: signed)

    def _sign_and_post(self, key: Ed25519PrivateKey, info: VersionInfo, *, expires_in_s: float,
                       selector: TargetSelector | None, notes: str, number: int | None,
                       post: Callable[[SignedRelease], _T]) -> _T:
        """Sign a manifest of the pushed version with the next number and post it; retries a number race."""
        for _attempt in range(5):
            n = number if number is not None else self.next_release(info.model)
            now = int(time.time())
            manifest = ReleaseManifest(model=info.model, version=info.version, release=n, issued_at=now,
                                       expires_at=now + int(expires_in_s), selector=selector or TargetSelector(),
                                       files=info.files, notes=notes)
            try:
                return post(sign_release(manifest, key))
            except RegistryClientError as e:
                if e.status == 409 and number is None and "release number" in str(e):
                    continue  # someone released concurrently: take the next number and sign again
                raise
        raise RegistryClientError("could not get a release number after 5 attempts (concurrent releases?)")

    @staticmethod
    def _check_folder(folder: Path, info: VersionInfo) -> None:
        local = sorted((e for e, _ in folder_files(folder)), key=lambda e: e.path)
        if local != sorted(info.files, key=lambda e: e.path):
            raise RegistryClientError(f"{folder} differs from model {info.model!r} version {info.version} in the "
                                      "registry; refusing to sign", code=ErrorCode.FAILED_PRECONDITION)

    def revoke(self, model: str, number: int) -> ReleaseInfo:
        return ReleaseInfo.model_validate_json(self._call("POST", f"/models/{model}/releases/{number}/revoke").content)

    def releases(self, model: str) -> list[ReleaseInfo]:
        r = self._call("GET", f"/models/{model}/releases")
        return TypeAdapter(list[ReleaseInfo]).validate_json(r.content)

    def models(self) -> list[ModelInfo]:
        return TypeAdapter(list[ModelInfo]).validate_json(self._call("GET", "/models").content)

    # ---- fleet ------------------------------------------------------------------------------
    def enrollment_token(self, uses: int = 1, ttl_s: float = 86400, labels: dict[str, str] | None = None
                         ) -> EnrollmentTokenResponse:
        req = EnrollmentTokenRequest(uses=uses, ttl_s=ttl_s, labels=labels or {})
        r = self._call("POST", "/enrollment-tokens", content=req.model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return EnrollmentTokenResponse.model_validate_json(r.content)

    def decommission(self, device_id: str) -> DeviceInfo:
        """Revoke a device's credential for good and take it out of rollouts; its history stays."""
        return DeviceInfo.model_validate_json(self._call("POST", f"/devices/{device_id}/decommission").content)

    def reenroll(self, device_id: str, ttl_s: float = 86400) -> EnrollmentTokenResponse:
        """Revoke a device's credential and get a single-use token that enrolls that id again."""
        r = self._call("POST", f"/devices/{device_id}/reenroll", content=ReenrollRequest(ttl_s=ttl_s).model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return EnrollmentTokenResponse.model_validate_json(r.content)

    def devices(self, labels: dict[str, str] | None = None) -> list[DeviceInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return TypeAdapter(list[DeviceInfo]).validate_json(self._call("GET", "/devices", params=params).content)

    def device(self, device_id: str, events: int = 50) -> DeviceInfo:
        r = self._call("GET", f"/devices/{device_id}", params={"events": events})
        return DeviceInfo.model_validate_json(r.content)

    def set_labels(self, device_id: str, labels: dict[str, str | None]) -> DeviceInfo:
        r = self._call("PATCH", f"/devices/{device_id}/labels", content=LabelsUpdate(labels=labels).model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return DeviceInfo.model_validate_json(r.content)

    def pin(self, device_id: str, model: str, release: int | None) -> DeviceInfo:
        r = self._call("PUT", f"/devices/{device_id}/models/{model}/pin",
                       content=PinRequest(release=release).model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return DeviceInfo.model_validate_json(r.content)

    def status(self, model: str | None = None) -> RegistryStatus:
        r = self._call("GET", "/status", params={"model": model} if model else None)
        return RegistryStatus.model_validate_json(r.content)

    # ---- rollouts ---------------------------------------------------------------------------
    def create_rollout(self, req: RolloutCreate) -> RolloutInfo:
        r = self._call("POST", "/rollouts", content=req.model_dump_json(), headers={"Content-Type": "application/json"})
        return RolloutInfo.model_validate_json(r.content)

    def release_with_rollout(self, key: Ed25519PrivateKey, model: str, version: int, spec: RolloutCreate, *,
                             expires_in_s: float, selector: TargetSelector | None = None, notes: str = "",
                             number: int | None = None, check_folder: Path | None = None) -> RolloutInfo:
        """Sign a new release of a pushed version here and start its rollout with it, in one request.

        ``spec`` gives target, steps and gates; its ``release``/``signed`` are replaced.
        """
        info = self.version(model, version)
        if check_folder is not None:
            self._check_folder(check_folder, info)

        def post(signed: SignedRelease) -> RolloutInfo:
            return self.create_rollout(spec.model_copy(update={"model": model, "release": None, "signed": signed}))

        return self._sign_and_post(key, info, expires_in_s=expires_in_s, selector=selector, notes=notes,
                                   number=number, post=post)

    def rollouts(self, model: str | None = None, state: str | None = None) -> list[RolloutInfo]:
        params = {k: v for k, v in (("model", model), ("state", state)) if v is not None}
        return TypeAdapter(list[RolloutInfo]).validate_json(self._call("GET", "/rollouts", params=params).content)

    def telemetry_summary(self, model: str, *, version: int | None = None, device_id: str | None = None,
                          since: float | None = None, labels: dict[str, str] | None = None) -> ModelSummary:
        from edged.registry.telemetry_ingest import ModelSummary

        params: list[tuple[str, str | int | float]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        for key, value in (("version", version), ("device_id", device_id), ("since", since)):
            if value is not None:
                params.append((key, value))
        r = self._call("GET", f"/models/{model}/telemetry/summary", params=params)
        return ModelSummary.model_validate_json(r.content)

    def rollout(self, rollout_id: int, *, members: bool = False) -> RolloutStatus:
        r = self._call("GET", f"/rollouts/{rollout_id}", params={"members": "true"} if members else None)
        return RolloutStatus.model_validate_json(r.content)

    def rollout_action(self, rollout_id: int, action: str, reason: str = "") -> RolloutInfo:
        r = self._call("POST", f"/rollouts/{rollout_id}/{action}",
                       content=RolloutAction(reason=reason).model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return RolloutInfo.model_validate_json(r.content)

    def rollback_plan(self, model: str, to: str = "previous") -> RollbackPlan:
        return RollbackPlan.model_validate_json(self._call("GET", f"/models/{model}/rollback",
                                                           params={"to": to}).content)

    def rollback(self, key: Ed25519PrivateKey, model: str, to: str = "previous", *, reason: str = "",
                 expires_in_s: float, selector: TargetSelector | None = None) -> RollbackResult:
        """Sign, here, a new release of the version ``to`` names (a release number or "previous") and post it
        as the model's rollback; retries when another release took the number meanwhile."""
        for _attempt in range(5):
            plan = self.rollback_plan(model, to)
            info = self.version(model, plan.version)
            notes = f"rollback to release {plan.to_release}" + (f": {reason}" if reason else "")

            def post(signed: SignedRelease, plan: RollbackPlan = plan) -> RollbackResult:
                body = RollbackRequest(to_release=plan.to_release, signed=signed, reason=reason)
                r = self._call("POST", f"/models/{model}/rollback", content=body.model_dump_json(),
                               headers={"Content-Type": "application/json"})
                return RollbackResult.model_validate_json(r.content)

            try:
                return self._sign_and_post(key, info, expires_in_s=expires_in_s, selector=selector or plan.selector,
                                           notes=notes[:4096], number=plan.next_release, post=post)
            except RegistryClientError as e:
                if e.status == 409 and "release number" in str(e):
                    continue  # "previous" may name another release now: plan again
                raise
        raise RegistryClientError("could not get a release number after 5 attempts (concurrent releases?)")

    def evaluate_rollouts(self) -> dict[str, str]:
        out: dict[str, str] = self._call("POST", "/rollouts/evaluate").json()
        return out

    # ---- access: named tokens and the audit log -------------------------------------------------
    def create_token(self, name: str, role: str) -> TokenCreated:
        r = self._call("POST", "/tokens", content=TokenCreate(name=name, role=role).model_dump_json(),
                       headers={"Content-Type": "application/json"})
        return TokenCreated.model_validate_json(r.content)

    def tokens(self) -> list[TokenInfo]:
        return TypeAdapter(list[TokenInfo]).validate_json(self._call("GET", "/tokens").content)

    def revoke_token(self, name: str) -> TokenInfo:
        return TokenInfo.model_validate_json(self._call("POST", f"/tokens/{name}/revoke").content)

    def audit(self, limit: int = 100, offset: int = 0) -> AuditPage:
        r = self._call("GET", "/audit", params={"limit": limit, "offset": offset})
        return AuditPage.model_validate_json(r.content)
