"""A picture's bytes to the normalised pixels and patch rows the vision encoder reads, as llama.cpp's mtmd
prepares them for the qwen3vl_merger projector (mtmd-image.cpp, the dynamic-size preprocessor):

1. decode (Pillow: PNG, JPEG, WebP, GIF, BMP) to 8-bit RGB, alpha dropped, EXIF orientation not applied
   (llama.cpp's stb_image does neither);
2. "smart resize": each side rounded to a multiple of patch_size * merge, then, when the pixel count lies
   outside [min_pixels, max_pixels], both scaled keeping the aspect ratio (float32 arithmetic, as mtmd);
3. the picture scaled to fit that canvas keeping its aspect ratio (Pillow's bicubic, which mtmd reproduces
   bit for bit), pasted centred on black;
4. x / 255, then (x - mean) / std per channel in float32.

transformers' Qwen2-VL image processor differs in step 3 (it resizes straight to the canvas, distorting the
aspect ratio), so for a picture that needs resizing the two engines see different pixels; swarm follows
llama.cpp. Dimension letters: H, W the canvas in pixels; P patches; C = 3 * patch_size^2 values per patch.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from swarm.coordinator.vision.mmproj import DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS, VisionConfig
from swarm.sharding.errors import UserError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The most pixels a picture may declare: a 48-megapixel photo passes; a small file declaring a huge canvas
# (a decompression bomb) is refused before anything is decoded.
MAX_PICTURE_PIXELS = 1 << 26


class PictureError(UserError):
    """A picture that cannot be used; the message says why."""


@dataclass(frozen=True)
class Limits:
    """The canvas's pixel budget: min_pixels <= H * W <= max_pixels (llama.cpp's --image-min-tokens and
    --image-max-tokens, times the pixels of one merged token)."""

    min_pixels: int
    max_pixels: int


def limits(cfg: VisionConfig, min_tokens: int | None = None, max_tokens: int | None = None) -> Limits:
    """The budget mtmd uses: the user's token counts first, then the file's image_min/max_pixels, then
    llama.cpp's defaults for this projector (8 and 4096 tokens)."""
    area = (cfg.patch_size * cfg.merge) ** 2
    for name, value in (("min", min_tokens), ("max", max_tokens)):
        if value is not None and value < 1:
            raise UserError(f"--image-{name}-tokens must be at least 1 (got {value})")
    lo = min_tokens * area if min_tokens else cfg.min_pixels or DEFAULT_MIN_TOKENS * area
    hi = max_tokens * area if max_tokens else cfg.max_pixels or DEFAULT_MAX_TOKENS * area
    if lo > hi:
        if min_tokens and max_tokens:
            raise UserError(f"--image-min-tokens ({min_tokens}) is above --image-max-tokens ({max_tokens})")
        lo = hi  # a budget below the default minimum: the user's maximum holds
    return Limits(lo, hi)


@dataclass(frozen=True)
class Picture:
    """A preprocessed picture: `pixels` [3, H, W] float32 (normalised; llama.cpp's encoder input `inp_raw`),
    H and W multiples of patch_size * merge."""

    pixels: np.ndarray
    patch_size: int
    merge: int

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of patches."""
        return self.pixels.shape[1] // self.patch_size, self.pixels.shape[2] // self.patch_size

    @property
    def merged_grid(self) -> tuple[int, int]:
        """(rows, columns) of the encoder's output rows: one per merge x merge window."""
        gh, gw = self.grid
        return gh // self.merge, gw // self.merge

    @property
    def n_rows(self) -> int:
        """How many rows the encoder makes (how many <|image_pad|> tokens the picture takes)."""
        mh, mw = self.merged_grid
        return mh * mw

    def patches(self) -> np.ndarray:
        """[P, C] patch rows (channel, y, x within a patch) in window order: for each merged row r and column c
        in raster order, the merge x merge patches of that window in raster order, (2r, 2c), (2r, 2c+1),
        (2r+1, 2c), (2r+1, 2c+1) for merge 2 -- the order mtmd's graph and transformers' pixel_values have."""
        ps, m = self.patch_size, self.merge
        mh, mw = self.merged_grid
        x = self.pixels.reshape(3, mh, m, ps, mw, m, ps)  # [c, R, dy, y, Cc, dx, x]
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [R, Cc, dy, dx, c, y, x]
        return np.ascontiguousarray(x.reshape(mh * mw * m * m, 3 * ps * ps))


