"""A random-weight mmproj GGUF of the real Qwen3.5 / Qwen3.6 vision tower's shape (projector `qwen3vl_merger`),
written the way llama.cpp's converter writes the real one, for bench/vision.py.

Shape: 27 ViT blocks of width 1152 (16 heads, MLP 4304), patch 16, spatial merge 2, a 48 x 48 learned position
grid (image_size 768), the merger out to 2048 (the text width of Qwen3.6-35B-A3B). Keys and tensor names are
those of the fixture in shared/fixtures/qwen35moe-vision (meta.json) at this shape.

Types, as `convert_hf_to_gguf.py --mmproj --outtype f16|q8_0` gives them: the matrices in the file type, except
a Q8_0 matrix whose rows are not whole 32-value blocks (ffn_down, rows of 4304), which the converter writes
F16; the patch embedding F16 in an F16 file and F32 otherwise; the position grid, LayerNorms and biases F32.

Weights: per tensor a numpy generator seeded from (seed, name), as the fixture's init but smaller so that 27
blocks of F16 products stay well inside F16's range: matrices N(0, 1) / sqrt(fan_in) * 0.5, biases N(0, 0.02),
LayerNorm weights 1 + N(0, 0.05), the position grid N(0, 0.1).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

log = logging.getLogger("bench.vision")

Q8_BLOCK = 32
TYPES = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0}
# bytes per 32 values
BYTES = {GGMLQuantizationType.F32: 128, GGMLQuantizationType.F16: 64, GGMLQuantizationType.Q8_0: 34}
FILE_TYPES = {"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class TowerShape:
    n_layer: int = 27
    n_embd: int = 1152
    n_ff: int = 4304
    n_head: int = 16
    patch: int = 16
    merge: int = 2
    pos_side: int = 48
    n_out: int = 2048


QWEN36 = TowerShape()


def tensor_plan(shape: TowerShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape = PyTorch shape, role) of every tensor; role: matrix, conv, pos, norm, bias."""
    d, f = shape.n_embd, shape.n_ff
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("v.patch_embd.weight", (d, 3, shape.patch, shape.patch), "conv"),
        ("v.patch_embd.weight.1", (d, 3, shape.patch, shape.patch), "conv"),
        ("v.patch_embd.bias", (d,), "bias"),
        ("v.position_embd.weight", (shape.pos_side**2, d), "pos"),
    ]
    for i in range(shape.n_layer):
        b = f"v.blk.{i}"
        plan += [
            (f"{b}.ln1.weight", (d,), "norm"),
            (f"{b}.ln1.bias", (d,), "bias"),
            (f"{b}.attn_qkv.weight", (3 * d, d), "matrix"),
            (f"{b}.attn_qkv.bias", (3 * d,), "bias"),
            (f"{b}.attn_out.weight", (d, d), "matrix"),
            (f"{b}.attn_out.bias", (d,), "bias"),
            (f"{b}.ln2.weight", (d,), "norm"),
            (f"{b}.ln2.bias", (d,), "bias"),
            (f"{b}.ffn_up.weight", (f, d), "matrix"),
            (f"{b}.ffn_up.bias", (f,), "bias"),
            (f"{b}.ffn_down.weight", (d, f), "matrix"),
            (f"{b}.ffn_down.bias", (d,), "bias"),
        ]
    wide = d * shape.merge**2
    plan += [
        ("v.post_ln.weight", (d,), "norm"),
        ("v.post_ln.bias", (d,), "bias"),
        ("mm.0.weight", (wide, wide), "matrix"),
        ("mm.0.bias", (wide,), "bias"),
        ("mm.2.weight", (shape.n_out, wide), "matrix"),
        ("mm.2.bias", (shape.n_out,), "bias"),
    ]
    return plan


def stored_type(role: str, shape: tuple[int, ...], kind: str) -> GGMLQuantizationType:
    """The GGUF type the converter gives a tensor of this role in a `kind` ("f16" / "q8_0") file."""
    if role == "matrix":
        if kind == "q8_0" and shape[-1] % Q8_BLOCK:
            return GGMLQuantizationType.F16  # the converter's fallback for rows that are not whole blocks
        return TYPES[kind]
    if role == "conv":
        return GGMLQuantizationType.F16 if kind == "f16" else GGMLQuantizationType.F32
    return GGMLQuantizationType.F32


def values(name: str, shape: tuple[int, ...], role: str, seed: int) -> np.ndarray:
    """The tensor's deterministic float32 values (module docstring)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    x = rng.standard_normal(shape, dtype=np.float32)
    if role in ("matrix", "conv"):
        fan_in = int(np.prod(shape[1:]))
        return x * np.float32(0.5 / np.sqrt(fan_in))
    if role == "norm":
        return np.float32(1.0) + x * np.float32(0.05)
    if role == "pos":
        return x * np.float32(0.1)
    return x * np.float32(0.02)


def file_bytes(shape: TowerShape, kind: str) -> int:
    """Tensor bytes of the file (its size less metadata and alignment padding)."""
    total = 0
    for _name, shp, role in tensor_plan(shape):
        n = int(np.prod(shp))
        total += n * BYTES[stored_type(role, shp, kind)] // Q8_BLOCK
    return total


def write_mmproj(path: Path, kind: str, shape: TowerShape = QWEN36, seed: int = 3636) -> Path:
    """Write the mmproj (atomically; kept when it already exists: the weights are deterministic)."""
    if path.exists():
        return path
    log.info("writing %s ...", path.name)
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, "clip")
    w.add_type("mmproj")
    w.add_name(f"qwen36-vision-random-{kind}")
    w.add_file_type(FILE_TYPES[kind])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", shape.n_out)
    w.add_uint32("clip.vision.image_size", shape.pos_side * shape.patch)
    w.add_uint32("clip.vision.patch_size", shape.patch)
    w.add_uint32("clip.vision.embedding_length", shape.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", shape.n_ff)
    w.add_uint32("clip.vision.block_count", shape.n_layer)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", shape.merge)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.is_deepstack_layers", [False] * shape.n_layer)
    w.add_quantization_version(2)
    for name, shp, role in tensor_plan(shape):
        x = values(name, shp, role, seed)
        qtype = stored_type(role, shp, kind)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf_quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path
