"""Registering the arena mapping as pinned memory, with a pageable fallback.

Copies between the GPU and pinned (page-locked, registered) host memory are DMA transfers
that run asynchronously on the copy stream. Pinning is only a speed-up: a ``cudaMemcpyAsync``
to or from pageable memory is still correct, but the driver stages it and may block the host
until it is done (a store then waits for the forward it follows).

So a failed registration (locked-memory limit, unsupported mapping, no CUDA runtime found) is
not an error: the mapping stays pageable, the worker counts it
(``vllm:kvtier_arena_pageable_total``) and does not try that mapping again.

Registration goes through vLLM's own helper (``vllm/v1/kv_offload/cpu/host_register.py``,
which also covers ROCm) when vLLM is importable; otherwise kvtier does the same: it calls
``cudaHostRegister`` of the CUDA runtime torch has loaded and, on failure, clears the error
with ``cudaGetLastError`` (a failed runtime call leaves it pending, and torch's next kernel
launch check would raise it). ``torch.cuda.cudart()`` is not used because it cannot clear it.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from typing import Any, Protocol

log = logging.getLogger("kvtier.vllm")


class PinMode(enum.Enum):
    PINNED = "pinned"
    PAGEABLE = "pageable"


class HostPinner(Protocol):
    name: str

    def register(self, ptr: int, nbytes: int) -> bool:
        """Pin ``[ptr, ptr + nbytes)``; False (and no pending CUDA error) if not possible."""

    def unregister(self, ptr: int) -> None:
        """Undo a successful :meth:`register`."""


class VllmPinner:
    """vLLM's ``host_register`` / ``host_unregister``."""

    name = "vllm"

    def __init__(self, module: Any) -> None:
        self._module = module

    def register(self, ptr: int, nbytes: int) -> bool:
        return bool(self._module.host_register(ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self._module.host_unregister(ptr)


class CudartPinner:
    """``cudaHostRegister`` through ctypes, on the CUDA runtime library this process loaded."""

    name = "cudart"

    def __init__(self) -> None:
        self._lib: Any = None
        path = loaded_library("libcudart")
        if path is None:
            log.warning("kvtier: no CUDA runtime library loaded in this process; the arena "
                        "stays pageable (correct, slower copies)")
            return
        lib = ctypes.CDLL(path)
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        self._lib = lib

    def register(self, ptr: int, nbytes: int) -> bool:
        if self._lib is None or not ptr or nbytes <= 0:
            return False
        rc = self._lib.cudaHostRegister(ptr, nbytes, 0)  # cudaHostRegisterDefault
        if rc != 0:
            self._lib.cudaGetLastError()
            log.warning("kvtier: cudaHostRegister of the arena failed (error %d); copies use "
                        "pageable memory (correct, slower)", rc)
            return False
        return True

    def unregister(self, ptr: int) -> None:
        if self._lib is not None and self._lib.cudaHostUnregister(ptr) != 0:
            self._lib.cudaGetLastError()
            log.warning("kvtier: cudaHostUnregister of the arena failed")


def default_pinner() -> HostPinner:
    try:
        from vllm.v1.kv_offload.cpu import host_register
    except ImportError:
        return CudartPinner()
    return VllmPinner(host_register)


def loaded_library(stem: str) -> str | None:
    """Path of a shared library whose file name starts with ``stem``, as mapped in this
    process (the same instance torch uses, so its error state is the one torch checks)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(stem + "."):
                    return path
    except OSError:
        return None
    return None
