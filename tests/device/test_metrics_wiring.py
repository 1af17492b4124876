"""The daemon makes one ``/metrics`` renderer and hands it to what feeds it (issue 19).

There used to be a module-level table of renderers that the telemetry agent and the MQTT
transport wrote into and the HTTP transport read from; now the daemon passes the renderer
explicitly, so a real ``edged run`` must show every part on one scrape.
"""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from edged.client.http import HttpClient
from tests.mqtt_helpers import Broker, EdgedRun
from tests.netutil import free_port


def test_one_scrape_shows_every_part_the_daemon_wired(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    port = free_port()
    run: EdgedRun | None = None
    try:
        # Started once it answered one MQTT request; telemetry samples every second.
        run = EdgedRun(tmp_path / "edged", broker, "wired", http_listen=f"127.0.0.1:{port}")
        end = time.monotonic() + 60
        with HttpClient(f"http://127.0.0.1:{port}") as c:
            while True:
                r = c.request("GET", "/metrics")
                assert r.status == 200
                fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
                samples = fams.get("edged_telemetry_samples")
                if (samples is not None and samples.samples[0].value >= 1) or time.monotonic() > end:
                    break
                time.sleep(0.2)
        assert samples is not None, "the telemetry agent's families are missing from /metrics"
        assert samples.samples[0].value >= 1
        # The MQTT transport's counts: at least the request EdgedRun waited on.
        assert fams["edged_mqtt_requests"].samples[0].value >= 1
        # The agent's device sampler, bound to the same renderer.
        assert "edged_device_cpu_seconds" in fams
        # And the service's own model series.
        success = [s for s in fams["edged_inference_request_success"].samples
                   if s.name.endswith("_total") and s.labels.get("model") == "digits"]
        assert success and sum(s.value for s in success) >= 1
    finally:
        if run is not None:
            run.stop()
        broker.stop()
