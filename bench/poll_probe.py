"""One extra device that only polls, in a process of its own: the registry's poll latency without the simulator.

The fleet simulator times its requests inside one event loop that also runs 10,000
devices; when that loop is busy, an answer that has already arrived waits in its socket
and the wait is counted as the registry's. This probe enrolls one device with its own
token and polls its desired state with the ETag (as a device in steady state does) at a
fixed rate from a blocking client that does nothing else, so what it times is the
registry's answer and the kernel's scheduling of an idle process. It writes
``t`` (wall time), ``latency_s`` and ``status`` to ``--out`` (npz) when it is stopped
(SIGINT or SIGTERM).

    python bench/poll_probe.py --url http://127.0.0.1:PORT --token TOKEN --rate 10 --out probe.npz
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edged.protocol.fleet.messages import API_PREFIX  # noqa: E402


class StopProbeError(Exception):
    pass


def _stop(*_: object) -> None:
    raise StopProbeError


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True, help="an enrollment token for one device")
    p.add_argument("--device-id", default="probe-0")
    p.add_argument("--rate", type=float, default=10.0, help="polls per second")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    u = urlsplit(args.url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=60)
    conn.request("POST", f"{API_PREFIX}/enroll", body=json.dumps({"token": args.token, "device_id": args.device_id}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        print(f"probe enrollment refused: {r.status} {body[:200]!r}", file=sys.stderr)
        return 1
    auth = {"Authorization": f"Bearer {json.loads(body)['credential']}"}
    t: list[float] = []
    lat: list[float] = []
    st: list[int] = []
    etag = ""
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    period = 1.0 / args.rate
    nxt = time.monotonic()
    try:
        while True:
            h = dict(auth, **({"If-None-Match": etag} if etag else {}))
            t0 = time.perf_counter()
            try:
                conn.request("GET", f"{API_PREFIX}/device/desired-state", headers=h)
                r = conn.getresponse()
                r.read()
                status = r.status
            except (OSError, http.client.HTTPException):
                conn.close()
                status = 0
            lat.append(time.perf_counter() - t0)
            t.append(time.time())
            st.append(status)
            if status == 200:
                etag = r.getheader("etag") or ""
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))
    except StopProbeError:
        pass
    np.savez(args.out, t=np.array(t), latency_s=np.array(lat), status=np.array(st, dtype=np.int32))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
