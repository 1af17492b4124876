"""Dashboard operator accounts: scrypt password hashes in the settings, sessions bound to them.

The login over HTTP (an operator's password opens the dashboard, a wrong one, the admin token
given as an operator's password and a device credential do not) is in test_dashboard.py.
"""

from __future__ import annotations

import subprocess

import pytest
from pydantic import ValidationError

from edged.registry.passwords import check_password, hash_password, is_password_hash
from edged.registry.settings import RegistrySettings
from edged.registry.web.session import ADMIN, Sessions
from tests.registry_helpers import PY

ADMIN_HASH = "a" * 64


def test_password_hashes() -> None:
    h = hash_password("correct horse")
    assert is_password_hash(h) and h.startswith("scrypt$16384$8$1$")
    assert check_password("correct horse", h)
    assert not check_password("correct hors", h)
    assert not check_password("", h)
    assert hash_password("correct horse") != h  # salted
    # no such operator, or a stored value that is not a hash: refused after the same work
    assert not check_password("correct horse", None)
    assert not check_password("correct horse", "plain text")
    for bad in ("", "x" * 1025):
        with pytest.raises(ValueError, match="1 to 1024"):
            hash_password(bad)
    # parameters out of range are not accepted as a hash (no 2^30 memory bomb from a settings file)
    assert not is_password_hash(h.replace("$16384$", "$1073741824$"))
    assert not is_password_hash(h.replace("$16384$", "$1000$"))


def test_the_cli_prints_a_hash_from_stdin() -> None:
    r = subprocess.run([PY, "-m", "edged.registry", "operator-hash"], input="s3cret pass\n", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert check_password("s3cret pass", r.stdout.strip())
    r = subprocess.run([PY, "-m", "edged.registry", "operator-hash"], input="\n", capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "1 to 1024" in r.stderr


def test_settings_accept_only_hashes_and_plain_names() -> None:
    h = hash_password("pw")
    assert RegistrySettings(operators={"alice": h, "ops-2": h}).operators["alice"] == h
    for ops, what in (({"alice": "pw"}, "not a hash"), ({"Alice": h}, "a name is"), ({"admin": h}, "not 'admin'"),
                      ({"a.b": h}, "a name is")):
        with pytest.raises(ValidationError, match=what):
            RegistrySettings(operators=ops)


def test_sessions_are_bound_to_the_operator_password() -> None:
    h = hash_password("pw")
    sessions = Sessions(ADMIN_HASH, operators={"alice": h})
    cookie, sess = sessions.issue("alice")
    assert sess.who == "alice" and sessions.check(cookie) == sess
    admin_cookie, admin = sessions.issue()
    assert admin.who == ADMIN and sessions.check(admin_cookie) == admin
    with pytest.raises(ValueError, match="no operator"):
        sessions.issue("mallory")
    # the name in the cookie cannot be swapped for another's, nor for the admin
    v, exp, nonce, who, mac = cookie.split(".")
    assert who == "alice"
    assert sessions.check(".".join([v, exp, nonce, ADMIN, mac])) is None
    assert Sessions(ADMIN_HASH, operators={"alice": h, "bob": h}).check(".".join([v, exp, nonce, "bob", mac])) is None
    # a changed password or a removed operator ends that operator's sessions, not the admin's
    assert Sessions(ADMIN_HASH, operators={"alice": hash_password("pw")}).check(cookie) is None
    assert Sessions(ADMIN_HASH).check(cookie) is None
    assert Sessions(ADMIN_HASH).check(admin_cookie) == admin
    # a new admin token ends every session
    assert Sessions("b" * 64, operators={"alice": h}).check(cookie) is None
    assert Sessions("b" * 64, operators={"alice": h}).check(admin_cookie) is None
    # CSRF tokens belong to their session
    assert Sessions.csrf_ok(sess, sess.csrf) and not Sessions.csrf_ok(sess, admin.csrf)
