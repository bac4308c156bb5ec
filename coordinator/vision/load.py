"""Load an mmproj's vision tower and encode pictures with it: the API the text model's prompt building calls.

    vision = load_vision("mmproj-F16.gguf", text_width=cfg.n_embd, numerics=numerics)
    pic = vision.encode(picture_bytes)   # pic.rows [N, E] float32, pic.grid (rows, columns), N = rows * columns

Matrices stay as the file stores them (native: ggml multiplies the memory-mapped bytes; exact: float32 copies;
a GPU: float16 / float32 copies there), the way coordinator.loader loads the text model's; LayerNorms,
biases and the position grid are float32 parameters. Loading is strict: a tensor missing or left over is an
error naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.compute.dequant import dequantize
from swarm.coordinator.loader import check_names, default_device, make_matrix
from swarm.coordinator.models.linear import Linear
from swarm.coordinator.vision.encoder import VisionEncoder
from swarm.coordinator.vision.mmproj import MMProj, VisionConfig, open_mmproj
from swarm.coordinator.vision.preprocess import MAX_PICTURE_PIXELS, Limits, Picture, limits, preprocess
from swarm.proto.numerics import Numerics
from swarm.sharding.gguf_io import GGUFError, torch_shape

log = logging.getLogger(__name__)

# module path -> GGUF name where they differ: the Conv3d's second temporal slice
RENAMES = {"v.patch_embd_1.weight": "v.patch_embd.weight.1"}


@dataclass(frozen=True)
class EncodedPicture:
    """A picture's rows for the text model: `rows` [N, E] float32 (one per <|image_pad|> token, in raster
    order of the merged grid), `grid` (rows, columns) of that grid (N = rows * columns)."""

    rows: torch.Tensor
    grid: tuple[int, int]


@dataclass
class Vision:
    """A loaded vision tower and the preprocessing its file asks for."""

    encoder: VisionEncoder
    config: VisionConfig
    limits: Limits
    path: Path
    max_picture_pixels: int = MAX_PICTURE_PIXELS

    def prepare(self, data: bytes) -> Picture:
        """A picture's bytes (PNG, JPEG, WebP, ...) -> the preprocessed Picture; PictureError if unusable."""
        return preprocess(data, self.config, self.limits, self.max_picture_pixels)

    def encode(self, data: bytes) -> EncodedPicture:
        """A picture's bytes -> its rows for the text model."""
        return self.encode_picture(self.prepare(data))

    def encode_picture(self, pic: Picture) -> EncodedPicture:
        device = self.encoder.v.post_ln.weight.device
        patches = torch.from_numpy(pic.patches()).to(device)
        rows = self.encoder(patches, pic.grid)
        return EncodedPicture(rows.float(), pic.merged_grid)


def load_vision(
    path: str | Path,
    text_width: int | None = None,
    device: str | torch.device | None = None,
    numerics: Numerics = Numerics.NATIVE,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
) -> Vision:
    """The vision tower of the mmproj at `path`. `text_width`: the text model's embedding_length (a file of
    another width is refused); `min_tokens` / `max_tokens`: rows per picture (llama.cpp's
    --image-min-tokens / --image-max-tokens; default the file's, else 8 and 4096)."""
    mm = open_mmproj(path, text_width)
    device = torch.device(device) if device is not None else default_device()
    with torch.device(device):
        encoder = VisionEncoder(mm.config)
    fill(encoder, mm, device, numerics)
    encoder.native = numerics == Numerics.NATIVE
    encoder.eval()
    log.info("loaded vision tower %s (%d blocks, width %d) on %s", mm.path, mm.config.n_layer, mm.config.n_embd,
             device)  # fmt: skip
    return Vision(encoder, mm.config, limits(mm.config, min_tokens, max_tokens), mm.path)


def fill(encoder: VisionEncoder, mm: MMProj, device: torch.device, numerics: Numerics) -> None:
    """Set every Linear's matrix and copy every other parameter from the file tensor of its GGUF name."""
    linears = {
        RENAMES.get(name + ".weight", name + ".weight"): mod
        for name, mod in encoder.named_modules()
        if isinstance(mod, Linear)
    }
    params = dict(encoder.named_parameters())
    check_names(set(linears) | set(params), set(mm.tensors), {}, mm.path, "qwen3vl_merger vision tower")
    for name, lin in linears.items():
        t = mm.tensors[name]
        shape = torch_shape(t)
        if shape[0] != lin.d_out or _count(shape[1:]) != lin.d_in:
            raise _shape_error(mm.path, name, shape, (lin.d_out, lin.d_in))
        lin.matrix = make_matrix(t, (lin.d_out, lin.d_in), device, numerics)
    for name, param in params.items():
        t = mm.tensors[name]
        shape = torch_shape(t)
        if _count(shape) != param.numel() or shape[-1] != param.shape[-1]:
            raise _shape_error(mm.path, name, shape, tuple(param.shape))
        with torch.no_grad():
            param.data.copy_(dequantize(t.data, t.tensor_type, shape).reshape(param.shape))


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shape_error(path: Path, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> GGUFError:
    return GGUFError(
        f"{path}: tensor {name} has shape {list(shape)}, the vision tower built from the file's metadata "
        f"expects {list(want)}; convert the mmproj again"
    )
