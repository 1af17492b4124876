"""The protobuf wire format of the inference messages, where protobuf's own classes would copy.

A ModelInferRequest's ``raw_input_contents`` as views of the received bytes, not copies.

Parsed by protobuf, each raw input is copied into the message, and copied again into a new
bytes object on every access of the field: two copies of every input (a 6 MB frame costs
milliseconds) before the model sees it. Walking the message's top-level fields instead finds
where each raw content lies in the bytes grpcio handed over; the message is then parsed without
them (a few hundred bytes of names and shapes) and the inputs are views of those bytes.

Protobuf allows fields in any order and repeated fields interleaved with others; the
contents keep their order, and the remaining fields theirs, so the smaller message parses
to exactly what the whole one would, minus the contents. Anything this walk does not take
(a group, a truncated or overlong field) gives None: the caller parses the whole message,
and protobuf says what is wrong with it.

A ModelInferResponse whose outputs are all raw is written here too: its fields before the
contents depend only on the model, version, id and the outputs' names, types and shapes, so a
transport keeps them per signature, and each answer is those bytes and the output tensors' own
memory joined once (protobuf would copy each tensor into the message, then into its serialization).
"""

from __future__ import annotations

from edged.protocol.protobuf import LENGTH, length_delimited_fields, varint

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents (grpc_service.proto)
# ModelInferResponse: model_name 1, model_version 2, id 3, outputs 5, raw_output_contents 6;
# its InferOutputTensor: name 1, datatype 2, shape 3 (packed int64); ModelStreamInferResponse.infer_response 2.
_RESPONSE_MODEL, _RESPONSE_VERSION, _RESPONSE_ID, _RESPONSE_OUTPUTS = 1, 2, 3, 5
RAW_OUTPUT_CONTENTS = 6
_OUTPUT_NAME, _OUTPUT_DATATYPE, _OUTPUT_SHAPE = 1, 2, 3
STREAM_INFER_RESPONSE = 2

def split_raw_contents(data: bytes, field: int = RAW_INPUT_CONTENTS) -> tuple[bytes, list[memoryview]] | None:
    """The message without its length-delimited ``field`` entries, and those entries' contents as views of
    ``data`` in their order; None when the top-level fields cannot be walked (the caller parses it whole)."""
    try:
        fields = length_delimited_fields(data, 0, len(data))
    except (IndexError, ValueError):
        return None
    raws: list[memoryview] = []
    kept: list[bytes] = []
    view = memoryview(data)
    start = 0
    for number, at, begin, end in fields:
        if number == field:
            kept.append(data[start:at])
            raws.append(view[begin:end])
            start = end
    if not raws:
        return data, raws
    kept.append(data[start:])
    return b"".join(kept), raws


def content_header(nbytes: int, field: int = RAW_INPUT_CONTENTS) -> bytes:
    """What precedes one raw content of ``nbytes`` in a message (its tag and length, as protobuf writes them)."""
    return varint(field << 3 | LENGTH) + varint(nbytes)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding ``payload`` (a string, bytes or an embedded message)."""
    return content_header(len(payload), number) + payload


def response_head(model: str, version: str, rid: str, outputs: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """A ModelInferResponse's fields before its raw output contents, as protobuf serializes them (fields
    in number order, empty strings left out): the model, version, id and each output's name, type, shape."""
    parts = [length_delimited(number, text.encode()) for number, text in
             ((_RESPONSE_MODEL, model), (_RESPONSE_VERSION, version), (_RESPONSE_ID, rid)) if text]
    for name, datatype, shape in outputs:
        tensor = [length_delimited(_OUTPUT_NAME, name.encode()), length_delimited(_OUTPUT_DATATYPE, datatype.encode())]
        if shape:
            tensor.append(length_delimited(_OUTPUT_SHAPE, b"".join(varint(d) for d in shape)))
        parts.append(length_delimited(_RESPONSE_OUTPUTS, b"".join(tensor)))
    return b"".join(parts)


def raw_output_prefix(nbytes: int) -> bytes:
    """What precedes one raw output content of ``nbytes`` in a ModelInferResponse."""
    return content_header(nbytes, RAW_OUTPUT_CONTENTS)


def stream_response(infer_response: bytes) -> bytes:
    """A ModelStreamInferResponse carrying a serialized ModelInferResponse (and no error)."""
    return length_delimited(STREAM_INFER_RESPONSE, infer_response)
