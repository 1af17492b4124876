"""Blob downloads through the blob server: the API authorises and redirects, the blob server sends the bytes.

One registry (SQLite: the blob path does not touch the database beyond the API's one read)
with ``--blob-listen``, and ``--blob-url`` pointing at a recording proxy in front of the
blob server (what a CDN or static server would be), so the tests see what devices send there.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from edged.registry.blob_urls import UrlSigner, signing_key
from edged.sync.capped_http import RegistryHttp, SyncHttpError
from tests.http_client import web
from tests.registry_helpers import ADMIN_TOKEN, PY, REPO_ROOT, Keys, RegistryServer, free_port, make_version, wait_for

MODEL = "blobby"


@dataclass
class Proxy:
    """Forwards GETs to the blob server and remembers each request's headers."""

    upstream: int
    seen: list[dict[str, str]] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> int:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.seen.append({k.lower(): v for k, v in self.headers.items()})
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=10)
                conn.request("GET", self.path, headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                r = conn.getresponse()
                body = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)
                conn.close()

            def log_message(self, *_a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return int(self.server.server_address[1])

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@dataclass
class Setup:
    server: RegistryServer
    proxy: Proxy
    keys: Keys
    tmp: Path
    folder: Path
    files: dict[str, str]  # path -> sha256 of version 1
    credential: str

    def device(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credential}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("blobserve")
    keys = Keys.make(tmp)
    blob_port = free_port()
    proxy = Proxy(blob_port)
    proxy_port = proxy.start()
    server = RegistryServer(tmp, [keys.public], blob_port=blob_port,
                            extra_args=["--blob-url", f"http://127.0.0.1:{proxy_port}"]).start()
    try:
        folder = make_version(tmp / "pub" / "1", salt="blob", pad_mb=0.5)
        with server.client() as c:
            c.push_folder(folder, MODEL, 1)
            c.release(keys.load(), MODEL, 1, expires_in_s=600)
            files = {f.path: f.sha256 for f in c.version(MODEL, 1).files}
            token = c.enrollment_token().token
        r = web().post(f"{server.url}/api/v1/enroll", json={"token": token, "device_id": "blob-dev"})
        assert r.status_code == 200, r.text
        yield Setup(server, proxy, keys, tmp, folder, files, r.json()["credential"])
    finally:
        server.stop()
        proxy.stop()


def direct(setup: Setup, location: str) -> str:
    """The signed URL, aimed at the blob server itself instead of the proxy."""
    u = urlsplit(location)
    return f"{setup.server.blob_url}{u.path}?{u.query}"


def test_api_redirects_devices_to_a_signed_url(setup: Setup) -> None:
    sha = setup.files["model.onnx"]
    data = (setup.folder / "model.onnx").read_bytes()
    r = web().get(f"{setup.server.url}/api/v1/blobs/{sha}", headers=setup.device())
    assert r.status_code == 307 and r.headers["cache-control"] == "no-store"
    loc = r.headers["location"]
    assert loc.startswith(f"http://127.0.0.1:{setup.proxy.server.server_address[1]}/blobs/{sha}?exp=")  # type: ignore[union-attr]
    got = web().get(direct(setup, loc))
    assert got.status_code == 200 and got.content == data and got.headers["etag"] == f'"{sha}"'
    part = web().get(direct(setup, loc), headers={"Range": "bytes=100-", "If-Range": f'"{sha}"'})
    assert part.status_code == 206 and part.content == data[100:]
    assert web().get(direct(setup, loc), headers={"Range": "bytes=100-", "If-Range": '"x"'}).content == data
    assert web().get(direct(setup, loc), headers={"Range": f"bytes={len(data) + 5}-"}).status_code == 416
    assert httpx.head(direct(setup, loc)).headers["content-length"] == str(len(data))
    # operators still get the bytes from the API; nobody without a credential gets a URL
    assert web().get(f"{setup.server.url}/api/v1/blobs/{sha}", headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}"}).content == data
    assert web().get(f"{setup.server.url}/api/v1/blobs/{sha}").status_code == 401


def test_blob_server_refuses_unsigned_forged_expired_and_foreign_urls(setup: Setup) -> None:
    sha = setup.files["model.onnx"]
    other = setup.files["labels.txt"]
    base = f"{setup.server.blob_url}/blobs"
    loc = direct(setup, web().get(f"{setup.server.url}/api/v1/blobs/{sha}", headers=setup.device()).headers["location"])
    query = urlsplit(loc).query
    signer = UrlSigner(signing_key(setup.server.data_dir / "blobs"), ttl_s=10)
    expired = signer.query(sha, time.time() - 3600)
    cases = {
        f"{base}/{sha}": "a signed blob URL is required",
        f"{base}/{sha}?{query[:-1]}{'0' if query[-1] != '0' else '1'}": "signature is not valid",
        f"{base}/{other}?{query}": "signature is not valid",  # a URL names one file only
        f"{base}/{sha}?{expired}": "expired",
        f"{base}/{sha}?exp=99999999999&sig={query.split('sig=')[1]}": "signature is not valid",
        # a valid signature with a credential but no exp: still refused (the bearer is not what counts here)
    }
    for url, why in cases.items():
        r = web().get(url, headers=setup.device())
        err = r.json()["error"]
        assert r.status_code == 403 and err["code"] == "permission_denied" and why in err["message"], (url, r.text)
    assert web().get(f"{base}/url-signing.key?{query}").status_code == 404
    assert web().get(f"{base}/{'0' * 64}?{signer.query('0' * 64, time.time())}").status_code == 404


def test_device_download_follows_the_redirect_without_its_credential_and_resumes(setup: Setup) -> None:
    sha = setup.files["model.onnx"]
    data = (setup.folder / "model.onnx").read_bytes()
    http = RegistryHttp(setup.server.url, timeout=10)
    dest = setup.tmp / "part"
    dest.write_bytes(data[:1000])  # an interrupted earlier attempt
    setup.proxy.seen.clear()
    got = http.download(f"/api/v1/blobs/{sha}", token=setup.credential, dest=dest, size=len(data),
                        etag=f'"{sha}"', chunk=65536, should_stop=lambda: False)
    assert got == len(data) - 1000 and dest.read_bytes() == data
    assert len(setup.proxy.seen) == 1
    sent = setup.proxy.seen[0]
    assert "authorization" not in sent and sent["range"] == "bytes=1000-" and sent["if-range"] == f'"{sha}"'
    # a release file the device may not have: refused by the API, no URL handed out
    with setup.server.client() as c:
        folder2 = make_version(setup.tmp / "pub" / "2", salt="blob2")
        c.push_folder(folder2, MODEL, 2)
        foreign = next(f.sha256 for f in c.version(MODEL, 2).files if f.path == "labels.txt")
    with pytest.raises(SyncHttpError, match="403"):
        http.download(f"/api/v1/blobs/{foreign}", token=setup.credential, dest=setup.tmp / "f", size=10,
                      etag=f'"{foreign}"', chunk=65536, should_stop=lambda: False)
    http.close()


def test_https_registry_refuses_a_redirect_to_plain_http() -> None:
    http = RegistryHttp("https://registry.invalid:8700", timeout=1)
    with pytest.raises(SyncHttpError, match="from https to http"):
        http._redirect("http://blobs.invalid/blobs/x?exp=1&sig=2")
    assert http._redirect("https://cdn.invalid/b/x?exp=1")[0] == (True, "cdn.invalid", 443)
    assert http._redirect("/blobs/x?exp=1")[1] == "/blobs/x?exp=1"


def test_blob_server_stops_with_the_api_process(tmp_path: Path) -> None:
    keys = Keys.make(tmp_path)
    port = free_port()
    server = RegistryServer(tmp_path, [keys.public], blob_port=port).start()
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)  # no clean shutdown: the child must notice on its own
    server.proc.wait(10)

    def gone() -> bool:
        try:
            web().get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
        except httpx.TransportError:
            return True
        return False

    wait_for(gone, 15, 0.2, "the orphaned blob server to exit")


