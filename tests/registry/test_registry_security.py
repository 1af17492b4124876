"""The registry's data at rest and in transit: private files whatever the umask, and HTTPS end to end.

A real ``edged-registry serve`` process each; the TLS test makes its own CA and server
certificate with ``cryptography`` and has a real device (in-process agent and engine)
enroll, poll, download and commit a release over HTTPS.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from edged.protocol.fleet.release import TargetSelector
from tests.registry_helpers import (
    ADMIN_TOKEN,
    PY,
    REPO_ROOT,
    InProcessDevice,
    Keys,
    RegistryServer,
    device_toml,
    make_version,
    wait_for,
)


def loose(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) that its group or others may access."""
    out = []
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        if mode & 0o077:
            out.append(f"{p.relative_to(root.parent)} {mode:o}")
    return out


def test_registry_data_is_private_whatever_the_umask(tmp_path: Path) -> None:
    keys = Keys.make(tmp_path)
    server = RegistryServer(tmp_path, [keys.public], umask=0o022)
    server.data_dir.mkdir(mode=0o755)
    os.chmod(server.data_dir, 0o755)  # made in advance by an operator with a loose umask: tightened
    server.start()
    try:
        with server.client() as c:
            c.push_folder(make_version(tmp_path / "pub" / "m" / "1"), "m", 1)
            tok = c.enrollment_token().token
        assert httpx.post(f"{server.url}/api/v1/enroll", json={"token": tok, "device_id": "d1"}).status_code == 200
        files = [p for p in server.data_dir.rglob("*") if p.is_file()]
        assert any(p.name == "registry.db" for p in files) and any(p.parent.parent.name == "sha256" for p in files)
        assert loose(server.data_dir) == []  # database (and its -wal/-shm), blobs, their folders
    finally:
        server.stop()
    assert loose(server.data_dir) == []
    # the release-signing key the CLI makes
    out = tmp_path / "keys" / "operator.key"
    out.parent.mkdir()
    r = subprocess.run([PY, "-m", "edged.registry", "keygen", "--out", str(out)], capture_output=True, text=True,
                       cwd=REPO_ROOT, umask=0o022, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


# ---- TLS ------------------------------------------------------------------------------------------
def make_ca_and_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 it signed: (cert, key, ca) PEM files.

    A client certificate signed by the same CA is written beside them (``client.crt``, ``client.key``).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edged test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))

    def issue(name: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out = folder / f"{name}.crt", folder / f"{name}.key"
        out[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[1].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
        os.chmod(out[1], 0o600)
        return out

    cert, key = issue("registry", ExtendedKeyUsageOID.SERVER_AUTH,
                      [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    issue("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("tls-dev")])
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return cert, key, folder / "ca.crt"


def test_tls_registry_serves_a_device_end_to_end(tmp_path: Path) -> None:
    from edged.registry.admin_client import RegistryClient, RegistryClientError
    from edged.sync.capped_http import RegistryHttp, SyncHttpError

    keys = Keys.make(tmp_path)
    tls = make_ca_and_cert(tmp_path)
    server = RegistryServer(tmp_path, [keys.public], tls=tls).start()
    try:
        assert server.url.startswith("https://")
        # nothing in clear: plain HTTP gets no answer, and a client that does not trust the CA refuses
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=5)
        with RegistryClient(server.url, ADMIN_TOKEN) as c, pytest.raises(RegistryClientError, match="CERTIFICATE"):
            c.models()
        with pytest.raises(SyncHttpError, match="CERTIFICATE"):
            RegistryHttp(server.url, timeout=5).request("GET", "/healthz")
        # the operator's CLI with the CA (EDGED_REGISTRY_CA_FILE)
        assert server.cli("models", "--json").stdout.strip() == "[]"

        with server.client() as c:
            c.push_folder(make_version(tmp_path / "pub" / "digits" / "1"), "digits", 1)
            rel = c.release(keys.load(), "digits", 1, expires_in_s=600,
                            selector=TargetSelector(devices=["tls-dev"])).release
            token = c.enrollment_token().token
        (tmp_path / "repo").mkdir()
        cfg = device_toml(tmp_path, tmp_path / "repo", server.url, [keys.public], token=token, device_id="tls-dev",
                          poll_s=0.1)
        dev = InProcessDevice(cfg, ca_file=str(tls[2]), trial_s=0.3).start()
        try:
            def committed() -> bool:
                ms = dev.state().models.get("digits")
                return bool(ms and ms.pending is None and ms.current and ms.current.release == rel)

            wait_for(committed, 60, 0.05, "the release committed over HTTPS")
            assert dev.serving() == [1]
        finally:
            dev.stop()
        with server.client() as c:
            assert [(m.model, m.state) for m in c.device("tls-dev").models] == [("digits", "committed")]
    finally:
        server.stop()


def test_a_tls_registry_stops_within_its_grace_while_a_client_holds_an_idle_connection(tmp_path: Path) -> None:
    """An idle keep-alive TLS connection (a device between polls) alone held a stop for Python's 30 s TLS
    shutdown wait, as long as the unit's TimeoutStopSec: systemd's SIGKILL then lost the batched writes.
    Now the wait is bounded by shutdown_grace_s and the registry exits cleanly after it."""
    import signal
    import socket
    import ssl

    tls = make_ca_and_cert(tmp_path)
    conf = tmp_path / "registry.toml"
    conf.write_text("[registry]\nshutdown_grace_s = 1.0\n")
    server = RegistryServer(tmp_path, [Keys.make(tmp_path).public], tls=tls, extra_args=["--config", str(conf)]).start()
    assert server.proc is not None
    ctx = ssl.create_default_context(cafile=str(tls[2]))
    with socket.create_connection(("127.0.0.1", server.port)) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as idle:
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        # the connection stays open and unread, as a device's pooled connection does between polls
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(10)
        finally:
            server.stop()
    # uvicorn re-raises the SIGTERM it handled once it has finished: -15 is its clean exit
    assert code in (0, -signal.SIGTERM), server.log()[-2000:]
    assert "Application shutdown complete" in server.log() and "Traceback" not in server.log()


def test_tls_settings_go_together(tmp_path: Path) -> None:
    tls = make_ca_and_cert(tmp_path)
    (tmp_path / "admin.token").write_text(ADMIN_TOKEN)
    r = subprocess.run([PY, "-m", "edged.registry", "serve", "--data-dir", str(tmp_path / "reg"),
                        "--admin-token-file", str(tmp_path / "admin.token"), "--public-key", Keys.make(tmp_path).public,
                        "--tls-cert", str(tls[0])], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert r.returncode == 2 and "tls_cert and tls_key go together" in r.stderr, r.stderr


def test_registry_requiring_client_certificates(tmp_path: Path) -> None:
    """``--tls-client-ca``: devices and operators without a certificate from that CA are turned away."""
    from edged.registry.admin_client import RegistryClient, RegistryClientError
    from edged.sync.capped_http import RegistryHttp, SyncHttpError

    keys = Keys.make(tmp_path)
    tls = make_ca_and_cert(tmp_path)
    ca, client_cert, client_key = tls[2], tmp_path / "client.crt", tmp_path / "client.key"
    server = RegistryServer(tmp_path, [keys.public], tls=tls, extra_args=["--tls-client-ca", str(ca)],
                            client_cert=(client_cert, client_key)).start()
    try:
        with pytest.raises(SyncHttpError):
            RegistryHttp(server.url, timeout=5, ca_file=ca).request("GET", "/healthz")
        with RegistryClient(server.url, ADMIN_TOKEN, ca_file=ca) as c, pytest.raises(RegistryClientError):
            c.models()
        with server.client() as c:
            token = c.enrollment_token().token
        # a device with its certificate ([registry] client_cert / client_key) enrolls and reports its facts
        (tmp_path / "repo").mkdir()
        cfg = device_toml(tmp_path, tmp_path / "repo", server.url, [keys.public], token=token, device_id="mtls-dev",
                          poll_s=0.1)
        cfg.write_text(cfg.read_text() + f'ca_file = "{ca}"\nclient_cert = "{client_cert}"\n'
                                         f'client_key = "{client_key}"\n')
        dev = InProcessDevice(cfg).start()
        try:
            with server.client() as c:
                wait_for(lambda: c.device("mtls-dev").facts.get("edged_version"), 30, 0.1, "the device's facts")
        finally:
            dev.stop()
    finally:
        server.stop()
