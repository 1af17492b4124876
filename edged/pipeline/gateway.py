"""Model steps go through the daemon's own InferenceService, so they share the model's
scheduler: concurrent pipeline requests (and a fan-out's crops) batch in its dynamic batcher."""

from __future__ import annotations

from edged.core.service import InferenceService
from edged.core.types import InferRequest
from edged.errors import EdgedError
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port
from edged.pipeline.graph import Tensors
from edged.repository.manifest import TensorSpec


class ServiceGateway:
    """A ModelGateway over the InferenceService; ``version=None`` follows the model's serving version."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def model_ports(self, model: str, version: int | None) -> tuple[dict[str, Port], dict[str, Port]]:
        try:
            mv = self.service.ready_model(model, version)
        except EdgedError as exc:
            raise PipelineDefinitionError(f"model {model!r} is not served: {exc.message}") from None
        lead: tuple[int, ...] = (ANY,) if mv.max_batch_size > 0 else ()

        def ports(specs: list[TensorSpec]) -> dict[str, Port]:
            return {s.name: Port(s.datatype, lead + tuple(ANY if d < 0 else d for d in s.shape)) for s in specs}
        return ports(list(mv.inputs)), ports(list(mv.outputs))

    async def infer(self, model: str, version: int | None, inputs: Tensors) -> Tensors:
        response = await self.service.infer_async(InferRequest(model=model, inputs=inputs, version=version))
        return response.outputs
