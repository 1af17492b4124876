"""A blocking Python client for edged's MQTT transport (what ``edged infer --transport mqtt`` uses).

One connection, one private reply topic; each call sends a v2 request (binary
form by default: no float-to-text conversion) with a fresh correlation and waits
for its reply. Error replies raise :class:`MqttServerError` carrying the server's
error code. Safe to call from several threads at once.
"""

from __future__ import annotations

import math
import ssl
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np

from edged import datatypes
from edged.errors import DeadlineExceededError, EdgedError, ErrorCode

_PORTS = {"mqtt": 1883, "mqtts": 8883}


class MqttServerError(EdgedError):
    """The daemon answered with an error; ``code`` is its ErrorCode."""


class MqttClient:
    def __init__(  # noqa: PLR0913  the public client's connection options, keyword-only after the first three
            self, url: str = "mqtt://127.0.0.1:1883", device_id: str = "", topic_prefix: str = "edged", *,
                 protocol: Literal["5", "3.1.1"] = "5", binary: bool = True, username: str | None = None,
                 password: str | None = None, ca_file: Path | str | None = None, cert_file: Path | str | None = None,
                 key_file: Path | str | None = None, connect_timeout: float = 10.0, qos: int = 1,
                 reply_qos: int = 1, reply_topic: str | None = None) -> None:
        """``reply_topic``: where replies come back; it must lie in the daemon's ``[mqtt] reply_topics``
        (default ``{prefix}/{device}/reply/#``). By default ``{prefix}/{device}/reply/{username}/{client id}``
        (``.../reply/{client id}`` without a username), which a broker ACL can give each user alone
        (mosquitto: ``pattern read edged/+/reply/%u/#``)."""
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from edged.protocol.mqtt_tcp import no_delay, quick_ack

        if not device_id:
            raise EdgedError("MqttClient needs the daemon's device id", code=ErrorCode.INVALID_ARGUMENT)
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
        if parts.scheme not in _PORTS or not parts.hostname:
            raise EdgedError(f"unsupported MQTT URL {url!r}: use mqtt://host:port or mqtts://host:port",
                             code=ErrorCode.INVALID_ARGUMENT)
        self.url = url
        self.base = f"{topic_prefix.rstrip('/')}/{device_id}"
        self.v5 = protocol == "5"
        self.binary = binary
        if qos not in (0, 1, 2) or reply_qos not in (0, 1, 2):
            raise EdgedError("MQTT QoS must be 0, 1 or 2", code=ErrorCode.INVALID_ARGUMENT)
        self.qos, self.reply_qos = qos, reply_qos
        self.last_reply_qos: int | None = None  # the QoS the broker delivered the last reply at
        client_id = f"edged-client-{uuid.uuid4().hex[:12]}"
        owner = f"{username}/" if username and not any(c in username for c in "/+#\0") else ""
        self.reply_topic = reply_topic or f"{self.base}/reply/{owner}{client_id}"
        self._pending: dict[str, Future[tuple[dict[str, Any], memoryview]]] = {}
        self._status_waiters: dict[str, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._ready: Future[None] = Future()
        self._mqtt = mqtt
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                   protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311)
        self._client.suppress_exceptions = True
        if username is not None:
            self._client.username_pw_set(username, password)
        if parts.scheme == "mqtts" or ca_file or cert_file:
            self._client.tls_set(ca_certs=str(ca_file) if ca_file else None,
                                 certfile=str(cert_file) if cert_file else None,
                                 keyfile=str(key_file) if key_file else None,
                                 cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self._client.on_socket_open = no_delay
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        # Our ACK for the broker's PUBACK must not wait 40 ms: the reply is queued behind that PUBACK.
        self._client.on_publish = lambda client, *_: quick_ack(client)
        port = parts.port or _PORTS[parts.scheme]
        try:
            self._client.connect(parts.hostname, port, keepalive=30)
        except OSError as e:
            raise EdgedError(f"cannot reach the MQTT broker at {url}: {e.strerror or e}",
                             code=ErrorCode.UNAVAILABLE) from None
        self._client.loop_start()
        try:
            self._ready.result(connect_timeout)
        except FutureTimeout:
            self.close()
            raise EdgedError(f"the MQTT broker at {url} did not accept the connection within {connect_timeout}s",
                             code=ErrorCode.UNAVAILABLE) from None
        except EdgedError:
            self.close()
            raise

    # ---- paho callbacks --------------------------------------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            if not self._ready.done():
                self._ready.set_exception(EdgedError(f"the MQTT broker refused the connection: {reason}",
                                                     code=ErrorCode.UNAVAILABLE))
            return
        client.subscribe(self.reply_topic, qos=self.reply_qos)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        if not self._ready.done():
            self._ready.set_result(None)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        from edged.protocol import mqtt as codec
        from edged.protocol.mqtt_tcp import quick_ack

        quick_ack(client)

        if msg.topic != self.reply_topic:  # a retained status asked for by model_status()
            with self._lock:
                waiting = self._status_waiters.pop(msg.topic, None)
            if waiting is not None and msg.payload and not waiting.done():
                waiting.set_result(bytes(msg.payload))
            return
        props = msg.properties if self.v5 else None
        corr = getattr(props, "CorrelationData", None) if props is not None else None
        key: object = corr.decode("utf-8", "replace") if isinstance(corr, bytes) else None
        error: EdgedError | None = None
        try:
            hlen = None
            for k, v in (getattr(props, "UserProperty", None) or []) if props is not None else []:
                if k == codec.HEADER_LENGTH_PROPERTY:
                    hlen = int(v)
            frame = codec.parse(msg.payload, hlen)
            if key is None:
                key = frame.header.get("id")
        except Exception as e:
            if key is None:
                return  # no correlation and no readable header: nobody to tell
            # The reply to a request that waits, unreadable: say so now rather than time out.
            error = EdgedError(f"malformed reply from edged: {e}", code=ErrorCode.INTERNAL)
        with self._lock:
            fut = self._pending.pop(key, None) if isinstance(key, str) else None
        if fut is not None and not fut.done():
            self.last_reply_qos = msg.qos
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result((frame.header, frame.tail))

    # ---- requests --------------------------------------------------------------------------
    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None,
              timeout: float = 10.0, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one inference; returns the outputs by name."""
        from edged.protocol import mqtt as codec
        from edged.protocol.mqtt_properties import publish_properties

        corr = uuid.uuid4().hex
        header, chunks = self._encode(inputs, outputs)
        header["id"] = corr
        if not self.v5:
            header["reply_to"] = self.reply_topic
        form = codec.Form.BINARY_PROPERTY if self.v5 else codec.Form.BINARY_PREFIX
        if not self.binary:
            form = codec.Form.JSON
        _, payload, hlen = codec.frame(form, header, chunks, properties=self.v5)
        props = None
        if self.v5:
            users = [(codec.HEADER_LENGTH_PROPERTY, str(hlen))] if form is codec.Form.BINARY_PROPERTY else []
            props = publish_properties(response_topic=self.reply_topic, correlation=corr.encode(),
                                       expiry_s=max(1, math.ceil(timeout)), user=users)
        reply_header, tail = self._round_trip(model, version, payload, props, corr=corr, timeout=timeout)
        return _decode_outputs(reply_header, tail)

    def _round_trip(self, model: str, version: int | None, payload: bytes, props: Any, *, corr: str,
                    timeout: float) -> tuple[dict[str, Any], memoryview]:
        """Publish one request and wait for the reply that carries its correlation id."""
        fut: Future[tuple[dict[str, Any], memoryview]] = Future()
        with self._lock:
            self._pending[corr] = fut
        topic = f"{self.base}/infer/{model}" + (f"/{version}" if version is not None else "")
        try:
            info = self._client.publish(topic, payload, qos=self.qos, properties=props)
            if info.rc != self._mqtt.MQTT_ERR_SUCCESS:
                raise EdgedError(f"cannot publish to the MQTT broker at {self.url}: "
                                 f"{self._mqtt.error_string(info.rc)}", code=ErrorCode.UNAVAILABLE)
            return fut.result(timeout)
        except FutureTimeout:
            raise DeadlineExceededError(f"no reply from edged for model {model!r} within {timeout}s") from None
        finally:
            with self._lock:
                self._pending.pop(corr, None)

    def model_status(self, model: str, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's retained status of ``model`` (state, version, backend, inputs, outputs)."""
        from edged.protocol.v2 import loads

        topic = f"{self.base}/models/{model}/status"
        fut: Future[bytes] = Future()
        with self._lock:
            self._status_waiters[topic] = fut
        self._client.subscribe(topic, qos=1)
        try:
            raw = fut.result(timeout)
        except FutureTimeout:
            raise EdgedError(f"no status for model {model!r} from device {self.base!r} within {timeout}s "
                             "(unknown model, or the daemon never connected)", code=ErrorCode.NOT_FOUND) from None
        finally:
            self._client.unsubscribe(topic)
            with self._lock:
                self._status_waiters.pop(topic, None)
        doc = loads(raw)
        if not isinstance(doc, dict):
            raise EdgedError(f"malformed status for model {model!r}", code=ErrorCode.INTERNAL)
        return doc

    def infer_media(self, model: str, payload: bytes, version: int | None = None, timeout: float = 10.0,
                    content_type: str | None = None) -> dict[str, Any]:
        """Send a raw image or sound (MQTT 5 only) and return the daemon's plain-JSON answer
        (edged.protocol.media.answer); an error answer raises MqttServerError."""
        from edged.protocol.mqtt_properties import publish_properties

        if not self.v5:
            raise EdgedError("raw image/sound requests need MQTT 5 (a response topic)")
        corr = uuid.uuid4().hex
        props = publish_properties(response_topic=self.reply_topic, correlation=corr.encode(),
                                   expiry_s=max(1, math.ceil(timeout)), content_type=content_type)
        answer, _ = self._round_trip(model, version, payload, props, corr=corr, timeout=timeout)
        _raise_if_error(answer)
        return answer

    def _encode(self, inputs: Mapping[str, np.ndarray],
                outputs: list[str] | None) -> tuple[dict[str, Any], list[bytes]]:
        from edged.protocol.v2 import tensor_bytes

        entries = []
        chunks: list[bytes] = []
        for name, value in inputs.items():
            arr = np.asarray(value)
            dt = datatypes.from_numpy(arr.dtype)
            entry: dict[str, Any] = {"name": name, "datatype": dt, "shape": list(arr.shape)}
            if self.binary:
                raw = tensor_bytes(arr, dt)
                entry["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
            elif dt == "BYTES":
                entry["data"] = [b.decode() if isinstance(b, bytes) else str(b) for b in arr.ravel()]
            else:
                entry["data"] = arr.ravel()
            entries.append(entry)
        header: dict[str, Any] = {"inputs": entries}
        if outputs is not None:
            header["outputs"] = [{"name": n} for n in outputs]
        return header, chunks

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def __enter__(self) -> MqttClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_if_error(header: Any) -> None:
    if "error" in header:
        try:
            code = ErrorCode(header.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        raise MqttServerError(str(header["error"]), code=code)


def _decode_outputs(header: Any, tail: Any) -> dict[str, np.ndarray]:
    from edged.client.http import decode_outputs

    _raise_if_error(header)
    return decode_outputs(header, tail)