def test_simulated_fleet_downloads_through_the_blob_server(setup: Setup) -> None:
    """A small slice of bench/fleet_sim.py: simulated devices take a release, every file via the blob server."""
    with setup.server.client() as c:
        folder = make_version(setup.tmp / "pub" / "3", salt="blob3")
        c.push_folder(folder, MODEL, 3)
        r1 = c.releases(MODEL)[-1].release
        token = c.enrollment_token(uses=20).token
    status = setup.tmp / "fleet.json"
    sim = subprocess.Popen([PY, "-m", "bench.sim", "--url", setup.server.url, "--enroll-token",
                            token, "--public-key", setup.keys.public, "--devices", "20", "--poll", "1",
                            "--start", f"{MODEL}:1:{r1}", "--trial", "0.5", "--prepare", "0.1",
                            "--id-prefix", "slice-", "--status-file", str(status)],
                           cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=(setup.tmp / "sim.log").open("wb"))
    try:
        def read() -> dict[str, Any]:
            try:
                out: dict[str, Any] = json.loads(status.read_text())
                return out
            except (FileNotFoundError, json.JSONDecodeError):
                return {}

        wait_for(lambda: read().get("enrolled") == 20, 60, 0.2, "enrollment")
        setup.proxy.seen.clear()
        with setup.server.client() as c:
            rel = c.release(setup.keys.load(), MODEL, 3, expires_in_s=600).release
        wait_for(lambda: read().get("current", {}).get(str(rel)) == 20, 90, 0.2, "every device on the release")
        st = read()
        files = len(list(p for p in folder.rglob("*") if p.is_file()))
        assert st["errors"] == {} and st["downloads"] == {str(rel): 20}
        # each file: a redirect from the API and the bytes from the blob server, for every device
        assert st["requests"]["blob"] == 2 * 20 * files
        assert len(setup.proxy.seen) == 20 * files and all("authorization" not in h for h in setup.proxy.seen)
    finally:
        sim.send_signal(signal.SIGINT)
        try:
            sim.wait(60)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()
