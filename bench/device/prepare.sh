#!/usr/bin/env bash
# Gather, on a development machine that reaches the package index, what the 16-core device host lacks
# for the benchmark suite (issue 41), into .device/ (ignored by git; the device tool carries it):
#   .device/whl/        cp312 manylinux wheels of edged's pure-Python and compiled dependencies that
#                       the device image does not hold, at the versions this checkout's .venv runs
#   .device/mosquitto/  this machine's mosquitto, its non-glibc libraries, and a wrapper that finds them
# Then, on the device: bash bench/device/run.sh (see there). Nothing here is installed or changed.
#
#   bash bench/device/prepare.sh            # PY_VERSION=3.12 (the device's Python) by default
set -euo pipefail
cd "$(dirname "$0")/../.."
py_version=${PY_VERSION:-3.12}
dest=.device
venv_python=.venv/bin/python
[ -x "$venv_python" ] || { echo "prepare.sh: run ./install.sh --dev first (versions are read from .venv)" >&2; exit 2; }

# What the device's image lacks (its package list: numpy, onnxruntime, psutil and prometheus-client are
# there). typing-extensions, grpcio and protobuf are there too, at versions of their own: ours travel so
# that pydantic gets the typing-extensions it needs and the generated protobuf code and the server's
# options match what was measured here.
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson pysimdjson
          httptools cryptography cffi pycparser paho-mqtt grpcio protobuf)

rm -rf "$dest/whl" "$dest/mosquitto"
mkdir -p "$dest/whl" "$dest/mosquitto/lib"
pins=()
for name in "${packages[@]}"; do
  version=$("$venv_python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ -n "$version" ] || { echo "prepare.sh: $name is not installed in .venv" >&2; exit 2; }
  pins+=("$name==$version")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$venv_python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" \
  --implementation cp "${platforms[@]}" -d "$dest/whl" "${pins[@]}"

# mosquitto with the libraries glibc does not provide (the device has glibc >= 2.34, which is all these need)
mosquitto=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$mosquitto" ] || { echo "prepare.sh: mosquitto is not installed here (apt install mosquitto)" >&2; exit 2; }
cp "$mosquitto" "$dest/mosquitto/mosquitto.bin"
ldd "$mosquitto" | awk '/=>/ {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libresolv.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$dest/mosquitto/lib/" ;;
  esac
done
cat > "$dest/mosquitto/mosquitto" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/mosquitto.bin" "$@"
WRAP
chmod +x "$dest/mosquitto/mosquitto"
"$dest/mosquitto/mosquitto" -h 2>&1 | head -1 || true  # it exits 3 after its usage
du -sh "$dest" "$dest/whl" "$dest/mosquitto"
ls "$dest/whl"
