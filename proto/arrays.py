"""Rows as numpy arrays, the one array type below the coordinator: a node never loads torch.

numpy has no bfloat16: bfloat16 rows live in numpy as their 16-bit patterns, dtype uint16 (no other wire
type is uint16, so the dtype says what they are). The coordinator's torch tensors cross into numpy and back
here without a copy where the layout allows (`to_numpy`, `to_torch`); torch is imported only by `to_torch`,
which only a process that has torch (the coordinator) calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BF16 = np.dtype(np.uint16)  # bfloat16 bit patterns
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
ROW_DTYPES = (F32, F16, BF16)
_NAMES = {F32: "float32", F16: "float16", BF16: "bfloat16"}
_BY_NAME = {
    "float32": F32, "float16": F16, "bfloat16": BF16,
    "torch.float32": F32, "torch.float16": F16, "torch.bfloat16": BF16,
    "f32": F32, "f16": F16, "bf16": BF16,
}  # fmt: skip


def dtype_name(dtype: np.dtype) -> str:
    return _NAMES.get(np.dtype(dtype), str(dtype))


def row_dtype(dtype: object) -> np.dtype:
    """The numpy dtype rows of this type live in: a numpy dtype, a torch dtype (by its name: torch is not
    imported here) or a short name (f32, f16, bf16). ValueError for anything else."""
    key = str(dtype) if not isinstance(dtype, np.dtype) else dtype_name(dtype)
    try:
        return _BY_NAME[key]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not a row type; use float32, float16 or bfloat16") from None


def is_numpy(x: object) -> bool:
    return isinstance(x, np.ndarray)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view of a CPU tensor's values (copied only when it is on a device, strided or needs grad);
    numpy arrays pass as they are. bfloat16 becomes its uint16 bit patterns."""
    if isinstance(x, np.ndarray):
        return x
    t = x.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if str(t.dtype) == "torch.bfloat16":
        return t.view(dtype=_torch().int16).numpy().view(BF16)
    return t.numpy()


def to_torch(a: np.ndarray) -> Any:
    """The torch tensor over a numpy array's memory (uint16 read as bfloat16)."""
    torch = _torch()
    if a.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def as_given(a: np.ndarray, like: object) -> Any:
    """`a` as the caller's kind of array: a torch tensor when `like` is one, else `a` itself."""
    return a if isinstance(like, np.ndarray) else to_torch(a)


def f32_values(a: np.ndarray) -> np.ndarray:
    """float32 values of rows of any row type, C-contiguous (bfloat16 widens exactly: its bits are the high
    half of the float32's)."""
    if a.dtype == BF16:
        return (np.ascontiguousarray(a).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def cast_rows(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 rows as `dtype`: float16 as numpy rounds it (to nearest, ties to even, as torch does),
    bfloat16 rounded to nearest, ties to even (both as torch does; a NaN stays a NaN, its payload aside)."""
    dtype = np.dtype(dtype)
    if dtype == F32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == F16:
        with np.errstate(over="ignore"):  # past float16's range is inf, as in torch
            return np.ascontiguousarray(a).astype(np.float16)
    if dtype != BF16:
        raise ValueError(f"cannot cast rows to {dtype}")
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return rounded


def _torch() -> Any:
    import torch  # only a process that has torch arrives here (see the module's docstring)

    return torch
