"""Stream bindings served: a sensor's topic feeds a model, whose answers go to an output topic.

paho's thread only drops each message into its binding's bounded buffer (:mod:`.bindings`); the
binding's own worker runs it through the model and publishes the answer, or an error document, on
the output topic rendered for that message.
"""

from __future__ import annotations

import time
from typing import Any

import paho.mqtt.client as mqtt

from edged.config import StreamBinding
from edged.core.service import InferenceService
from edged.errors import EdgedError, InvalidInputError
from edged.protocol import media
from edged.protocol import mqtt as codec
from edged.protocol.fleet.telemetry import StreamWindow
from edged.protocol.mqtt import Form
from edged.protocol.mqtt_properties import publish_properties
from edged.protocol.types import InferRequest
from edged.protocol.v2 import DecodedRequest, decode_request, dumps, encode_response
from edged.transports.mqtt.bindings import BindingStats, BindingWorker, Item, raw_tensor
from edged.transports.mqtt.counts import Counts
from edged.transports.mqtt.incoming import message_deadline, user_property
from edged.transports.mqtt.session import MqttSession
from edged.transports.redact import Scrubber

# An MQTT 5 user property a camera sets on a frame (its capture time, any text up to 64 characters):
# the binding's output carries it as "frame_timestamp".
FRAME_TIMESTAMP_PROPERTY = "Frame-Timestamp"


