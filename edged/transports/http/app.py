"""The KServe v2 / Triton HTTP API: one handler from a complete request to a complete response.

Routes are matched on the raw path split at ``/`` (each segment percent-decoded on
its own, so an encoded ``%2F`` can never create a new segment). Inference decodes
with the shared v2 codec, queues on the one inference service and awaits the
scheduler's future; everything else is small JSON. Every EdgedError becomes
``{"error": ...}`` with the status its code maps to; anything unexpected is logged
with its traceback and answered 500 ``internal error`` while the server goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode, InvalidInputError
from edged.membudget import Reservation, owned_bytes
from edged.protocol import media
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, decode_request, dumps, loads
from edged.protocol.v2_json import loads_request
from edged.protocol.v2_models import metadata_response, statistics_response
from edged.protocol.v2_plans import RequestPlans, encode_answer
from edged.transports.authority import Authority, Peer, bearer
from edged.transports.http.config import model_config
from edged.transports.http.server import Headers, Request, Response
from edged.transports.redact import Scrubber
from edged.transports.shm.sysshm import ShmCaller, ShmView, SystemShmRegions
from edged.transports.v2_ops import (
    HEAVY,
    LOOP_INLINE_MAX_NS,
    ModelControl,
    check_model_control,
    encode_is_heavy,
    encode_outputs,
    model_ready,
    parse_version,
    prepare_infer,
    repository_index,
    server_metadata,
    server_ready,
)

log = logging.getLogger(__name__)

# Triton answers 503 for unavailable; RESOURCE_EXHAUSTED (a load that would break the memory budget,
# too many shm regions) is 507 so that clients can tell "retry later" from "free something first".
STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.RESOURCE_EXHAUSTED: 507,
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
}
_JSON = [(b"content-type", b"application/json")]
NOT_A_REQUEST = ("the body is neither a v2 inference request nor an image or sound: send JSON "
                 "({\"inputs\": [...]}, Content-Type: application/json), Triton's binary form (JSON header + "
                 "tensors, Inference-Header-Content-Length), or the raw file of a pipeline's one BYTES input "
                 "with Content-Type image/jpeg, image/png, image/webp or audio/wav; BYTES elements in JSON are "
                 "strings or {\"b64\": \"...\"}")


# BYTES elements cost up to ~0.1 ms per KiB of body to decode (4-byte binary items, empty JSON strings), far
# more than numbers: a body naming BYTES is decoded in a worker thread past this size, not on the loop.
BYTES_INLINE_MAX = 16 * 1024


def _names_bytes(body: bytes, hlen_raw: bytes | None) -> bool:
    """Whether the request's JSON (the whole body, or a binary request's header) names the BYTES type."""
    end = len(body)
    if hlen_raw is not None:
        try:
            end = max(0, min(end, int(hlen_raw)))
        except ValueError:
            return False  # refused by _decode
    return body.find(b'"BYTES"', 0, end) >= 0


class HttpError(Exception):
    """A protocol-level failure (before any EdgedError applies): bad route, method, size, encoding."""

    def __init__(self, status: int, message: str, headers: Headers | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or []


class V2App:
    def __init__(self, service: InferenceService, shm: SystemShmRegions, *, max_body: int,
                 scrub: Scrubber, metrics: Callable[[], tuple[bytes, str]], authority: Authority) -> None:
        self.service = service
        self.shm = shm
        self.authority = authority
        self.max_body = max_body
        self.scrub = scrub
        self.metrics = metrics
        self.stopping = False
        self.control = ModelControl()  # loads and unloads in progress, answered at once on stop
        self.plans = RequestPlans()  # binary requests that repeat their header (protocol/v2_plans.py)

    # ---- entry ------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        try:
            return await self._dispatch(req)
        except EdgedError as e:
            return self._error(e)
        except HttpError as e:
            return e.status, _JSON + e.headers, dumps({"error": e.message})
        except Exception:
            log.exception("HTTP %s %r failed", req.method, req.path[:200])
            return 500, _JSON, b'{"error":"internal error"}'

    def _error(self, e: EdgedError) -> Response:
        status = STATUS.get(e.code, 500)
        if status >= 500 and e.code is ErrorCode.INTERNAL:
            log.error("internal error: %s", e)
        headers = _JSON + ([(b"retry-after", b"1")] if e.code is ErrorCode.OVERLOADED else [])
        if e.code is ErrorCode.UNAUTHENTICATED:
            headers = [*headers, (b"www-authenticate", b'Bearer realm="edged"')]
        return status, headers, dumps({"error": self.scrub.text(str(e))})

    def _json(self, obj: Any, status: int = 200, *, scrub: bool = False) -> Response:
        data = dumps(obj)
        return status, _JSON, self.scrub.data(data) if scrub else data

    # ---- routing ----------------------------------------------------------------------------
    async def _dispatch(self, req: Request) -> Response:
        method = req.method
        parts = req.path.split(b"?", 1)[0].split(b"/")
        if len(parts) < 2 or parts[0] != b"":
            raise HttpError(404, "not found")
        top = parts[1]
        if top == b"v2":
            if len(parts) >= 4 and parts[2] == b"models":
                return await self._models(method, [_seg(p) for p in parts[3:]], req)
            rest = [_seg(p) for p in parts[2:]]
            if rest in ([], [""]):
                _allow(method, "GET")
                return self._json(server_metadata())
            if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
                _allow(method, "GET")
                # The Open Inference Protocol's bodies (KServe's client reads them) with the status
                # code that Triton's clients read.
                if rest[1] == "live":
                    return 200, _JSON, b'{"live":true}'
                ok = self.server_ready()
                return (200 if ok else 503), _JSON, b'{"ready":true}' if ok else b'{"ready":false}'
            if rest[0] == "repository":
                return await self._repository(method, rest[1:], req)
            if rest[0] == "systemsharedmemory":
                return await self._sysshm(method, rest[1:], req)
            if rest[0] == "cudasharedmemory":
                return self._cudashm(method, rest[1:])
        elif top == b"metrics" and len(parts) == 2:
            _allow(method, "GET")
            body, ctype = await asyncio.to_thread(self.metrics)
            return 200, [(b"content-type", ctype.encode())], body
        raise HttpError(404, "not found")

    def server_ready(self) -> bool:
        return server_ready(self.service, self.stopping)

    async def _models(self, method: str, rest: list[str], req: Request) -> Response:
        if rest == ["stats"]:
            _allow(method, "GET")
            return self._json(statistics_response(self.service.version_statistics()))
        model, rest = rest[0], rest[1:]
        version: int | None = None
        if rest and rest[0] == "versions":
            if len(rest) < 2:
                raise HttpError(404, "not found")
            version = parse_version(rest[1])
            rest = rest[2:]
        action = rest[0] if len(rest) == 1 else ("" if not rest else None)
        if action == "infer":
            _allow(method, "POST")
            return await self._infer(model, version, req)
        if action == "":
            _allow(method, "GET")
            return self._json(metadata_response(self.service.describe(model, version)), scrub=True)
        if action == "ready":
            _allow(method, "GET")
            ok = model_ready(self.service, model, version)
            return (200 if ok else 503), _JSON, dumps({"name": model, "ready": ok})
        if action == "config":
            _allow(method, "GET")
            mv = self.service.model(model, version)
            policy = self.service.version_policy(model)
            return self._json(model_config(mv, policy), scrub=True)
        if action == "stats":
            _allow(method, "GET")
            return self._json(statistics_response(self.service.version_statistics(model, version)))
        raise HttpError(404, "not found")

    # ---- inference --------------------------------------------------------------------------
    async def _infer(self, model: str, version: int | None, req: Request) -> Response:
        hlen_raw = None
        ctype: bytes | None = None
        for k, v in req.headers:
            if k == b"inference-header-content-length":
                hlen_raw = v
            elif k == b"content-type":
                ctype = v
        body = await self._body(req)
        kind = media.declared_media_type(ctype.decode("latin-1")) if ctype else None
        if kind is None and hlen_raw is None and body.lstrip()[:1] not in (b"{", b"[", b""):
            kind = media.sniff_media_type(body)  # an image or sound posted without its content type
            if kind is None:
                raise InvalidInputError(NOT_A_REQUEST)
        if kind is not None:
            return await self._infer_media(model, version, body, kind)
        shm = self._shm_view(req)
        if len(body) > HEAVY or (len(body) > BYTES_INLINE_MAX and _names_bytes(body, hlen_raw)):
            decoded = await asyncio.to_thread(self._decode, body, hlen_raw, model, version, shm)
        else:
            decoded = self._decode(body, hlen_raw, model, version, shm)
        if req.hold is not None:
            # JSON data (in a JSON body or a binary request's header) became new arrays; binary data stays
            # a view of the body, reserved with it (owned_bytes skips those).
            req.hold.grow(owned_bytes(decoded.request.inputs.values()), "the request's decoded JSON tensors")
        if req.load is not None and req.load.pending <= 1:
            done = self.service.infer_or_submit(decoded.request, LOOP_INLINE_MAX_NS)
            resp = done if isinstance(done, InferResponse) else await asyncio.wrap_future(done)
        else:
            resp = await asyncio.wrap_future(self.service.submit(decoded.request))
        if encode_is_heavy(resp, decoded):
            return await asyncio.to_thread(self._encode, resp, decoded, shm)
        return self._encode(resp, decoded, shm)

    async def _infer_media(self, model: str, version: int | None, body: bytes, kind: str) -> Response:
        """A raw image or sound body: the one BYTES input of the model or pipeline, answered as plain JSON
        (as over MQTT; protocol/media.py)."""
        mv = self.service.model(model, version)
        name = media.media_input(model, [(s.name, s.datatype) for s in mv.inputs])
        request = InferRequest(model=model, version=version, inputs={name: media.media_tensor(body)})
        resp = await asyncio.wrap_future(self.service.submit(request))
        return 200, _JSON, dumps(media.answer(resp.model, resp.version, resp.outputs, media=kind))

    def _decode(self, body: bytes, hlen_raw: bytes | None, model: str, version: int | None,
                shm: ShmView) -> DecodedRequest:
        if hlen_raw is not None:
            try:
                hlen = int(hlen_raw)
            except ValueError:
                raise InvalidInputError("Inference-Header-Content-Length is not an integer") from None
            if not 0 <= hlen <= len(body):
                raise InvalidInputError(
                    f"Inference-Header-Content-Length {hlen} is outside the body ({len(body)} bytes)")
            view = memoryview(body)
            key = self.plans.key(model, version, view[:hlen], len(body) - hlen)
            plan = self.plans.get(key)
            if plan is not None:
                decoded = plan.decode(view[hlen:])
            else:
                header = loads_request(view[:hlen])
                decoded = decode_request(header, view[hlen:], model=model, version=version, shm=shm.read)
                if key is not None:
                    self.plans.learn(key, header, decoded)
        else:
            decoded = decode_request(loads_request(body), memoryview(b""), model=model, version=version,
                                     shm=shm.read)
        prepare_infer(decoded, shm)
        return decoded

    def _encode(self, resp: Any, decoded: DecodedRequest, shm: ShmView) -> Response:
        hjson, chunks = encode_answer(resp, decoded, lambda: encode_outputs(resp, decoded, shm))
        if not chunks:
            return 200, _JSON, hjson
        headers = [(b"content-type", b"application/octet-stream"),
                   (b"inference-header-content-length", str(len(hjson)).encode())]
        return 200, headers, b"".join([hjson, *chunks])

    async def _body(self, req: Request) -> bytes:
        """The request body, decompressed when it says so (the server already bounded its raw size).

        Inflating up to ``max_body`` bytes takes milliseconds or more: it runs in a worker thread.
        """
        for k, v in req.headers:
            if k == b"content-encoding":
                enc = v.lower().strip()
                if enc not in (b"identity", b""):
                    if enc not in (b"gzip", b"deflate"):
                        raise _unsupported_encoding(enc)
                    return await asyncio.to_thread(_decompress, req.body, enc, self.max_body, req.hold)
        return req.body

    # ---- model repository -------------------------------------------------------------------
    async def _repository(self, method: str, rest: list[str], req: Request) -> Response:
        if rest == ["index"]:
            _allow(method, "POST", "GET")
            ready_only = _json_object(await self._body(req)).get("ready", False)
            if not isinstance(ready_only, bool):
                raise InvalidInputError("'ready' must be true or false")
            index = await asyncio.to_thread(repository_index, self.service, ready_only)
            return self._json(index, scrub=True)
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            _allow(method, "POST")
            name = rest[1]
            params = _json_object(await self._body(req)).get("parameters") or {}
            if not isinstance(params, dict):
                raise InvalidInputError("'parameters' must be an object")
            check_model_control(self.authority, _peer(req), name, rest[2], set(params))
            await self.control.run(self.service, name, rest[2])
            return self._json({})
        raise HttpError(404, "not found")

    # ---- system shared memory ---------------------------------------------------------------
    async def _sysshm(self, method: str, rest: list[str], req: Request) -> Response:
        """Triton's system shared memory API; every caller sees only the regions it registered itself."""
        peer = _peer(req)
        if rest == ["status"]:
            _allow(method, "GET", "POST")
            return self._json(self.shm.status(self._shm_scope(peer)))
        if rest == ["unregister"]:
            _allow(method, "POST")
            self.shm.unregister_all(self._shm_scope(peer))
            return self._json({})
        if len(rest) == 3 and rest[0] == "region":
            name, action = rest[1], rest[2]
            if action == "status":
                _allow(method, "GET", "POST")
                return self._json(self.shm.status(self._shm_scope(peer), name))
            if action == "register":
                _allow(method, "POST")
                caller = ShmCaller(self._shm_scope(peer), peer.uid, peer.gid)
                body = _json_object(await self._body(req))
                self.shm.register(caller, name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
                return self._json({})
            if action == "unregister":
                _allow(method, "POST")
                self.shm.unregister(self._shm_scope(peer), name)
                return self._json({})
        raise HttpError(404, "not found")

    def _shm_scope(self, peer: Peer) -> str:
        return self.authority.scope(peer, "use system shared memory")

    def _shm_view(self, req: Request) -> ShmView:
        """The caller's regions; a TCP caller without the credential has none (references fail as unknown).

        With no region registered by anyone, every reference fails as unknown whoever asks: the caller's
        identity (its credential header, its peer) is not looked up on every request."""
        if not len(self.shm):
            return self.shm.view("")
        return self.shm.view(self.authority.known_scope(_peer(req)) or "")  # "": nobody registers there

    def _cudashm(self, method: str, rest: list[str]) -> Response:
        """No CUDA shared memory here; answered as a Triton without GPU regions answers.

        Triton clients (perf_analyzer among them) unregister every CUDA region on exit and treat a
        failure as an error, so status is empty and unregistering nothing succeeds.
        """
        if rest == ["status"] or (len(rest) == 3 and rest[0] == "region" and rest[2] == "status"):
            _allow(method, "GET", "POST")
            if len(rest) == 3:
                raise HttpError(400, f"unable to find cuda shared memory region: {rest[1]!r}")
            return self._json([])
        if rest == ["unregister"] or (len(rest) == 3 and rest[0] == "region" and rest[2] == "unregister"):
            _allow(method, "POST")
            return self._json({})
        if len(rest) == 3 and rest[0] == "region" and rest[2] == "register":
            _allow(method, "POST")
            raise HttpError(400, "CUDA shared memory is not supported by this server; use system shared memory")
        raise HttpError(404, "not found")


def _peer(req: Request) -> Peer:
    """The connection's peer plus the credential this request presents."""
    for k, v in req.headers:
        if k == b"authorization":
            return dataclasses.replace(req.peer, credential=bearer(v))
    return req.peer


def _seg(raw: bytes) -> str:
    try:
        s = raw.decode("utf-8")
        return unquote(s, errors="strict") if "%" in s else s
    except UnicodeDecodeError:
        raise HttpError(400, "request path is not valid UTF-8") from None


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed and not (method == "HEAD" and "GET" in allowed):
        raise HttpError(405, f"method {method} is not allowed here",
                        [(b"allow", ", ".join(allowed).encode())])


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    obj = loads(body)
    if not isinstance(obj, dict):
        raise InvalidInputError("request body must be a JSON object")
    return obj


def _too_large(limit: int) -> HttpError:
    # The request was read whole: the connection stays usable (no "connection: close").
    return HttpError(413, f"request body is larger than {limit} bytes ([http] max_request_mb)")


def _unsupported_encoding(encoding: bytes) -> HttpError:
    return HttpError(415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r} "
                          "(identity, gzip and deflate are)")


_INFLATE_STEP = 4 << 20


def _decompress(body: bytes, encoding: bytes, limit: int, hold: Reservation | None = None) -> bytes:
    """gzip/deflate request bodies (tritonclient's request_compression_algorithm), bounded by the limit
    and inflated a step at a time, each step reserved (twice: the pieces, then the joined body) first."""
    if encoding == b"gzip":
        d = zlib.decompressobj(wbits=31)
    elif encoding == b"deflate":
        d = zlib.decompressobj(wbits=15)
    else:
        raise _unsupported_encoding(encoding)
    parts: list[bytes] = []
    size = 0
    tail = body
    try:
        while True:
            step = min(_INFLATE_STEP, limit + 1 - size)
            if hold is not None:
                hold.grow(2 * step, "the inflated request body")
            part = d.decompress(tail, step)
            parts.append(part)
            size += len(part)
            tail = d.unconsumed_tail
            if size > limit:
                raise _too_large(limit)
            if not tail or not part:
                break
    except zlib.error:
        raise InvalidInputError("request body is not valid compressed data") from None
    if d.unconsumed_tail:
        raise _too_large(limit)
    return parts[0] if len(parts) == 1 else b"".join(parts)
