"""A real mosquitto for tests and benchmarks: free loopback port, generated config, optional TLS.

Also a small paho test client that collects what it receives, and a test CA made
with the ``openssl`` command (server and client certificates signed by it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.netutil import free_port

MOSQUITTO = "/usr/sbin/mosquitto"


@dataclass
class TestCA:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_test_ca(folder: Path) -> TestCA:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=edged test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (folder / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=edged test {name}",
                 cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=folder)
    return TestCA(folder / "ca.crt", folder / "server.crt", folder / "server.key",
                  folder / "client.crt", folder / "client.key")


def terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Broker:
    """One mosquitto process on 127.0.0.1; ``restart`` keeps the same ports."""

    def __init__(self, workdir: Path, *, ca: TestCA | None = None, passwords: dict[str, str] | None = None,
                 nodelay: bool = False, stock: bool = False, include_dir: Path | None = None,
                 acl: str | None = None) -> None:
        """``acl``: the text of a mosquitto ACL file (with ``passwords``: who may publish and read what)."""
        self.workdir = workdir
        self.acl = acl
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.ca = ca
        self.tls_port = free_port() if ca else None
        self.passwords = passwords
        self.nodelay = nodelay  # set_tcp_nodelay: without it the broker's small writes can wait 40 ms for an ACK
        # stock: Debian's mosquitto.conf as shipped (its conf.d empty), only moved to a free loopback port;
        # allow_anonymous stands in for the local-only mode mosquitto 2 enters when no listener is set.
        self.stock = stock
        self.include_dir = include_dir  # with stock: Debian's include_dir /etc/mosquitto/conf.d, pointed here
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _config(self) -> str:
        if self.stock:
            include = f"include_dir {self.include_dir}\n" if self.include_dir else ""
            return f"persistence false\nlistener {self.port} 127.0.0.1\nallow_anonymous true\n{include}"
        lines = ["per_listener_settings true", "persistence false", "user root",
                 f"set_tcp_nodelay {'true' if self.nodelay else 'false'}", f"listener {self.port} 127.0.0.1"]
        if self.passwords:
            pw = self.workdir / "passwords"
            pw.write_text("")
            for user, password in self.passwords.items():
                subprocess.run(["mosquitto_passwd", "-b", str(pw), user, password], check=True, capture_output=True)
            lines += ["allow_anonymous false", f"password_file {pw}"]
            if self.acl is not None:
                acl = self.workdir / "acl"
                acl.write_text(self.acl)
                lines.append(f"acl_file {acl}")
        else:
            lines.append("allow_anonymous true")
        if self.ca:
            lines += [f"listener {self.tls_port} 127.0.0.1", "allow_anonymous true",
                      f"cafile {self.ca.ca}", f"certfile {self.ca.server_cert}", f"keyfile {self.ca.server_key}",
                      "require_certificate true"]
        return "\n".join(lines) + "\n"

    def start(self) -> Broker:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self._config())
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        ports = [self.port] + ([self.tls_port] if self.tls_port else [])
        for port in ports:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mosquitto exited: {self.log.read_text()[-2000:]}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("mosquitto did not start listening")
                time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc:
            terminate(self.proc, 5)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def running_broker(workdir: Path, **kw: Any) -> Iterator[Broker]:
    broker = Broker(workdir, **kw).start()
    try:
        yield broker
    finally:
        broker.stop()


class RefusingBroker:
    """A minimal MQTT 3.1.1/5 server that accepts the connection and refuses every subscription.

    mosquitto's ACLs grant a forbidden subscription and then silently withhold its messages, so
    a refused SUBACK (what other brokers send for an ACL denial) needs this stand-in. It records
    the PUBLISH packets it receives as ``(topic, payload)``.
    """

    def __init__(self) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._srv.getsockname()[1])
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.published: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._srv.accept()
                self._conns.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    @staticmethod
    def _varint(data: bytes, pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value, pos

    def _serve(self, conn: socket.socket) -> None:
        v5 = False
        with contextlib.suppress(OSError, EOFError), conn:
            while True:
                first = self._read(conn, 1)[0]
                length = shift = 0
                while True:
                    b = self._read(conn, 1)[0]
                    length |= (b & 0x7F) << shift
                    shift += 7
                    if not b & 0x80:
                        break
                body = self._read(conn, length)
                kind = first >> 4
                if kind == 1:  # CONNECT: protocol name, then the level byte
                    name_len = int.from_bytes(body[:2], "big")
                    v5 = body[2 + name_len] == 5
                    conn.sendall(b"\x20\x03\x00\x00\x00" if v5 else b"\x20\x02\x00\x00")
                elif kind == 8:  # SUBSCRIBE: refuse each filter (0x87 not authorized / 0x80 failure)
                    pos = 2
                    if v5:
                        plen, pos = self._varint(body, pos)
                        pos += plen
                    count = 0
                    while pos < len(body):
                        pos += 2 + int.from_bytes(body[pos:pos + 2], "big") + 1
                        count += 1
                    codes = (b"\x87" if v5 else b"\x80") * count
                    reply = body[:2] + (b"\x00" if v5 else b"") + codes
                    conn.sendall(bytes([0x90, len(reply)]) + reply)
                elif kind == 3:  # PUBLISH: record it, acknowledge QoS 1
                    tlen = int.from_bytes(body[:2], "big")
                    topic = body[2:2 + tlen].decode()
                    pos = 2 + tlen
                    pid = b""
                    if (first >> 1) & 3:
                        pid = body[pos:pos + 2]
                        pos += 2
                    if v5:
                        plen, pos = self._varint(body, pos)
                        pos += plen
                    self.published.put((topic, body[pos:]))
                    if pid:
                        conn.sendall(b"\x40\x02" + pid)
                elif kind == 12:  # PINGREQ
                    conn.sendall(b"\xd0\x00")
                elif kind == 14:  # DISCONNECT
                    return

    def close(self) -> None:
        self._srv.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def publish_properties(**values: Any) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    for k, v in values.items():
        setattr(props, k, v)
    return props


class TestClient:
    """A paho client that records every message it receives, for assertions."""

    __test__ = False  # not a pytest class

    def __init__(self, port: int, *, v5: bool = True, tls: dict[str, Any] | None = None,
                 client_id: str | None = None, auth: tuple[str, str] | None = None) -> None:
        self.v5 = v5
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connected = threading.Event()
        self.failed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"test-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
        if tls:
            self.client.tls_set(**tls)
        if auth:
            self.client.username_pw_set(*auth)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_connect_fail = lambda c, u: self.failed.set()
        self.client.on_disconnect = lambda c, u, f, r, p: self.failed.set()
        self.client.connect_async("127.0.0.1", port, keepalive=30)
        self.client.loop_start()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        (self.failed if reason.is_failure else self.connected).set()

    def wait_connected(self, timeout: float = 10) -> TestClient:
        assert self.connected.wait(timeout), "test client did not connect"
        return self

    def subscribe(self, topic: str, qos: int = 1) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(topic, qos)
        assert done.wait(10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, **props: Any) -> None:
        properties = publish_properties(**props) if props else None
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if qos:
            info.wait_for_publish(10)

    def get(self, timeout: float = 10, where: Callable[[mqtt.MQTTMessage], bool] | None = None) -> mqtt.MQTTMessage:
        """The next message (matching ``where``); others are discarded."""
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError("no matching MQTT message arrived")
            try:
                msg = self.messages.get(timeout=remaining)
            except queue.Empty:
                raise AssertionError("no matching MQTT message arrived") from None
            if where is None or where(msg):
                return msg

    def drain(self, quiet: float = 0.2) -> list[mqtt.MQTTMessage]:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.messages.get(timeout=quiet))
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def user_properties(msg: mqtt.MQTTMessage) -> dict[str, str]:
    return dict(getattr(msg.properties, "UserProperty", None) or [])


def process_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- request/reply drivers for the stall measurements (tests and bench/mqtt_stall.py) ------------
DIGIT = [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
         0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]


def digits_json(request_id: str, reply_to: str) -> bytes:
    """A one-line v2 JSON request for ``digits`` addressed the MQTT 3.1.1 way (works on any client)."""
    return (f'{{"id":"{request_id}","reply_to":"{reply_to}","inputs":[{{"name":"pixels","datatype":"FP32",'
            f'"shape":[1,64],"data":{DIGIT}}}]}}').replace(" ", "").encode()


@dataclass
class LoopResult:
    """A closed loop at concurrency 1: how many round trips fit in the time, and their latencies (ms)."""

    done: int
    seconds: float
    latencies_ms: list[float]
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    @property
    def p50_ms(self) -> float:
        s = sorted(self.latencies_ms)
        return s[len(s) // 2] if s else float("nan")


def closed_loop(call: Callable[[int], bool], seconds: float, *, warmup: int = 5) -> LoopResult:
    """Run ``call(i)`` (one round trip; False for an error reply) back to back for ``seconds``."""
    for i in range(warmup):
        call(-1 - i)
    lat: list[float] = []
    errors = 0
    start = time.monotonic()
    end = start + seconds
    i = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        if not call(i):
            errors += 1
        lat.append((time.perf_counter() - t0) * 1e3)
        i += 1
    return LoopResult(i, time.monotonic() - start, lat, errors)


class PahoRequester:
    """What a user writes with plain paho: one connection, default socket options, MQTT 5 Response Topic
    and Correlation Data, requests at ``qos``, the reply topic subscribed at ``reply_qos``."""

    def __init__(self, port: int, infer_topic: str, *, qos: int, reply_qos: int) -> None:
        self.topic, self.qos = infer_topic, qos
        self.reply_topic = f"{infer_topic.split('/infer/', 1)[0]}/reply/paho-{uuid.uuid4().hex[:8]}"
        self.replies: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = lambda c, u, m: self.replies.put(m)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(self.reply_topic, reply_qos)
        assert subscribed.wait(10), "no SUBACK"
        x = digits_json("0", self.reply_topic)
        self.payload = x

    def __call__(self, i: int) -> bool:
        corr = str(i).encode() + uuid.uuid4().bytes
        self.client.publish(self.topic, self.payload, qos=self.qos,
                            properties=publish_properties(ResponseTopic=self.reply_topic, CorrelationData=corr))
        while True:
            msg = self.replies.get(timeout=10)
            if getattr(msg.properties, "CorrelationData", None) == corr:
                return b'"error"' not in msg.payload

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class MosquittoCliRequester:
    """``mosquitto_pub -l`` (one request per stdin line) and ``mosquitto_sub`` (one reply per stdout line):
    two connections, the tools' default socket options."""

    def __init__(self, port: int, infer_topic: str, *, qos: int, reply_qos: int, timeout: float = 10) -> None:
        self.reply_topic = f"{infer_topic.split('/infer/', 1)[0]}/reply/cli-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        common = ["-h", "127.0.0.1", "-p", str(port), "-V", "mqttv5"]
        self.sub = subprocess.Popen(["mosquitto_sub", *common, "-q", str(reply_qos), "-t", self.reply_topic],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_subscribed(port)
        self.pub = subprocess.Popen(["mosquitto_pub", *common, "-q", str(qos), "-t", infer_topic, "-l"],
                                    stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.run = uuid.uuid4().hex[:8]
        self.sent = itertools.count()  # request ids never repeat: edged rightly ignores a repeated one
        # mosquitto_pub reads stdin before its CONNACK: a QoS 0 line sent too early is lost. Retry until served.
        for k in range(int(self.timeout)):
            with contextlib.suppress(AssertionError):
                self._round_trip(f"ready{k}", 1.0)
                break
        else:
            raise AssertionError("no reply through mosquitto_pub/mosquitto_sub")

    def _read(self) -> None:
        assert self.sub.stdout is not None
        for line in self.sub.stdout:
            self.lines.put(line)

    def _wait_subscribed(self, port: int) -> None:
        """mosquitto_sub says nothing once subscribed: probe its topic until a probe comes out."""
        probe = mqtt.Client(CallbackAPIVersion.VERSION2)
        probe.connect("127.0.0.1", port, keepalive=30)
        probe.loop_start()
        try:
            end = time.monotonic() + self.timeout
            while time.monotonic() < end:
                probe.publish(self.reply_topic, b"probe", qos=0)
                with contextlib.suppress(queue.Empty):
                    if self.lines.get(timeout=0.2).strip() == b"probe":
                        return
            raise AssertionError("mosquitto_sub did not subscribe")
        finally:
            probe.disconnect()
            probe.loop_stop()

    def __call__(self, i: int) -> bool:
        return self._round_trip(str(i), self.timeout)

    def _round_trip(self, i: str, timeout: float) -> bool:
        assert self.pub.stdin is not None
        rid = f"{self.run}-{next(self.sent)}-{i}"
        self.pub.stdin.write(digits_json(rid, self.reply_topic) + b"\n")
        self.pub.stdin.flush()
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no reply to request {rid} within {timeout}s") from None
            if f'"id":"{rid}"'.encode() in line:
                return b'"error"' not in line

    def close(self) -> None:
        for p in (self.pub, self.sub):
            with contextlib.suppress(OSError):
                if p.stdin:
                    p.stdin.close()
            terminate(p, 5)


class EdgedRun:
    """A real ``edged run`` (MQTT, HTTP when asked; the bundled ``digits``) in its own process, serving once started."""

    def __init__(self, tmp: Path, broker: Broker, device: str, extra_mqtt: str = "", *, timeout: float = 120,
                 http_listen: str | None = None, probe_auth: tuple[str, str] | None = None) -> None:
        """``http_listen``: also serve HTTP there (off otherwise); ``probe_auth``: the broker account of the
        client that checks the daemon serves (user, password)."""
        from tests.conftest import EDGED, MODELS, REPO_ROOT

        tmp.mkdir(parents=True, exist_ok=True)
        shutil.copytree(MODELS / "digits", tmp / "models" / "digits", dirs_exist_ok=True)
        self.config = tmp / "edged.toml"
        self.runtime_dir = tmp / "run"
        self.config.write_text(f"""
[device]
id = "{device}"
state_dir = "{tmp / 'state'}"
runtime_dir = "{self.runtime_dir}"
model_repository = "{tmp / 'models'}"
profile = "generic"
[http]
{f'listen = "{http_listen}"' if http_listen else 'enabled = false'}
[shm]
enabled = false
[telemetry]
interval_s = 1
[mqtt]
url = "{broker.url}"
{extra_mqtt}
""")
        self.log = tmp / "edged.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([*EDGED, "run", "--config", str(self.config)], cwd=REPO_ROOT,
                                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                         stdout=out, stderr=subprocess.STDOUT)
        self._wait_serving(broker, device, timeout, probe_auth)

    def _wait_serving(self, broker: Broker, device: str, timeout: float,
                      auth: tuple[str, str] | None = None) -> None:
        import numpy as np

        from edged.client.mqtt import MqttClient

        end = time.monotonic() + timeout
        user, password = auth or (None, None)
        with MqttClient(broker.url, device, username=user, password=password) as c:
            while True:
                try:
                    c.infer("digits", {"pixels": np.asarray([DIGIT], np.float32)}, timeout=1)
                    return
                except Exception:
                    if self.proc.poll() is not None or time.monotonic() > end:
                        self.stop()
                        raise RuntimeError(f"edged run did not serve: {self.log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        terminate(self.proc, 15)


@contextlib.contextmanager
def mosquitto_sub(port: int, topic: str, count: int, *, fmt: str = "%t|%D|%p") -> Iterator[subprocess.Popen[str]]:
    """mosquitto_sub (MQTT 5) that is known to be subscribed before the body runs.

    A retained marker on a second topic arrives only once both subscriptions exist.
    """
    marker = f"sync/{uuid.uuid4().hex}"
    subprocess.run(["mosquitto_pub", "-p", str(port), "-t", marker, "-r", "-m", "x"], check=True)
    proc = subprocess.Popen(["mosquitto_sub", "-V", "mqttv5", "-p", str(port), "-t", topic, "-t", marker,
                             "-C", str(count + 1), "-W", "30", "-F", fmt], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(marker)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
