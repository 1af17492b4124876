"""Config values and command lines that used to pass checks and fail later, or fail with a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.cli import main
from edged.config import load_config, parse_config
from edged.errors import ConfigError


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``edged ARGV`` through the CLI's entry point in this process; (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("section", ["http", "grpc"])
@pytest.mark.parametrize("listen", ["127.0.0.1:65536", "127.0.0.1:99999", "localhost", "127.0.0.1:http",
                                    "relative/edged.sock", "unix:"])
def test_a_listen_address_the_server_cannot_bind_is_refused_at_load(section: str, listen: str) -> None:
    """`config check` said OK to a port above 65535 (or no port at all); the daemon only failed at start."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f'[{section}]\nlisten = "{listen}"\n')
    assert any(p.startswith(f"{section}.listen:") and repr(listen) in p for p in ei.value.problems), ei.value.problems


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "0.0.0.0:65535", ":8000", "[::1]:8000", "/run/edged/http.sock",
                                    "unix:/run/edged/http.sock"])
def test_good_listen_addresses_still_load(listen: str) -> None:
    cfg = parse_config(f'[http]\nlisten = "{listen}"\n[grpc]\nlisten = "{listen}"\n')
    assert cfg.http.listen == listen and cfg.grpc is not None and cfg.grpc.listen == listen


def test_a_relative_unix_listen_path_resolves_against_the_config_folder(tmp_path: Path) -> None:
    """Every other relative path in the file does; this one was left relative to the daemon's working
    directory (/ under systemd), so the socket landed somewhere else than the file said."""
    sub = tmp_path / "etc"
    sub.mkdir()
    f = sub / "edged.toml"
    f.write_text('[http]\nlisten = "unix:run/http.sock"\n[grpc]\nlisten = "unix:../grpc.sock"\n')
    cfg = load_config(f)
    assert cfg.http.listen == f"unix:{sub / 'run' / 'http.sock'}"
    assert cfg.grpc is not None and cfg.grpc.listen == f"unix:{tmp_path / 'grpc.sock'}"


def test_config_check_names_a_bad_listen_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "edged.toml"
    f.write_text(f'[device]\nmodel_repository = "{tmp_path}"\n[mqtt]\nenabled = false\n'
                 '[http]\nlisten = "127.0.0.1:99999"\n')
    rc, out, err = _cli(capsys, "config", "check", str(f))
    assert rc == 1 and "OK" not in out
    assert f"{f}: http.listen:" in err and "'127.0.0.1:99999'" in err


def test_config_check_on_a_binary_file_is_an_error_not_a_traceback(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "edged.toml"
    f.write_bytes(b"\xff\xfe[device]\nid = 'x'\n")
    rc, out, err = _cli(capsys, "config", "check", str(f))  # raised UnicodeDecodeError out of main()
    assert rc == 1 and not out
    assert f"{f}: not UTF-8 text" in err


def test_a_bad_config_names_its_file_on_every_problem_line(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`edged detect/run/models -c FILE` printed 'config: http.max_request_mb: ...' with no file to look in."""
    f = tmp_path / "edged.toml"
    f.write_text("[http]\nmax_request_mb = -1\n[mqtt]\nurll = 'mqtt://x'\n")
    rc, _, err = _cli(capsys, "detect", "--config", str(f))
    assert rc == 2
    lines = err.splitlines()
    assert f"config: {f}: http.max_request_mb: Input should be greater than 0" in lines, err
    assert f"config: {f}: mqtt.urll: unknown key" in lines, err
    f.write_text("[http\n")
    rc, _, err = _cli(capsys, "detect", "--config", str(f))
    assert rc == 2 and f"config: {f}: (file): not valid TOML" in err, err


def test_detect_on_a_missing_root_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped --root probed nothing, matched the catch-all profile and exited 0 as if it had worked."""
    rc, out, err = _cli(capsys, "detect", "--root", str(tmp_path / "no-such-sysroot"))
    assert rc == 1 and not out
    assert f"error: --root {tmp_path / 'no-such-sysroot'}: not a folder" in err
