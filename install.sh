#!/usr/bin/env bash
# Set up edged.
#   ./install.sh --dev     a development environment in ./.venv (package + test and lint tools)
#   ./install.sh           (as root) install the daemon for real: /opt/edged, /etc/edged, systemd unit
#   ./install.sh --uninstall   (as root) remove what the real install added (config and state are kept)
# Debian packages the project needs are installed when missing and we are root; otherwise we say
# exactly what to install.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=system
with_mosquitto=0
wheelhouse=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) mode=dev ;;
    --uninstall) mode=uninstall ;;
    --with-mosquitto) with_mosquitto=1 ;;
    --wheelhouse) wheelhouse=$2; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf 'install.sh: %s\n' "$*" >&2; }
is_root() { [ "$(id -u)" -eq 0 ]; }

# Debian packages: the broker and its clients for the MQTT transport and tests, headers for
# systemd-python, a compiler for wheels that build from source, and Python's venv module.
deb_packages=(mosquitto mosquitto-clients libsystemd-dev pkg-config gcc python3-dev python3-venv)

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
  pip_install "$here/.venv" -e "$here[$extras]"
  say "development environment ready: $here/.venv (run .venv/bin/edged run, or .venv/bin/python -m pytest)"
  exit 0
fi

if ! is_root; then
  say "the system install needs root: run 'sudo ./install.sh', or './install.sh --dev' for a local setup"
  exit 1
fi

prefix=/opt/edged
if [ "$mode" = uninstall ]; then
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now edged.service 2>/dev/null || true
  fi
  rm -f /etc/systemd/system/edged.service /usr/local/bin/edged
  rm -rf "$prefix" /usr/share/edged
  say "removed edged (kept /etc/edged and /var/lib/edged)"
  exit 0
fi

pkgs=(python3-venv)
[ "$with_mosquitto" = 1 ] && pkgs+=(mosquitto)
ensure_debs "${pkgs[@]}"
py=$(pick_python)
[ -x "$prefix/bin/python" ] || "$py" -m venv "$prefix"
pip_install "$prefix" --upgrade "$here[openvino]"
ln -sf "$prefix/bin/edged" /usr/local/bin/edged
install -d -m 0755 /usr/share/edged
rm -rf /usr/share/edged/models.new && cp -r "$here/models" /usr/share/edged/models.new
rm -rf /usr/share/edged/models && mv /usr/share/edged/models.new /usr/share/edged/models
rm -rf /usr/share/edged/device_profiles && cp -r "$here/device_profiles" /usr/share/edged/device_profiles
install -d -m 0755 /etc/edged
if [ ! -e /etc/edged/edged.toml ]; then
  install -m 0644 "$here/packaging/edged.toml" /etc/edged/edged.toml
fi
install -d -m 0750 /var/lib/edged
if [ -f "$here/packaging/systemd/edged.service" ] && [ -d /run/systemd/system ]; then
  install -m 0644 "$here/packaging/systemd/edged.service" /etc/systemd/system/edged.service
  systemctl daemon-reload
  systemctl enable --now edged.service
  say "edged installed and started: systemctl status edged"
else
  say "edged installed in $prefix; systemd is not running here, start it with: edged run"
fi
