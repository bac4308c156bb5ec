"""The one place that opens GGUF files: metadata, stacked expert tensors, dequantization.

Shapes follow torch order (slowest first): a ggml tensor with ne = [D, F, E] is the array [E, F, D].
Every other part of swarm reads GGUFs through these functions, so a bad file gets the same clear
`GGUFError` wherever it is opened.
"""

from __future__ import annotations

import errno
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, Keys
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize as gguf_dequantize

from swarm.sharding.errors import UserError

GGUF_MAGIC = b"GGUF"

# gguf.Keys has no constant for this one: a bool per block, true for the hybrid archs' linear-attention
# blocks (llama.cpp reads it).
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"

# blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias}: the stacked per-expert tensors, expert dim outermost.
EXPERT_TENSOR_RE = re.compile(
    r"^blk\.(?P<layer>\d+)\.(?P<kind>ffn_(?:gate|up|down|gate_up)_exps)\.(?P<part>weight|bias)$"
)


class GGUFError(UserError, ValueError):
    """A GGUF file that cannot be used; the message names the file and says what to do."""


class _BoundedReader(GGUFReader):
    """gguf's reader, refusing to read past the end of the file, and reading its header 3-4x faster.

    Its reads are slices of the memory map, which come back short (not failing) past the end, so a
    damaged header with an absurd array length would loop over empty reads for as long as the length says
    (a hang, not an error). Every read of a header value goes through `_get`: a short one raises here.

    `_get` is gguf's own read, on a plain-array view of the same memory map: every slice of numpy's memmap
    subclass runs Python-level bookkeeping, and a 151k-token vocabulary with its merges is 750k slices (19 s
    to open on a 2-core VM, 5 s this way). The arrays are views of the same mapped bytes."""

    _flat: np.ndarray | None = None

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        flat = self._flat
        if flat is None:
            flat = self._flat = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = flat[offset : offset + dt.itemsize * count].view(dt)[:count]
        if len(arr) != count:
            raise EOFError(f"the header runs past the end of the file at byte {offset}")
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: str | Path) -> GGUFReader:
    """Memory-map a GGUF file, turning every way it can be unreadable into one clear GGUFError.

    Readers are shared: opening the same unchanged file again (same inode, size and mtime) returns the
    reader already made. gguf's reader builds a Python object for every metadata string, so a 151k-token
    vocabulary takes seconds to parse even with _BoundedReader's faster reads, and one `swarm run` on a GGUF
    looks at it three or four times
    (identity, fingerprint, slabs, dense weights). Readers are read-only; callers must not modify them.
    """
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, expected a .gguf file")
    st = path.stat()
    return _open_gguf(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, inode: int, size: int, mtime_ns: int) -> GGUFReader:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        if e.errno in TOO_MANY_FILES:
            raise too_many_open_files(path) from e
        raise GGUFError(f"{path}: cannot be read ({e.strerror}); check its permissions") from e
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _BoundedReader(path, "r")
    except ValueError as e:
        msg = str(e)
        if "is not a valid GGMLQuantizationType" in msg:
            raise GGUFError(
                f"{path}: uses a tensor type this version of gguf does not know ({msg}); "
                "upgrade the gguf package or re-quantize the model"
            ) from e
        raise GGUFError(
            f"{path}: damaged or truncated GGUF ({msg[:200]}); download or convert it again"
        ) from e
    except (KeyError, IndexError, OSError, EOFError, OverflowError, MemoryError, TypeError) as e:
        if isinstance(e, OSError) and e.errno in TOO_MANY_FILES:
            raise too_many_open_files(path) from e
        # gguf's reader trusts the header: absurd counts, lengths and offsets surface as these
        raise GGUFError(
            f"{path}: truncated or damaged GGUF ({type(e).__name__}: {str(e)[:200]}); download or convert it again"
        ) from e
    check_tensors(reader, path, size)
    return reader


TOO_MANY_FILES = (errno.EMFILE, errno.ENFILE)  # the process's limit, the system's


def too_many_open_files(path: Path) -> UserError:
    """The error for a file the process may not open because it has as many open as it may: each memory-mapped
    GGUF (every slab file a node or coordinator holds) keeps a descriptor open."""
    try:
        import resource

        limit = f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]:,}"
    except ImportError:  # not a POSIX system
        limit = "the system's"
    return UserError(
        f"{path}: cannot be opened: this process already has as many files open as it may ({limit}; "
        "every slab file held stays open, memory-mapped); raise the limit (e.g. `ulimit -n 65536`, or "
        "LimitNOFILE= in a systemd unit) and start again"
    )


MAX_DIMS = 4  # GGML_MAX_DIMS


@functools.cache
def weight_types() -> frozenset[GGMLQuantizationType]:
    """The tensor types swarm can compute with: F32, F16 and every type gguf-py dequantizes (the exact path,
    and the fallback where ggml has no kernel), found by asking it for one zero block of each, once.
    Integer tensors (I8..I64), F64 and the activation types (Q8_1, Q8_K) hold no weights of these families:
    a header that names one is damaged."""
    found = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    for qtype in GGMLQuantizationType:
        if qtype in found or qtype not in GGML_QUANT_SIZES:
            continue
        try:
            gguf_dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError):
            continue
        found.add(qtype)
    return frozenset(found)


