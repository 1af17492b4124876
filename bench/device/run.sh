#!/usr/bin/env bash
# The 16-core device host's benchmark run for issue 41, in one command (the device tool's `run`, with
# carry [".device"] from bench/device/prepare.sh). It installs the carried wheels for this interpreter
# (first on sys.path, also in the daemons the suite starts with a PYTHONPATH of their own: a .pth file),
# puts the carried mosquitto where the test broker looks for it when none is installed, prints the host,
# then runs the suite with the engine in the daemon (--engine-processes 0) and in 4 worker processes,
# and the least batcher across processes. Every output goes to $OUT (or ./device-out).
#
#   bash bench/device/run.sh            # about 8 minutes on 16 cores
#   SMOKE=1 bash bench/device/run.sh    # the same steps, minimal rounds: checks the script, not the host
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
python=${PYTHON:-python3}
out=${OUT:-device-out}
site=${DEVICE_SITE:-/tmp/edged-device-site}
mkdir -p "$out"
exec 3>&1 4>&2 > >(tee "$out/run.log") 2>&1
pth=""
# shellcheck disable=SC2317  # run by the EXIT trap
finish() {  # the .pth file comes out again (a development machine's Python keeps no trace), and tee drains
  [ -n "$pth" ] && rm -f "$pth"
  exec 1>&3 2>&4
  wait
}
trap finish EXIT

"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  .device/whl/*.whl || { echo "run.sh: installing the carried wheels failed" >&2; exit 2; }
purelib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pth="$purelib/000-edged-device.pth"
echo "import sys; sys.path.insert(0, '$site')" > "$pth" || { echo "run.sh: cannot write $pth" >&2; pth=""; exit 2; }
if [ ! -x /usr/sbin/mosquitto ]; then
  ln -sf "$PWD/.device/mosquitto/mosquitto" /usr/sbin/mosquitto || { echo "run.sh: no mosquitto" >&2; exit 2; }
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"

echo "== host"
date -u; nproc; grep -m1 "model name" /proc/cpuinfo; free -g | head -2
"$python" - <<'PY' || exit 2
import importlib, sys
print(sys.version)
for m in ("numpy", "onnxruntime", "grpc", "google.protobuf", "pydantic", "orjson", "httptools", "paho.mqtt", "psutil"):
    mod = importlib.import_module(m)
    print(f"  {m} {getattr(mod, '__version__', '?')} {mod.__file__}")
import edged.daemon  # noqa: F401  the daemon's own imports resolve
PY
/usr/sbin/mosquitto -h 2>&1 | head -1

if [ -n "${SMOKE:-}" ]; then
  suite=(--quick --rounds 1 --seconds 0.3); procs=(--seconds 0.3 --rounds 1 --workers 1)
else
  suite=(--quick); procs=()
fi
rc=0
for n in 0 4; do
  echo "== suite, engine processes $n"
  "$python" -m bench.run_suite "${suite[@]}" --engine-processes "$n" --json "$out/suite-p$n.json" \
    > "$out/suite-p$n.txt" 2>&1 || rc=1
  cat "$out/suite-p$n.txt"
done
echo "== least batcher across processes"
"$python" -m bench.floor_procs "${procs[@]}" > "$out/floor_procs.txt" 2>&1 || rc=1
cat "$out/floor_procs.txt"
exit $rc
