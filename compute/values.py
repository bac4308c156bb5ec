"""float32 values of GGUF tensor bytes as a numpy array, for the exact numerics' working copies.

Two decoders give the same bits (tests/test_dequant.py compares them bit for bit): the torch one
(swarm.compute.dequant, several times faster: the coordinator's, which loads the whole dense GGUF with it)
and gguf-py's numpy one (swarm.sharding.gguf_io.dequantize). A process that has torch loaded uses the first; a
node, which never loads torch, the second. Either way the result is a numpy array that aliases nothing of
the file.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from swarm.sharding import gguf_io


def float32_values(
    data: np.ndarray, qtype: int, shape: tuple[int, ...], out: np.ndarray | None = None
) -> np.ndarray:
    """Raw tensor bytes (or typed F32 / F16 values) of ggml type `qtype` -> float32 values of torch-order
    `shape`, into `out` (C-contiguous float32 of as many elements) when given."""
    qtype = GGMLQuantizationType(int(qtype))
    shape = tuple(int(s) for s in shape)
    if "torch" in sys.modules:  # the faster decoder, in a process that already paid for torch
        import torch

        from swarm.compute.dequant import dequantize

        if out is None:
            return dequantize(data, qtype, shape).numpy()
        dequantize(data, qtype, shape, out=torch.from_numpy(out))
        return out.reshape(shape)
    values = gguf_io.dequantize(data, qtype, shape)
    if out is None:
        return np.ascontiguousarray(values, np.float32)
    if not out.flags.c_contiguous or out.dtype != np.float32 or out.size != values.size:
        raise ValueError(f"out must be a C-contiguous float32 array of {values.size} values")
    out.reshape(shape)[...] = values
    return out.reshape(shape)


def ggml_values(data: Any, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32_values by ggml's own dequantizer where it has one for qtype (a 35B expert matrix in a fraction
    of a millisecond, where a busy machine's torch dequantizer took hundreds): the same values."""
    from swarm.compute.ggml import ggml_lib

    to_float = ggml_lib().ggml_get_type_traits(int(qtype)).contents.to_float
    if not ctypes.cast(to_float, ctypes.c_void_p).value:
        return float32_values(data, qtype, shape)
    data = np.ascontiguousarray(data)
    out = np.empty(shape, np.float32)
    to_float(data.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out
