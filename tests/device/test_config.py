from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from edged.config import Config, load_config, parse_config
from edged.errors import ConfigError, ErrorCode
from tests.conftest import EDGED


def config_check(f: Path, capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """``edged config check f`` through the CLI's entry point in this process, for the tests that check many
    files (a process start was most of each one's time); the other config-check tests run it as a process."""
    from edged.cli import main

    capsys.readouterr()
    rc = main(["config", "check", str(f)])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["edged", "config", "check", str(f)], rc, out.out, out.err)


def test_defaults_need_no_file() -> None:
    cfg = Config()
    assert cfg.http.listen == "127.0.0.1:8000"
    assert cfg.mqtt.url == "mqtt://127.0.0.1:1883"
    assert cfg.mqtt.topic_prefix == "edged"
    assert cfg.device.id
    assert cfg.models.policy_for("anything").select([1, 2, 3]) == [3]


def test_every_section_exists_from_the_start() -> None:
    cfg = parse_config("[device]\n[models]\n[http]\n[mqtt]\n[shm]\n[registry]\n[telemetry]\n[logging]\n")
    assert cfg.registry.enabled is False


def test_unknown_key_is_named_with_its_path() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config('[mqtt]\nurll = "mqtt://x"\n[http]\nlisten = 5\n')
    assert ei.value.code is ErrorCode.INVALID_ARGUMENT
    assert "mqtt.urll: unknown key" in ei.value.problems
    assert any(p.startswith("http.listen:") for p in ei.value.problems)


def test_relative_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    f = sub / "edged.toml"
    f.write_text('[device]\nstate_dir = "state"\nmodel_repository = "../models"\n')
    cfg = load_config(f)
    assert cfg.device.state_dir == sub / "state"
    assert cfg.device.model_repository == tmp_path / "models"


def test_version_policies() -> None:
    cfg = parse_config("[models.version_policy]\nlatest = 2\n[models.policies.digits]\nspecific = [1, 3]\n")
    assert cfg.models.policy_for("digits").select([1, 2, 3, 4]) == [1, 3]
    assert cfg.models.policy_for("other").select([1, 2, 3, 4]) == [3, 4]
    with pytest.raises(ConfigError, match="either latest or specific"):
        parse_config("[models.version_policy]\nlatest = 2\nspecific = [1]\n")


def test_bad_device_id_refused() -> None:
    with pytest.raises(ConfigError, match=r"device\.id"):
        parse_config('[device]\nid = "a/b"\n')


def test_config_check_cli_names_the_typo(tmp_path: Path) -> None:
    f = tmp_path / "edged.toml"
    f.write_text('[device]\nid = "dev1"\n\n[mqtt]\ntopic_prefx = "edged"\n')
    r = subprocess.run([*EDGED, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "mqtt.topic_prefx: unknown key" in r.stderr


def test_config_check_cli_accepts_a_good_file(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nid = "dev1"\nmodel_repository = "{repo}"\n[http]\nlisten = "127.0.0.1:9000"\n')
    r = subprocess.run([*EDGED, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_config_check_reports_missing_tls_files(tmp_path: Path) -> None:
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nmodel_repository = "{tmp_path}"\n[mqtt.tls]\nca_file = "nope/ca.pem"\n')
    r = subprocess.run([*EDGED, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "mqtt.tls.ca_file" in r.stderr


def test_config_check_refuses_a_key_without_a_certificate(tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_text("not really a key\n")
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nmodel_repository = "{tmp_path}"\n[mqtt.tls]\nkey_file = "{key}"\n')
    r = subprocess.run([*EDGED, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "mqtt.tls.key_file: set without cert_file" in r.stderr


@pytest.mark.parametrize("secret", ['[mqtt]\npassword = "hunter2"\n',
                                    '[registry]\nenrollment_token = "enroll-0123456789"\n'])
def test_config_check_warns_on_a_world_readable_file_holding_a_secret(tmp_path: Path, secret: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #20 item 11: the token or broker password in a 0644 file is every local user's."""
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nid = "dev1"\nmodel_repository = "{tmp_path}"\n{secret}')
    f.chmod(0o644)
    r = config_check(f, capsys)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    name = "[mqtt] password" if "password" in secret else "[registry] enrollment_token"
    assert f"warning: readable by every user (mode 0644) but holds {name}" in r.stderr, r.stderr
    assert "hunter2" not in r.stderr and "enroll-0123456789" not in r.stderr  # names the secret, never shows it
    f.chmod(0o640)
    r = config_check(f, capsys)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # no secret in it: a world-readable config is fine
    f.write_text(f'[device]\nid = "dev1"\nmodel_repository = "{tmp_path}"\n')
    f.chmod(0o644)
    r = config_check(f, capsys)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_device_ids_with_control_characters_are_refused() -> None:
    """Issue #36 attack 10: a trailing newline (or any control character) makes a second "same" id."""
    for bad in ("dev1\\n", "dev\\u0000x", "dev\\u001b[31m", "dev\\u0085"):
        with pytest.raises(ConfigError, match=r"device\.id"):
            parse_config(f'[device]\nid = "{bad}"\n')
    assert parse_config('[device]\nid = "dev-1.a_b:2"\n').device.id == "dev-1.a_b:2"


@pytest.mark.parametrize(("links", "warned"), [
    ('[registry]\nenabled = true\nurl = "http://10.20.30.40:8700"\n[mqtt]\nenabled = false\n', ["[registry] url"]),
    ('[registry]\nenabled = true\nurl = "http://registry.example.com"\n'
     '[mqtt]\nurl = "mqtt://broker.example.com:1883"\npassword = "pw-0123456789"\n', ["[registry] url", "[mqtt] url"]),
    ('[mqtt]\nurl = "ws://192.168.1.5:9001"\n', ["[mqtt] url"]),
    ('[mqtt]\nurl = "mqtts://broker.example.com:8883"\n[mqtt.tls]\ninsecure_skip_verify = true\n',
     ["insecure_skip_verify"]),
    # TLS, or plain only to this host: nothing to warn about
    ('[registry]\nenabled = true\nurl = "https://registry.example.com"\n'
     '[mqtt]\nurl = "mqtts://broker.example.com:8883"\n', []),
    ('[registry]\nenabled = true\nurl = "http://127.0.0.1:8700"\n[mqtt]\nurl = "mqtt://localhost:1883"\n', []),
    ('[registry]\nenabled = true\nurl = "http://[::1]:8700"\n[mqtt]\nurl = "mqtt://127.0.0.2:1883"\n', []),
    ('[registry]\nenabled = false\nurl = "http://10.20.30.40:8700"\n[mqtt]\nenabled = false\n'
     'url = "mqtt://10.0.0.9"\n', []),
])
def test_config_check_warns_on_cleartext_links_to_other_hosts(tmp_path: Path, links: str, warned: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #36 attack 13: `config check` said OK for a registry URL of plain http:// to another host."""
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nid = "dev1"\nmodel_repository = "{tmp_path}"\n{links}')
    f.chmod(0o600)
    r = config_check(f, capsys)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr  # a warning, not a refusal: labs run plain links
    lines = [ln for ln in r.stderr.splitlines() if "warning:" in ln]
    assert len(lines) == len(warned), r.stderr
    for what, line in zip(warned, lines, strict=True):
        assert what in line, line
    if "[registry] url" in warned:
        assert "use https://" in r.stderr
    if "[mqtt] url" in warned:
        assert "mqtts://" in r.stderr
    assert "pw-0123456789" not in r.stderr