def decode(data: bytes, max_pixels: int = MAX_PICTURE_PIXELS) -> Image.Image:
    """The picture in `data` as an 8-bit RGB Pillow image, or a PictureError saying what is wrong."""
    if not data:
        raise PictureError("the picture is empty (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        w, h = img.size
        if w * h > max_pixels:
            raise PictureError(
                f"the picture declares {w} x {h} pixels, more than the {max_pixels:,} allowed (a "
                "decompression bomb, or a picture to scale down before sending)"
            )
        img.load()
    except PictureError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own limit, met before the size is known here
        raise PictureError(
            f"the picture declares more pixels than can be decoded safely (a decompression bomb?): {e}"
        ) from e
    except UnidentifiedImageError as e:
        raise PictureError(f"not a picture swarm can read: the bytes are none of {', '.join(FORMATS)}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # Pillow's ways of saying "damaged"
        raise PictureError(f"the picture is truncated or damaged and cannot be decoded ({e})") from e
    if img.mode.startswith("I;16"):  # 16-bit grey: its high byte, as stb_image (llama.cpp's decoder) keeps
        img = Image.fromarray((np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8), "L")
    return img if img.mode == "RGB" else img.convert("RGB")


def smart_size(width: int, height: int, align: int, lim: Limits) -> tuple[int, int]:
    """The canvas (W, H) mtmd picks (calc_size_preserved_ratio with a pixel budget): each side rounded to a
    multiple of `align`, then both scaled into the budget keeping the aspect ratio. The arithmetic is mtmd's,
    float32 throughout, so that the canvas is the same to the pixel."""
    f32 = np.float32

    def by(x: np.float32, rnd: str) -> int:
        q = float(f32(x) / f32(align))
        n = math.floor(q + 0.5) if rnd == "round" else math.floor(q) if rnd == "floor" else math.ceil(q)
        return int(n) * align

    h_bar = max(align, by(f32(height), "round"))
    w_bar = max(align, by(f32(width), "round"))
    if h_bar * w_bar > lim.max_pixels:
        beta = np.sqrt(f32(height * width) / f32(lim.max_pixels))
        h_bar = max(align, by(f32(height) / beta, "floor"))
        w_bar = max(align, by(f32(width) / beta, "floor"))
    elif h_bar * w_bar < lim.min_pixels:
        beta = np.sqrt(f32(lim.min_pixels) / f32(height * width))
        h_bar = by(f32(height) * beta, "ceil")
        w_bar = by(f32(width) * beta, "ceil")
    return w_bar, h_bar


def fit_on_canvas(img: Image.Image, width: int, height: int) -> Image.Image:
    """img scaled to fit (width, height) keeping its aspect ratio (Pillow bicubic) and centred on black: mtmd's
    resize with padding. A picture already of that size is kept as it is."""
    sw, sh = img.size
    if (sw, sh) == (width, height):
        return img
    f32 = np.float32
    scale = min(f32(width) / f32(sw), f32(height) / f32(sh))
    new_w = min(math.ceil(float(f32(sw) * scale)), width)
    new_h = min(math.ceil(float(f32(sh) * scale)), height)
    resized = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (width, height), (0, 0, 0))
    canvas.paste(resized, ((width - new_w) // 2, (height - new_h) // 2))
    return canvas


def normalise(rgb: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32: (x / 255 - mean) / std per channel, each step rounded to float32
    as mtmd's img_u8_to_f32 does."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def preprocess(
    data: bytes, cfg: VisionConfig, lim: Limits | None = None, max_picture_pixels: int = MAX_PICTURE_PIXELS
) -> Picture:
    """A picture's bytes -> the Picture the encoder reads (steps in the module docstring)."""
    return prepare(decode(data, max_picture_pixels), cfg, lim)


def prepare(img: Image.Image, cfg: VisionConfig, lim: Limits | None = None) -> Picture:
    """A decoded RGB picture -> the Picture the encoder reads (steps 2-4)."""
    lim = lim if lim is not None else limits(cfg)
    w, h = smart_size(img.size[0], img.size[1], cfg.patch_size * cfg.merge, lim)
    canvas = fit_on_canvas(img, w, h)
    pixels = normalise(np.asarray(canvas, dtype=np.uint8), cfg.image_mean, cfg.image_std)
    return Picture(pixels, cfg.patch_size, cfg.merge)
