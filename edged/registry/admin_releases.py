"""Publishing, for the operator client: files pushed once by digest, versions created, releases signed here.

Signing happens on the operator's machine, with their private key; the registry only ever sees the
signed envelope.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import TypeAdapter

from edged.errors import ErrorCode
from edged.fsutil import sha256_file
from edged.protocol.fleet.messages import (
    MissingBlobsResponse,
    ModelInfo,
    NextRelease,
    PushVersionRequest,
    ReleaseInfo,
    VersionInfo,
)
from edged.protocol.fleet.release import FileEntry, ReleaseManifest, SignedRelease, TargetSelector, sign_release
from edged.registry.admin_http import AdminHttp, RegistryClientError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

CHUNK = 1 << 20
_T = TypeVar("_T")


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


class ReleasesApi(AdminHttp):
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
        r = self._send("PUT", f"/models/{model}/versions/{version}", req)
        return VersionInfo.model_validate_json(r.content)

    def version(self, model: str, version: int) -> VersionInfo:
        return VersionInfo.model_validate_json(self._call("GET", f"/models/{model}/versions/{version}").content)

    def next_release(self, model: str) -> int:
        return NextRelease.model_validate_json(self._call("GET", f"/models/{model}/next-release").content).release

    def release(  # noqa: PLR0913  the release's own fields, keyword-only, as the CLI's options name them
            self, key: Ed25519PrivateKey, model: str, version: int, *, expires_in_s: float,
            selector: TargetSelector | None = None, notes: str = "", number: int | None = None,
            check_folder: Path | None = None) -> ReleaseInfo:
        """Build the manifest from the pushed version, sign it here, upload it; retries a number race."""
        info = self.version(model, version)
        if check_folder is not None:
            self._check_folder(check_folder, info)
        def post(signed: SignedRelease) -> ReleaseInfo:
            r = self._send("POST", "/releases", signed)
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

