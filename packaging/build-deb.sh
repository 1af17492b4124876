#!/bin/sh
# Build the edged Debian packages: dist/edged_<version>_<arch>.deb and, unless --no-openvino,
# dist/edged-openvino_<version>_<arch>.deb (OpenVINO's wheel alone is larger than everything else).
#
#   packaging/build-deb.sh [--out DIR] [--arch amd64|arm64] [--python X.Y]... [--glibc X.Y]
#                          [--no-openvino] [--no-pin] [--find-links DIR] [--wheelhouse DIR]
#
# --wheelhouse DIR also leaves the wheels there (with OpenVINO's, unless --no-openvino):
# `./install.sh --wheelhouse DIR` installs from it on a device without network.
#
# The packages carry the application and every Python dependency as wheels for the target
# (architecture, CPython version, glibc), so they install with no network: postinst builds
# /opt/edged with the device's own python3. Wheels come from PyPI (or --find-links); by default
# they are pinned to the versions installed in the Python that builds (the ones the tests ran
# with). --python can repeat (e.g. 3.10 for JetPack 6 / Ubuntu 22.04, 3.11 for Debian 12).
# Needs: dpkg-deb, gzip, a Python with pip (PYTHON=..., default ./.venv/bin/python, else python3).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")
out=$src/dist
arch=$(dpkg --print-architecture)
pythons=""
glibc=2.35
openvino=1
pin=1
links=""
keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --arch) arch=$2; shift ;;
    --python) pythons="$pythons $2"; shift ;;
    --glibc) glibc=$2; shift ;;
    --no-openvino) openvino=0 ;;
    --no-pin) pin=0 ;;
    --find-links) links="$links --find-links $2"; shift ;;
    --wheelhouse) keep=$2; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build-deb.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf 'build-deb.sh: [%s] %s\n' "$(date +%T)" "$*" >&2; }

py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$src/.venv/bin/python" ]; then py=$src/.venv/bin/python; else py=python3; fi
fi
if [ -z "$pythons" ]; then
  # The target's python3: Debian 12's by default (the build host's, when it is a Debian).
  pythons=$(/usr/bin/python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null || echo 3.11)
fi
case "$arch" in
  amd64) machine=x86_64 ;;
  arm64) machine=aarch64 ;;
  *) say "unsupported architecture $arch (amd64, arm64)"; exit 2 ;;
esac