def check_tensors(reader: GGUFReader, path: Path, file_size: int) -> None:
    """Every tensor's header is consistent: a type swarm computes with, 1-4 dimensions of at least 1, whole
    quant blocks per row, a byte count that matches its shape and type, data inside the file. gguf's reader
    takes these on trust."""
    for t in reader.tensors:
        where = f"{path}: tensor {t.name[:80]!r}"
        dims = [int(d) for d in t.shape.tolist()]
        if not 1 <= len(dims) <= MAX_DIMS or any(d < 1 for d in dims):
            raise GGUFError(f"{where} has shape {dims[:8]}; a damaged header: download or convert it again")
        if t.tensor_type not in weight_types():
            raise GGUFError(
                f"{where} is of type {t.tensor_type.name}, which holds no weights swarm can compute with; "
                "a damaged header or a different kind of file: download or convert it again"
            )
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        n = int(np.prod(dims, dtype=object))
        if dims[0] % block or n // block * type_size != int(t.n_bytes):
            raise GGUFError(
                f"{where}: shape {dims} of {t.tensor_type.name} does not make its {int(t.n_bytes)} bytes; "
                "a damaged header: download or convert it again"
            )
        if not 0 <= int(t.data_offset) <= file_size - int(t.n_bytes):
            raise GGUFError(
                f"{where}: its data lies outside the file (truncated or damaged); download it again"
            )


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key of the file as plain Python values (str, int, float, bool, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header pseudo-fields, not metadata
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, TypeError, OverflowError) as e:  # e.g. a string that is not UTF-8
            raise GGUFError(
                f"{getattr(reader.data, 'filename', None) or 'the file'}: metadata key "
                f"{key[:80]!r} is damaged ({type(e).__name__}: {str(e)[:120]}); download or convert it again"
            ) from e
    return meta


def architecture(meta: dict[str, Any], path: str | Path = "") -> str:
    arch = meta.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: has no {Keys.General.ARCHITECTURE} key; it is not a model GGUF")
    return arch


@dataclass(frozen=True)
class ExpertTensor:
    """One stacked expert tensor: expert e is the contiguous byte range [offset + e*slab_bytes, +slab_bytes)."""

    name: str  # blk.7.ffn_up_exps.weight
    layer: int
    kind: str  # ffn_gate_exps | ffn_up_exps | ffn_down_exps | ffn_gate_up_exps
    qtype: GGMLQuantizationType
    n_expert: int
    slab_shape: tuple[
        int, ...
    ]  # torch order, one expert: [F, D] for gate/up, [D, F] for down, [F] for a bias
    slab_bytes: int
    data_offset: int  # absolute file offset of expert 0
    tensor: ReaderTensor

    def slab(self, expert: int) -> np.ndarray:
        """Expert `expert`'s raw bytes, a zero-copy view of the memory-mapped file."""
        raw = self.tensor.data.reshape(-1).view(np.uint8)
        return raw[expert * self.slab_bytes : (expert + 1) * self.slab_bytes]


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def expert_tensors(reader: GGUFReader, path: str | Path = "") -> list[ExpertTensor]:
    """All stacked expert tensors of a model, validated as cuttable at the expert grain."""
    found: list[ExpertTensor] = []
    for t in reader.tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        if m is None:
            continue
        shape = torch_shape(t)
        if len(shape) < 2:
            raise GGUFError(
                f"{path}: expert tensor {t.name} has shape {shape}; expected the expert dimension outermost"
            )
        n_expert = shape[0]
        if n_expert < 1 or t.n_bytes % n_expert != 0:
            raise GGUFError(
                f"{path}: expert tensor {t.name} ({t.n_bytes} bytes) does not split into {n_expert} equal slabs"
            )
        block_size, _ = GGML_QUANT_SIZES[t.tensor_type]
        if shape[-1] % block_size != 0:
            raise GGUFError(
                f"{path}: expert tensor {t.name} rows of {shape[-1]} elements are not whole {t.tensor_type.name} "
                f"blocks of {block_size}; it cannot be cut at the expert grain"
            )
        found.append(
            ExpertTensor(
                name=t.name,
                layer=int(m.group("layer")),
                kind=m.group("kind"),
                qtype=t.tensor_type,
                n_expert=n_expert,
                slab_shape=shape[1:],
                slab_bytes=t.n_bytes // n_expert,
                data_offset=int(t.data_offset),
                tensor=t,
            )
        )
    return found


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes (or typed values) of ggml type `qtype` to a float32 array of torch shape `shape`."""
    if qtype == GGMLQuantizationType.F32:
        out = np.asarray(data).view(np.float32) if np.asarray(data).dtype == np.uint8 else np.asarray(data)
        # A copy: the working copy must not alias the read-only memory map.
        return np.array(out, dtype=np.float32, copy=True).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        out = np.asarray(data).view(np.float16) if np.asarray(data).dtype == np.uint8 else np.asarray(data)
        return out.astype(np.float32).reshape(shape)
    raw = np.asarray(data).view(np.uint8).reshape(-1)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    values = gguf_dequantize(raw.reshape(rows, -1), qtype)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def tensor_to_numpy(tensor: ReaderTensor) -> np.ndarray:
    """A whole tensor, dequantized to float32 in torch shape order."""
    return dequantize(tensor.data, tensor.tensor_type, torch_shape(tensor))