class StreamBindings:
    """The bindings' workers, and what they need of the transport: the model, the output, the connection."""

    def __init__(  # noqa: PLR0913  the transport's shared parts plus keyword-only options
        self,
        bindings: list[StreamBinding],
        session: MqttSession,
        service: InferenceService,
        counts: Counts,
        scrub: Scrubber,
        *,
        device: str,
        prefix: str,
        max_payload_mb: float,
    ) -> None:
        self.session, self.service, self.counts, self.scrub = session, service, counts, scrub
        self.options = session.options
        self.device, self.prefix = device, prefix
        self.max_payload_mb = max_payload_mb  # as configured, for the warning
        self._workers = [
            BindingWorker(
                i,
                b,
                render=self._render_output,
                process=self._process,
                error_payload=self._error,
                publish=self._publish,
            )
            for i, b in enumerate(bindings)
        ]

    def start(self) -> None:
        for w in self._workers:
            w.start()

    def close_buffers(self) -> None:
        """Take no more messages (what is buffered is dropped); the workers finish their current one."""
        for w in self._workers:
            w.buffer.close()

    def stop(self, end: float) -> None:
        """Wait for the workers until the monotonic ``end`` (at least 0.1 s each)."""
        for w in self._workers:
            w.stop(max(0.1, end - time.monotonic()))

    def dispatch(self, msg: mqtt.MQTTMessage, topic: str) -> None:
        """Offer a message to every binding whose topic filter matches it (paho's thread)."""
        for w in self._workers:
            if w.matches(topic):
                self.offer(w, msg, topic)

    def windows(self) -> list[StreamWindow]:
        """Each stream's counts, rate and latency, for telemetry and /metrics."""
        return [self._window(w) for w in self._workers]

    def offer(self, w: BindingWorker, msg: mqtt.MQTTMessage, topic: str) -> None:
        if self.session.stopping:
            return
        if len(msg.payload) > self.options.max_payload_bytes:
            self.counts.count("binding_oversized")
            self.counts.warn(
                f"binding-size-{w.index}",
                f"binding {w.index}: dropped a {len(msg.payload)}-byte "
                f"message on {topic!r} (limit {self.max_payload_mb} MB)",
            )
            return
        props = msg.properties if self.options.v5 else None
        hlen = user_property(props, codec.HEADER_LENGTH_PROPERTY)
        try:
            header_length = codec.header_length_property(hlen)
        except InvalidInputError:
            header_length = None
        w.offer(
            Item(
                topic,
                msg.payload,
                header_length,
                time.time(),
                message_deadline(props),
                frame_timestamp=(user_property(props, FRAME_TIMESTAMP_PROPERTY) or "")[:64] or None,
                content_type=getattr(props, "ContentType", None) if props else None,
                arrived=time.monotonic(),
            )
        )

    def _render_output(self, b: StreamBinding, topic: str) -> str:
        return b.output_topic.format(
            topic=topic,
            device=self.device,
            model=b.model,
            prefix=self.prefix,
            version=b.version if b.version is not None else "latest",
        )

    def _process(self, b: StreamBinding, item: Item) -> tuple[bytes, int | None]:
        """Run one buffered message through the model (a binding's own thread)."""
        if b.input_format == "media":
            return self._process_media(b, item), None
        if b.input_format == "raw":
            assert b.input_name is not None and b.datatype is not None and b.shape is not None
            arr = raw_tensor(item.payload, b.datatype, b.shape)
            decoded = DecodedRequest(InferRequest(model=b.model, version=b.version, inputs={b.input_name: arr}))
            form = Form.JSON
        else:
            fr = codec.parse(item.payload, item.header_length)
            decoded = decode_request(fr.header, fr.tail, model=b.model, version=b.version)
            form = fr.form
        decoded.request.deadline = item.deadline
        resp = self.service.infer_blocking(decoded.request)
        header, chunks = encode_response(resp, decoded)
        header["input_topic"] = item.topic
        header["timestamp"] = item.received_at
        if item.frame_timestamp is not None:
            header["frame_timestamp"] = item.frame_timestamp
        form, payload, hlen = codec.frame(form, header, chunks, properties=self.options.v5)
        return payload, hlen if form is Form.BINARY_PROPERTY else None

    def _process_media(self, b: StreamBinding, item: Item) -> bytes:
        """A camera frame (or sound chunk): the model's one BYTES input, answered as plain JSON."""
        kind = media.declared_media_type(b.content_type) or media.media_type(item.payload, item.content_type)
        if kind is None:
            raise InvalidInputError(
                "the message is not a JPEG, PNG, WebP or WAV (set the binding's content_type "
                "or the message's MQTT 5 content type)"
            )
        mv = self.service.model(b.model, b.version)
        name = media.media_input(b.model, [(s.name, s.datatype) for s in mv.inputs])
        resp = self.service.infer_blocking(
            InferRequest(
                model=b.model,
                version=b.version,
                deadline=item.deadline,
                inputs={name: media.media_tensor(item.payload)},
            )
        )
        body = media.answer(resp.model, resp.version, resp.outputs, media=kind)
        body["input_topic"] = item.topic
        body["timestamp"] = item.received_at
        if item.frame_timestamp is not None:
            body["frame_timestamp"] = item.frame_timestamp
        return dumps(body)

    def _error(self, b: StreamBinding, item: Item, err: EdgedError) -> bytes:
        body: dict[str, Any] = {
            "error": self.scrub.text(err.message),
            "code": err.code.value,
            "model_name": b.model,
            "input_topic": item.topic,
            "timestamp": item.received_at,
        }
        if item.frame_timestamp is not None:
            body["frame_timestamp"] = item.frame_timestamp
        return dumps(body)

    def _publish(self, topic: str, payload: bytes, qos: int, hlen: int | None) -> None:
        client = self.session.client
        if client is None:
            return
        props = None
        if self.options.v5 and hlen is not None:
            props = publish_properties(user=[(codec.HEADER_LENGTH_PROPERTY, str(hlen))])
        info = client.publish(topic, payload, qos=qos, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self.counts.count("binding_outputs_lost")

    @staticmethod
    def _window(w: BindingWorker) -> StreamWindow:
        fps, p50, p99 = w.rate()
        st = w.stats
        return StreamWindow(
            topic=w.binding.topic[:256],
            model=w.binding.model,
            received=st.received,
            processed=st.processed,
            dropped=st.dropped,
            errors=st.errors,
            fps=round(fps, 3),
            latency_ms_p50=round(p50, 3),
            latency_ms_p99=round(p99, 3),
        )

    def stats(self) -> list[BindingStats]:
        return [w.stats for w in self._workers]