version=$("$py" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$src/pyproject.toml")
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$src" log -1 --format=%ct 2>/dev/null || date +%s)}
maintainer=${DEB_MAINTAINER:-"edged maintainers <edged-maintainers@example.org>"}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ---- wheels ---------------------------------------------------------------------------------
platforms="--platform manylinux2014_$machine"
minor=17
glibc_minor=${glibc#*.}
while [ "$minor" -le "$glibc_minor" ]; do
  platforms="$platforms --platform manylinux_2_${minor}_$machine"
  minor=$((minor + 1))
done
[ "$machine" = x86_64 ] && platforms="$platforms --platform manylinux2010_x86_64 --platform manylinux1_x86_64"

say "building the edged $version wheel"
mkdir -p "$work/wheels" "$work/openvino"
# From a copy: setuptools would leave build/ and *.egg-info in the checkout.
mkdir -p "$work/src"
cp -R "$src/pyproject.toml" "$src/README.md" "$src/edged" "$work/src/"
find "$work/src" -name __pycache__ -type d -prune -exec rm -rf {} +
"$py" -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$work/src" >&2
edged_whl=$(ls "$work"/wheels/edged-*.whl)

: >"$work/constraints.txt"
if [ "$pin" = 1 ]; then
  "$py" -m pip freeze --exclude-editable 2>/dev/null | grep '==' | grep -v '^edged==' >"$work/constraints.txt" || true
fi

dl() {  # dl DEST PYVER REQUIREMENT...
  dest=$1; pyver=$2; shift 2
  abi=cp$(echo "$pyver" | tr -d .)
  # shellcheck disable=SC2086
  "$py" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$dest" $links \
    --implementation cp --python-version "$pyver" --abi "$abi" --abi abi3 --abi none $platforms \
    --constraint "$work/constraints.txt" "$@" >&2
}
for pyver in $pythons; do
  say "downloading dependencies for CPython $pyver on $arch (glibc >= $glibc)"
  dl "$work/wheels" "$pyver" "${edged_whl}[device]" pip
  if [ "$openvino" = 1 ]; then
    dl "$work/openvino" "$pyver" "openvino>=2024.0"
  fi
done
# The add-on carries only what the base package does not.
for w in "$work"/openvino/*.whl; do
  if [ -e "$w" ] && [ -e "$work/wheels/${w##*/}" ]; then rm -f "$w"; fi
done

if [ -n "$keep" ]; then
  mkdir -p "$keep"
  cp "$work"/wheels/*.whl "$keep/"
  if [ "$openvino" = 1 ]; then cp "$work"/openvino/*.whl "$keep/"; fi
  say "wheelhouse for ./install.sh --wheelhouse: $keep"
fi

# Python versions the wheels serve: the package depends on exactly that range of python3.
lo=$(echo "$pythons" | tr ' ' '\n' | grep . | sort -t. -k2 -n | head -1)
hi=$(echo "$pythons" | tr ' ' '\n' | grep . | sort -t. -k2 -n | tail -1)
next="${hi%%.*}.$((${hi#*.} + 1))"
py_depends="python3 (>= $lo), python3 (<< $next)"

# ---- staging --------------------------------------------------------------------------------
stage_common() {  # stage_common DIR PACKAGE
  mkdir -p "$1/DEBIAN" "$1/usr/share/doc/$2"
  sed "s/@YEAR@/$(date -u -d "@$epoch" +%Y)/" "$here/debian/copyright" >"$1/usr/share/doc/$2/copyright"
  chmod 0644 "$1/usr/share/doc/$2/copyright"
  date_r=$(date -u -R -d "@$epoch")
  printf '%s (%s) unstable; urgency=medium\n\n  * Release %s.\n\n -- %s  %s\n' \
    "$2" "$version" "$version" "$maintainer" "$date_r" | gzip -9n >"$1/usr/share/doc/$2/changelog.gz"
}

finish() {  # finish DIR PACKAGE DEPENDS RECOMMENDS SUGGESTS SYNOPSIS DESCRIPTION-FILE
  d=$1
  (cd "$d" && find . -path ./DEBIAN -prune -o -type f -print | sed 's|^\./||' | LC_ALL=C sort |
    xargs -r md5sum) >"$d/DEBIAN/md5sums"
  size=$(du -sk --exclude=DEBIAN "$d" | cut -f1)
  {
    echo "Package: $2"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $size"
    echo "Depends: $3"
    [ -n "$4" ] && echo "Recommends: $4"
    [ -n "$5" ] && echo "Suggests: $5"
    echo "Section: misc"
    echo "Priority: optional"
    echo "Description: $6"
    sed 's/^/ /; s/^ $/ ./' "$7"
  } >"$d/DEBIAN/control"
  find "$d" -exec touch -h -d "@$epoch" {} +
  mkdir -p "$out"
  deb="$out/${2}_${version}_${arch}.deb"
  # gzip, not xz: the payload is mostly wheels (zip files already); xz saved 1.7% and took 17x longer.
  dpkg-deb --root-owner-group -Zgzip --build "$d" "$deb" >/dev/null
  say "wrote $deb ($(du -h "$deb" | cut -f1))"
}

s=$work/edged
stage_common "$s" edged
install -m 0755 "$here/debian/postinst" "$here/debian/prerm" "$here/debian/postrm" "$s/DEBIAN/"
printf '%s\n' /etc/edged/edged.toml /etc/mosquitto/conf.d/edged-nodelay.conf >"$s/DEBIAN/conffiles"
install -D -m 0640 "$here/edged.toml" "$s/etc/edged/edged.toml"  # postinst: root:edged (secrets inside)
# The broker drop-in for a local mosquitto (installed now or later): no 40 ms delayed-ACK stall per request.
install -D -m 0644 "$here/mosquitto/edged-nodelay.conf" "$s/etc/mosquitto/conf.d/edged-nodelay.conf"
install -D -m 0755 "$here/bin/edged" "$s/usr/bin/edged"
mkdir -p "$s/usr/share/man/man1"
gzip -9n <"$here/edged.1" >"$s/usr/share/man/man1/edged.1.gz"
install -D -m 0755 "$here/edged-setup" "$s/usr/lib/edged/edged-setup"
mkdir -p "$s/usr/lib/edged/wheels"
install -m 0644 "$work"/wheels/*.whl "$s/usr/lib/edged/wheels/"
echo "edged[device]==$version" >"$s/usr/lib/edged/requirements.txt"
install -D -m 0644 "$here/systemd/edged.service" "$s/lib/systemd/system/edged.service"
install -D -m 0644 "$here/sysusers.d/edged.conf" "$s/usr/lib/sysusers.d/edged.conf"
install -D -m 0644 "$here/tmpfiles.d/edged.conf" "$s/usr/lib/tmpfiles.d/edged.conf"
mkdir -p "$s/usr/share/edged/systemd"
cp -R "$here/systemd/dropins" "$s/usr/share/edged/systemd/dropins"
cp -R "$src/models" "$s/usr/share/edged/models"
# Example model files fetched into a checkout (tools/fetch_example_models.py, git-ignored) stay out.
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$src" ls-files --others --ignored --exclude-standard -- models |
    while IFS= read -r f; do rm -f "$s/usr/share/edged/$f"; done
fi
cp -R "$src/device_profiles" "$s/usr/share/edged/device_profiles"
find "$s/usr/share/edged" -type d -exec chmod 0755 {} + -o -type f -exec chmod 0644 {} +
if [ -f "$src/docs/packaging.md" ]; then
  gzip -9n <"$src/docs/packaging.md" >"$s/usr/share/doc/edged/packaging.md.gz"
fi
py_list=$(echo "$pythons" | xargs | sed 's/ /, /g')
cat >"$work/edged.desc" <<EOF
edged probes the hardware, picks a device profile and serves every model in
its repository with the best engine the device runs (TensorRT on Jetson,
OpenVINO on Intel, ONNX Runtime everywhere), over shared memory, MQTT and
KServe v2 HTTP.

The package carries edged and all its Python dependencies as wheels for
CPython $py_list on $arch; the postinst builds /opt/edged from them with no
network access, so it installs on air-gapped devices. OpenVINO comes in
edged-openvino.
EOF
finish "$s" edged "$py_depends" "python3-systemd" "mosquitto, edged-openvino" \
  "inference daemon for edge devices" "$work/edged.desc"

if [ "$openvino" = 1 ]; then
  o=$work/edged-openvino
  stage_common "$o" edged-openvino
  install -m 0755 "$here/debian/openvino-postinst" "$o/DEBIAN/postinst"
  install -m 0755 "$here/debian/openvino-postrm" "$o/DEBIAN/postrm"
  mkdir -p "$o/usr/lib/edged/wheels-extra/openvino"
  install -m 0644 "$work"/openvino/*.whl "$o/usr/lib/edged/wheels-extra/openvino/"
  echo "openvino>=2024.0" >"$o/usr/lib/edged/wheels-extra/openvino/requirements.txt"
  cat >"$work/openvino.desc" <<EOF
Adds Intel's OpenVINO runtime (CPU, integrated GPU, NPU) to edged's virtual
environment in /opt/edged, offline, from the wheels this package carries.
EOF
  finish "$o" edged-openvino "edged (= $version)" "" "" "OpenVINO engine for the edged inference daemon" \
    "$work/openvino.desc"
fi
