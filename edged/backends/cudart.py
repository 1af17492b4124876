"""The CUDA runtime through ``ctypes``: the few calls TensorRT inference needs, nothing to compile.

Why not pycuda (it compiles against the local CUDA at install time) or cuda-python
(another large package): ``libcudart`` ships with JetPack, with every CUDA toolkit
and in the ``nvidia-cuda-runtime`` wheel that pip's ``tensorrt`` depends on.
ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
from typing import Any

from edged.errors import EngineUnavailableError, InternalError

INSTALL_HINT = ("TensorRT ships with JetPack on Jetson; on x86-64 with an NVIDIA GPU and CUDA: "
                "pip install tensorrt")
H2D, D2H = 1, 2  # cudaMemcpyKind
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # cudaDeviceAttr
_STREAM_NON_BLOCKING = 1

_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_void_pp = ctypes.POINTER(ctypes.c_void_p)
_SIGNATURES: dict[str, list[Any]] = {
    "cudaGetDeviceCount": [_c_int_p],
    "cudaSetDevice": [ctypes.c_int],
    "cudaDeviceGetAttribute": [_c_int_p, ctypes.c_int, ctypes.c_int],
    "cudaRuntimeGetVersion": [_c_int_p],
    "cudaDriverGetVersion": [_c_int_p],
    "cudaMalloc": [_c_void_pp, ctypes.c_size_t],
    "cudaFree": [ctypes.c_void_p],
    "cudaStreamCreateWithFlags": [_c_void_pp, ctypes.c_uint],
    "cudaStreamDestroy": [ctypes.c_void_p],
    "cudaStreamSynchronize": [ctypes.c_void_p],
    "cudaMemcpyAsync": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
}


class CudaRuntime:
    """A loaded libcudart with typed entry points."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        self._props = getattr(lib, "cudaGetDeviceProperties_v2", None) or lib.cudaGetDeviceProperties
        self._props.restype = ctypes.c_int
        self._props.argtypes = [ctypes.c_void_p, ctypes.c_int]

    def error(self, rc: int) -> str:
        text = self._lib.cudaGetErrorString(rc)
        return text.decode(errors="replace") if text else f"CUDA error {rc}"

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise InternalError(f"CUDA {what} failed: {self.error(rc)}")

    def _int(self, fn: str, *args: Any) -> int:
        out = ctypes.c_int()
        self._check(getattr(self._lib, fn)(ctypes.byref(out), *args), fn)
        return out.value

    def device_count(self) -> tuple[int, str | None]:
        """(count, why none) without raising: no driver or no device is an answer, not an error."""
        n = ctypes.c_int()
        rc = self._lib.cudaGetDeviceCount(ctypes.byref(n))
        return (n.value, None) if rc == 0 else (0, self.error(rc))

    def set_device(self, index: int) -> None:
        self._check(self._lib.cudaSetDevice(index), "cudaSetDevice")

    def device_name(self, index: int) -> str:
        buf = ctypes.create_string_buffer(8192)  # cudaDeviceProp is ~1 KB; its first field is char name[256]
        self._check(self._props(buf, index), "cudaGetDeviceProperties")
        return buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace")

    def compute_capability(self, index: int) -> str:
        return f"{self._int('cudaDeviceGetAttribute', _ATTR_CC_MAJOR, index)}." \
               f"{self._int('cudaDeviceGetAttribute', _ATTR_CC_MINOR, index)}"

    def runtime_version(self) -> str:
        v = self._int("cudaRuntimeGetVersion")
        return f"{v // 1000}.{v % 1000 // 10}"

    def driver_version(self) -> str:
        v = self._int("cudaDriverGetVersion")
        return f"{v // 1000}.{v % 1000 // 10}"

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        rc = self._lib.cudaMalloc(ctypes.byref(ptr), nbytes)
        if rc != 0:
            raise InternalError(f"CUDA could not allocate {nbytes} bytes of device memory: {self.error(rc)}")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._lib.cudaFree(ctypes.c_void_p(ptr))

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self._check(self._lib.cudaStreamCreateWithFlags(ctypes.byref(s), _STREAM_NON_BLOCKING), "stream create")
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._lib.cudaStreamDestroy(ctypes.c_void_p(stream))

    def stream_sync(self, stream: int) -> None:
        self._check(self._lib.cudaStreamSynchronize(ctypes.c_void_p(stream)), "stream synchronize")

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        rc = self._lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, kind,
                                       ctypes.c_void_p(stream))
        self._check(rc, "memcpy")


def _cudart_paths() -> list[str]:
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so.10.2"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/targets/aarch64-linux/lib"):
        names += sorted(glob.glob(f"{d}/libcudart.so*"))
    try:  # the pip wheel that TensorRT's pip package depends on
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        names += sorted(glob.glob(f"{loc}/lib/libcudart.so*"))
    return names


@functools.lru_cache(maxsize=1)
def cuda_runtime() -> CudaRuntime:
    """The process's CUDA runtime; EngineUnavailableError when no libcudart can be loaded."""
    tried = []
    for name in _cudart_paths():
        try:
            return CudaRuntime(ctypes.CDLL(name))
        except (OSError, AttributeError) as e:
            tried.append(f"{name}: {e}")
    raise EngineUnavailableError(f"the CUDA runtime (libcudart) was not found; {INSTALL_HINT} "
                                 f"(tried {', '.join(n.split(':')[0] for n in tried[:4])})")
