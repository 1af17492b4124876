"""A stand-in for TensorRT's Python API: the subset the engine worker uses, on the CPU, for CI without a GPU.

The real bindings run on hardware; this module lets the worker's own code (protocol,
segments, supervision) run for real here. A "plan" is JSON: named inputs/outputs and
an affine layer ``y = x @ weight + bias``. ``stall_value``: when the first input
element equals it, execution hangs (a stand-in for a stuck GPU), so tests can kill
the worker mid-request; with ``EDGED_STANDIN_STALL_MARKER`` set it first writes its pid
to that file, so a test knows the request reached the engine instead of guessing by a
sleep. Python 3.8 compatible, like the worker.
"""

from __future__ import annotations

import ctypes
import enum
import json
import os
import time
from typing import Any

import numpy as np

__version__ = "8.5.2-standin"
EDGED_STANDIN_HOST_POINTERS = True  # addresses are host memory: no CUDA here
STALL_MARKER_ENV = "EDGED_STANDIN_STALL_MARKER"  # a file the stall writes its pid to before it hangs


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self, min_severity: int = 2) -> None:
        self.min_severity = min_severity


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_}
_FROM_NAME = {"float32": DataType.FLOAT, "float16": DataType.HALF, "int8": DataType.INT8, "int32": DataType.INT32,
              "bool": DataType.BOOL}


def nptype(dtype: DataType) -> Any:
    return _NP[dtype]


class ICudaEngine:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.io = [(t, TensorIOMode.INPUT) for t in spec["inputs"]]
        self.io += [(t, TensorIOMode.OUTPUT) for t in spec["outputs"]]
        self.num_io_tensors = len(self.io)
        self.weight = np.asarray(spec["weight"], dtype=np.float32)
        self.bias = np.asarray(spec["bias"], dtype=np.float32)

    def _tensor(self, name: str) -> tuple[dict[str, Any], TensorIOMode]:
        for t, mode in self.io:
            if t["name"] == name:
                return t, mode
        raise KeyError(name)

    def get_tensor_name(self, i: int) -> str:
        return str(self.io[i][0]["name"])

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._tensor(name)[1]

    def get_tensor_dtype(self, name: str) -> DataType:
        return _FROM_NAME[self._tensor(name)[0]["dtype"]]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name)[0]["shape"])

    def create_execution_context(self) -> IExecutionContext:
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        declared = self.engine.get_tensor_shape(name)
        if len(shape) != len(declared) or any(declared[i] not in (-1, shape[i]) for i in range(len(shape))):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT:
            return self.shapes.get(name, self.engine.get_tensor_shape(name))
        (first,) = [t["name"] for t in self.engine.spec["inputs"]]
        batch = self.shapes[first][0]
        return (batch, int(self.engine.weight.shape[1]))

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def _array(self, name: str) -> np.ndarray:
        dtype = np.dtype(nptype(self.engine.get_tensor_dtype(name)))
        shape = self.get_tensor_shape(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = (ctypes.c_ubyte * nbytes).from_address(self.addresses[name])
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def execute_async_v3(self, stream_handle: int) -> bool:
        (x_name,) = [t["name"] for t in self.engine.spec["inputs"]]
        (y_name,) = [t["name"] for t in self.engine.spec["outputs"]]
        x = self._array(x_name)
        stall = self.engine.spec.get("stall_value")
        if stall is not None and x.size and float(x.flat[0]) == float(stall):
            marker = os.environ.get(STALL_MARKER_ENV)
            if marker:
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(3600)  # sleep-ok: an engine that hangs, for the supervisor to kill
        np.matmul(x, self.engine.weight, out=self._array(y_name))
        self._array(y_name)[...] += self.engine.bias
        return True


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, plan: bytes) -> ICudaEngine | None:
        try:
            spec = json.loads(plan.decode())
        except (UnicodeDecodeError, ValueError):
            return None
        return ICudaEngine(spec) if isinstance(spec, dict) and spec.get("edged_standin") == 1 else None
