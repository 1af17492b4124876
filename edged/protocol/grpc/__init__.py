"""The Open Inference Protocol's gRPC messages (``gen/``, from the vendored ``proto/``), for server and client.

grpcio and protobuf come with the ``grpc`` extra; nothing here imports them until asked.
"""

from __future__ import annotations

import importlib
from typing import Any

from edged.errors import MissingDependencyError

# Where the daemon puts an error's transport-neutral ErrorCode value: the trailing metadata of an error status,
# and the ``parameters`` of a ModelStreamInfer error reply's infer_response. gRPC statuses are coarser than
# ErrorCode (overloaded and unavailable are both UNAVAILABLE), so edged's client reads the code from here.
ERROR_CODE_KEY = "edged-code"


def require_grpc() -> Any:
    """The grpc module, or a typed error saying how to install it."""
    try:
        importlib.import_module("google.protobuf")
        import grpc
    except ImportError as e:
        raise MissingDependencyError(
            f"[grpc] is configured but its libraries are not installed ({e.name} is missing): "
            "install the extra with pip install 'edged[grpc]', or remove the [grpc] section"
        ) from None
    return grpc
