"""Issue 36, attack 2: a request's response topic must not steer where the daemon publishes.

A real mosquitto with users (``mosquitto_passwd``) and an ACL file, a real ``edged run``. The
daemon's account may publish anywhere (``#``, as in the attack); the attacker's account may only
publish requests and use its own topics. Through the daemon it tries to publish to another
device's infer topic, to the daemon's status and model-status topics and to the fleet's
sync-nudge, with MQTT 5 Response Topics and with MQTT 3.1.1 ``reply_to``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edged.client.mqtt import MqttClient
from tests.mqtt_helpers import DIGIT, Broker, EdgedRun, TestClient, digits_json
from tests.netutil import free_port

pytestmark = pytest.mark.timeout(180)

USERS = {"daemon": "d-secret", "attacker": "a-secret", "observer": "o-secret", "app": "p-secret"}
ACL = """
user daemon
topic readwrite #

user attacker
topic write edged/dev/infer/#
topic readwrite attacker/#

user observer
topic read #

user app
topic write edged/dev/infer/#
topic read edged/dev/reply/app/#
"""
TARGETS = ["edged/other/infer/digits", "edged/dev/status", "edged/dev/models/digits/status",
           "edged/fleet/sync-nudge", "edged/dev/errors", "attacker/inbox"]


def _attack_marked(msg: mqtt.MQTTMessage) -> bool:
    corr = getattr(msg.properties, "CorrelationData", None) if msg.properties is not None else None
    return (corr is not None and corr.startswith(b"attack")) or b"attack-" in msg.payload


def test_response_topics_outside_the_reply_namespace_are_refused(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker", passwords=USERS, acl=ACL).start()
    port = free_port()
    daemon = None
    observer = attacker = attacker311 = None
    try:
        daemon = EdgedRun(tmp_path / "edged", broker, "dev", 'username = "daemon"\npassword = "d-secret"',
                          http_listen=f"127.0.0.1:{port}", probe_auth=("app", "p-secret"))
        observer = TestClient(broker.port, auth=("observer", "o-secret")).wait_connected()
        observer.subscribe("#", qos=0)
        observer.drain(0.3)  # retained status messages
        attacker = TestClient(broker.port, auth=("attacker", "a-secret")).wait_connected()
        attacker311 = TestClient(broker.port, v5=False, auth=("attacker", "a-secret")).wait_connected()
        n = 0
        for i, target in enumerate(TARGETS):
            attacker.publish("edged/dev/infer/digits", digits_json(f"attack-5-{i}", "attacker/x").replace(
                b'"reply_to":"attacker/x",', b""), ResponseTopic=target, CorrelationData=f"attack-{i}".encode())
            attacker311.publish("edged/dev/infer/digits", digits_json(f"attack-311-{i}", target))
            n += 2
        seen: list[mqtt.MQTTMessage] = []
        notes: list[mqtt.MQTTMessage] = []
        end = time.monotonic() + 15
        while len(notes) < n and time.monotonic() < end:
            try:
                msg = observer.get(timeout=max(0.05, end - time.monotonic()))
            except AssertionError:
                break
            if msg.topic == "edged/dev/errors":
                notes.append(msg)
            elif msg.topic != "edged/dev/infer/digits" and (msg.topic in TARGETS or _attack_marked(msg)):
                seen.append(msg)
        steered = [(m.topic, m.payload[:80]) for m in seen if _attack_marked(m)]
        assert not steered, f"the daemon published a reply where the requester said: {steered}"
        assert len(notes) == n, f"{len(notes)} of {n} refusals were said on edged/dev/errors"
        bodies = [json.loads(m.payload) for m in notes]
        assert {b["code"] for b in bodies} == {"permission_denied"}
        assert {b["response_topic"] for b in bodies} == set(TARGETS)
        assert {b["id"] for b in bodies if "id" in b} == {f"attack-311-{i}" for i in range(len(TARGETS))}
        corr = {m.properties.CorrelationData for m in notes if hasattr(m.properties, "CorrelationData")}
        assert corr == {f"attack-{i}".encode() for i in range(len(TARGETS))}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f"edged_mqtt_replies_refused_total {float(n)}" in metrics
        # A well-behaved client, allowed only its own reply subtree, is still served.
        with MqttClient(broker.url, "dev", username="app", password="p-secret") as c:
            assert c.reply_topic.startswith("edged/dev/reply/app/")
            out = c.infer("digits", {"pixels": np.asarray([DIGIT], np.float32)}, timeout=10)
            assert next(iter(out.values())).shape[-1] == 10
    finally:
        for c in (observer, attacker, attacker311):
            if c is not None:
                c.close()
        if daemon is not None:
            daemon.stop()
        broker.stop()
