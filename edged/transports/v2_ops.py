"""The v2 operations every v2 transport (HTTP, gRPC) answers the same way, minus the wire form.

Readiness, server metadata, the repository index and load/unload, and the checks
made around an inference request before and after it is computed live here once;
each transport only turns its own request into these arguments and the returned
plain data into its own response.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import edged
from edged.core.public import ModelState
from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode, InvalidInputError, ModelNotFoundError
from edged.protocol import v2_models
from edged.protocol.names import valid_model_name
from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest, encode_response
from edged.transports.authority import LOAD, UNLOAD, Authority, Peer
from edged.transports.shm.sysshm import OutputStaging, ShmView

EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics",
              "system_shared_memory", "schedule_policy"]


def server_metadata() -> dict[str, Any]:
    return {"name": "edged", "version": edged.__version__, "extensions": EXTENSIONS}


def server_ready(service: InferenceService, stopping: bool) -> bool:
    """Serving and able to infer: not stopping, and some model is ready now (or none is configured)."""
    return not stopping and service.ready()


def model_ready(service: InferenceService, name: str, version: int | None) -> bool:
    service.model(name, version)  # NOT_FOUND for unknown models
    return service.is_ready(name, version)


def parse_version(raw: str) -> int:
    if not raw.isdigit() or len(raw) > 18:
        raise InvalidInputError(f"model version {raw!r} is not a positive integer")
    return int(raw)


def repository_index(service: InferenceService, ready_only: bool) -> list[dict[str, Any]]:
    """Every model in the repository, loaded or not (Triton's index shape). Reads the disk: not on the loop."""
    return v2_models.index_response(service.repository_index(), ready_only)


def check_model_control(authority: Authority, peer: Peer, name: str, action: str, params: set[str]) -> None:
    """Everything refusable about a load/unload, checked before any work (authority first)."""
    authority.require(peer, LOAD if action == "load" else UNLOAD)
    if not valid_model_name(name):
        detail = f"model {name!r} is not in the repository"
        if action == "load":  # Triton's wording first
            detail = f"failed to load {name!r}, failed to poll from model repository ({detail})"
        raise ModelNotFoundError(detail)
    if action == "load" and params - {"unload_dependents"}:
        raise InvalidInputError("overriding the model configuration or files on load is not supported; "
                                "put the model into the repository and load it by name")


def run_model_control(service: InferenceService, name: str, action: str) -> None:
    """Load or unload by name after :func:`check_model_control`; blocks: run it in a worker thread."""
    if action != "load":
        service.unload(name, by_operator=True)
        return
    results = service.load(name)
    failed = [mv for mv in results if mv.state is not ModelState.READY]
    if failed:
        why = "; ".join(f"version {mv.version}: {mv.reason}" for mv in failed)
        raise EdgedError(f"model {name!r} failed to load: {why}", code=ErrorCode.FAILED_PRECONDITION)


class ModelControl:
    """Loads and unloads asked for over one transport, run on the loop's worker pool and awaited there.

    A load can take minutes inside an engine call no one can interrupt. When the transport stops, every
    caller still waiting is answered UNAVAILABLE at once, so the transport's graceful stop does not wait
    for such a load (the daemon's stop then leaves it behind: ``Daemon.exit_past_abandoned``)."""

    def __init__(self) -> None:
        self._stops: set[asyncio.Future[None]] = set()

    async def run(self, service: InferenceService, name: str, action: str) -> None:
        """:func:`run_model_control` in a worker thread, unless the transport stops first."""
        work = asyncio.ensure_future(asyncio.to_thread(run_model_control, service, name, action))
        stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stops.add(stop)
        try:
            await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stops.discard(stop)
            if not work.done():  # the transport stops, or the caller went away: nobody awaits it now
                work.add_done_callback(_retrieved)
        if work.done():
            work.result()
            return
        raise EdgedError(f"edged is stopping: the {action} of model {name!r} was still running and is left "
                         "to end or give up without an answer", code=ErrorCode.UNAVAILABLE)

    def stop(self) -> None:
        """Answer every caller still waiting (the transport is stopping)."""
        for stop in self._stops:
            if not stop.done():
                stop.set_result(None)


def _retrieved(work: asyncio.Future[None]) -> None:
    """A load nobody waits for any more: its outcome is the loader's to log."""
    if not work.cancelled():
        work.exception()


def prepare_infer(decoded: DecodedRequest, shm: ShmView, deadline_s: float | None = None) -> None:
    """Refuse a bad output slot before spending compute on it; set the earliest of the deadlines."""
    for opt in decoded.outputs.values():
        if opt.shm is not None:
            shm.check(*opt.shm, write=True)
    ireq = decoded.request
    timeout_us = ireq.parameters.get("timeout_us")
    now = time.monotonic()
    deadlines = [now + timeout_us / 1e6] if timeout_us else []
    if deadline_s is not None:
        deadlines.append(now + deadline_s)
    if deadlines:
        ireq.deadline = min(deadlines)


HEAVY = 1 << 20  # bodies/outputs above this are (de)coded in a worker thread to keep the loop responsive
# An HTTP request alone on the server runs on the event loop itself (an MQTT request on paho's network
# thread) when its model is idle and its run is estimated at most this long (the scheduler's moving
# average, scaled by the input's size): no hand-off to a worker thread and back, which costs about as
# much as a small model's run, for a stall of the loop about as long as a garbage collection's.
LOOP_INLINE_MAX_NS = 2_000_000


def encode_outputs(resp: InferResponse, decoded: DecodedRequest, shm: ShmView) -> tuple[dict[str, Any], list[bytes]]:
    """The v2 response header and binary chunks, with shared-memory outputs written to their slots."""
    staging = OutputStaging(shm) if any(o.shm for o in decoded.outputs.values()) else None
    header, chunks = encode_response(resp, decoded, shm=staging)
    if staging is not None:
        staging.flush()
    return header, chunks


def encode_is_heavy(resp: InferResponse, decoded: DecodedRequest) -> bool:
    """Worth a worker thread: big outputs, or big shared-memory slots to stage."""
    return (sum(a.nbytes for a in resp.outputs.values()) > HEAVY
            or sum(o.shm[2] for o in decoded.outputs.values() if o.shm) > HEAVY)
