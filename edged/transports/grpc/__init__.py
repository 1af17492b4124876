"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), Triton's extensions included.

``codec`` turns protobuf messages into the shared v2 codec's requests and back,
``app`` answers each RPC through the one inference service, ``server`` owns the
listener. grpcio and protobuf come with the ``grpc`` extra and are imported only
when ``[grpc]`` is configured.
"""

from __future__ import annotations

import importlib
from typing import Any

from edged.errors import MissingDependencyError


def require_grpc() -> Any:
    """The grpc module, or a typed error saying how to install it."""
    try:
        importlib.import_module("google.protobuf")
        import grpc
    except ImportError as e:
        raise MissingDependencyError(
            f"[grpc] is configured but its libraries are not installed ({e.name} is missing): "
            "install the extra with pip install 'edged[grpc]', or remove the [grpc] section") from None
    return grpc
