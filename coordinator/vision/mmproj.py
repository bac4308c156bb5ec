"""An `mmproj` GGUF (llama.cpp's vision projector file, `general.architecture = clip`) of the Qwen3-VL family's
ViT + 2x2 merger (`clip.projector_type = qwen3vl_merger`: Qwen3.5 / Qwen3.6), read into one frozen config and
its tensors by name.

Only this projector is read: the others (LLaVA, Gemma, Qwen2-VL windows, Qwen3-VL deepstack taps, ...) build
other graphs, and a file of one of them is refused with a message naming it rather than run wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys
from gguf.gguf_reader import ReaderTensor

from swarm.sharding.gguf_io import GGUFError, open_gguf, read_metadata, torch_shape

log = logging.getLogger(__name__)

CLIP_ARCH = "clip"  # general.architecture of every mmproj file
PROJECTOR = "qwen3vl_merger"  # llama.cpp PROJECTOR_TYPE_QWEN3VL
# llama.cpp's limits for this projector when neither the file nor the user gives any (clip.cpp
# set_limit_image_tokens(8, 4096)): merged tokens, each (patch_size * merge)^2 pixels.
DEFAULT_MIN_TOKENS = 8
DEFAULT_MAX_TOKENS = 4096
ROPE_THETA = 10000.0  # the ViT's 2-D RoPE base, fixed in llama.cpp's graph and transformers' config alike


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyper-parameters, from the mmproj's metadata and tensor shapes."""

    n_embd: int  # D_v, the ViT width
    n_ff: int  # the ViT MLP width
    n_layer: int
    n_head: int
    eps: float  # every LayerNorm's
    patch_size: int  # pixels per patch side
    merge: int  # spatial merge: merge x merge patches become one output row
    n_out: int  # D_text, the merger's output width (the text model's embedding_length)
    pos_side: int  # the learned position grid is pos_side x pos_side
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int | None  # clip.vision.image_min_pixels / image_max_pixels, where the file has them
    max_pixels: int | None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def patch_values(self) -> int:
        """Values in one patch row: 3 channels x patch_size x patch_size."""
        return 3 * self.patch_size * self.patch_size


@dataclass(frozen=True)
class MMProj:
    """An opened mmproj file: its config, every metadata key, and its tensors by GGUF name (memory-mapped)."""

    path: Path
    config: VisionConfig
    meta: dict[str, Any]
    tensors: dict[str, ReaderTensor]


def open_mmproj(path: str | Path, text_width: int | None = None) -> MMProj:
    """Open and check an mmproj GGUF. `text_width`: the text model's embedding_length, which the merger's
    output rows must have (they replace token embeddings); None skips that check."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from(meta, tensors, path)
    if text_width is not None and cfg.n_out != text_width:
        raise GGUFError(
            f"{path}: its projector makes rows of {cfg.n_out} values (clip.vision.projection_dim) but the text "
            f"model's embeddings have {text_width}; this mmproj belongs to another model: use the mmproj "
            "file published with the model"
        )
    return MMProj(path, cfg, meta, tensors)


def config_from(meta: dict[str, Any], tensors: dict[str, ReaderTensor], path: Path) -> VisionConfig:
    """The VisionConfig of a file's metadata, refusing what is not a qwen3vl_merger mmproj."""
    check_kind(meta, path)

    def need(key: str) -> Any:
        if key not in meta:
            raise GGUFError(f"{path}: metadata key {key} is missing; convert the mmproj again")
        return meta[key]

    n_embd = int(need(Keys.ClipVision.EMBEDDING_LENGTH))
    n_head = int(need(Keys.ClipVision.Attention.HEAD_COUNT))
    n_layer = int(need(Keys.ClipVision.BLOCK_COUNT))
    deepstack = meta.get(Keys.ClipVision.IS_DEEPSTACK_LAYERS) or []
    if any(deepstack):
        raise GGUFError(
            f"{path}: a Qwen3-VL projector with deepstack layers ({Keys.ClipVision.IS_DEEPSTACK_LAYERS}); "
            "swarm reads the Qwen3.5 / Qwen3.6 projector, which has none"
        )
    if n_head < 1 or n_embd % n_head or (n_embd // n_head) % 4:
        raise GGUFError(
            f"{path}: a ViT of width {n_embd} in {n_head} heads; the 2-D RoPE needs head_dim % 4 == 0"
        )
    pos = tensors.get("v.position_embd.weight")
    if pos is None:
        raise GGUFError(f"{path}: tensor v.position_embd.weight is missing; convert the mmproj again")
    n_pos = torch_shape(pos)[0]
    side = round(n_pos**0.5)
    if side * side != n_pos:
        raise GGUFError(f"{path}: v.position_embd.weight has {n_pos} rows, not a square grid")
    mean, std = need(Keys.ClipVision.IMAGE_MEAN), need(Keys.ClipVision.IMAGE_STD)
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
        raise GGUFError(f"{path}: image_mean {mean} / image_std {std} are not 3 channels (std > 0)")
    cfg = VisionConfig(
        n_embd=n_embd,
        n_ff=int(need(Keys.ClipVision.FEED_FORWARD_LENGTH)),
        n_layer=n_layer,
        n_head=n_head,
        eps=float(need(Keys.ClipVision.Attention.LAYERNORM_EPS)),
        patch_size=int(need(Keys.ClipVision.PATCH_SIZE)),
        merge=int(meta.get(Keys.ClipVision.SPATIAL_MERGE_SIZE, 2)),
        n_out=int(need(Keys.ClipVision.PROJECTION_DIM)),
        pos_side=side,
        image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
        image_std=(float(std[0]), float(std[1]), float(std[2])),
        min_pixels=_positive(meta.get(Keys.ClipVision.IMAGE_MIN_PIXELS)),
        max_pixels=_positive(meta.get(Keys.ClipVision.IMAGE_MAX_PIXELS)),
    )
    if cfg.patch_size < 1 or cfg.merge < 1 or cfg.n_layer < 1:
        raise GGUFError(f"{path}: patch_size {cfg.patch_size}, merge {cfg.merge}, {cfg.n_layer} blocks")
    return cfg


def check_kind(meta: dict[str, Any], path: Path) -> None:
    """Refuse a file that is not an mmproj, has no vision tower, or holds another projector."""
    arch = meta.get(Keys.General.ARCHITECTURE)
    if arch != CLIP_ARCH:
        what = f"a {arch} model" if isinstance(arch, str) else "not a model file"
        raise GGUFError(
            f"{path}: is {what}, not a vision projector (mmproj GGUF, general.architecture = clip); pass the "
            "model's mmproj file (e.g. mmproj-F16.gguf)"
        )
    kind = meta.get(Keys.General.TYPE)
    if kind is not None and kind != "mmproj":
        raise GGUFError(f"{path}: general.type is {kind!r}, not 'mmproj'")
    if not meta.get(Keys.Clip.HAS_VISION_ENCODER, False):
        raise GGUFError(
            f"{path}: this mmproj has no vision encoder (an audio projector?); pass a vision mmproj"
        )
    proj = meta.get(Keys.Clip.PROJECTOR_TYPE) or meta.get(Keys.ClipVision.PROJECTOR_TYPE)
    if proj != PROJECTOR:
        raise GGUFError(
            f"{path}: projector {proj!r} is not one swarm reads; it reads {PROJECTOR!r} (the Qwen3.5 / Qwen3.6 "
            "vision tower)"
        )


def _positive(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and value > 0 else None
