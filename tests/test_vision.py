"""The vision tower of a Qwen3.5 / Qwen3.6 mmproj (coordinator/vision) against llama.cpp's mtmd and transformers on
the tiny fixture in tests/fixtures/qwen35moe-vision: preprocessing to llama.cpp's encoder input, the encoder's
rows within the floors between the two engines, the M-RoPE positions, and the pictures and files refused."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from PIL import Image

from swarm.coordinator.models.linear import GGMLMatrix, Linear, TorchMatrix
from swarm.coordinator.vision.load import Vision, load_vision
from swarm.coordinator.vision.mmproj import open_mmproj
from swarm.coordinator.vision.positions import mrope_positions, picture_positions, segments_of
from swarm.coordinator.vision.preprocess import PictureError, limits, preprocess, smart_size
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import GGUFError, tensor_to_numpy
from swarm.sharding.ggufwrite import copy_kvs

FIX = Path(__file__).parent / "fixtures" / "qwen35moe-vision"
MMPROJ = FIX / "mmproj-f32.gguf"
TEXT_MODEL = Path(__file__).parent / "fixtures" / "qwen35moe-tiny" / "model-f32.gguf"
PICTURES = {"A": "image_A_96x96.png", "B": "image_B_160x64.png", "C": "image_C_100x70.png"}
# the fixture's floors (its README, "Tolerances"): llama.cpp's fp16-table GELU puts its rows ~1.9e-3 from any
# other implementation; transformers' own float32 rounding is 2.5e-6
TOL_LLAMA = 5e-3
TOL_HF = 1e-4


@pytest.fixture(scope="module")
def ref() -> Any:
    return np.load(FIX / "reference.npz")


@pytest.fixture(scope="module")
def native() -> Vision:
    return load_vision(MMPROJ, text_width=128, device="cpu", numerics=Numerics.NATIVE)


@pytest.fixture(scope="module")
def exact() -> Vision:
    return load_vision(MMPROJ, text_width=128, device="cpu", numerics=Numerics.EXACT)


def picture(name: str) -> bytes:
    return (FIX / PICTURES[name]).read_bytes()


def test_preprocessed_pixels_equal_llamacpp_encoder_input(native: Vision, ref: Any) -> None:
    # A and B need no resize; C (100x70) is scaled to 128x90 keeping its aspect ratio and padded to 128x96
    for name, grid in (("A", (6, 6)), ("B", (4, 10)), ("C", (6, 8))):
        pic = native.prepare(picture(name))
        assert pic.grid == grid
        assert pic.pixels.dtype == np.float32
        np.testing.assert_array_equal(pic.pixels, ref[f"llama_inp_raw_{name}"])


def test_patch_rows_come_in_window_order(native: Vision, ref: Any) -> None:
    # transformers' pixel_values: 2x2 windows in raster order, each row C x T x 16 x 16 (T = 2, the still
    # frame twice); non-square grids, so that rows and columns mixed up show
    for name, key in (("B", "hf_pixel_values_1"), ("C", "hf_llstyle_pixel_values_3")):
        rows = native.prepare(picture(name)).patches()
        doubled = np.repeat(rows.reshape(len(rows), 3, 1, 256), 2, axis=2).reshape(len(rows), -1)
        np.testing.assert_array_equal(doubled, ref[key])


def test_smart_resize_keeps_to_the_token_budget(native: Vision) -> None:
    cfg = native.config
    assert smart_size(100, 70, 32, limits(cfg)) == (128, 96)
    assert smart_size(96, 96, 32, limits(cfg, min_tokens=64)) == (256, 256)  # scaled up into the budget
    assert smart_size(96, 96, 32, limits(cfg, max_tokens=4)) == (64, 64)  # and down
    w, h = smart_size(4000, 3000, 32, limits(cfg))
    assert w * h <= 4096 * 1024 and w % 32 == 0 and h % 32 == 0
    assert preprocess(picture("A"), cfg, limits(cfg, min_tokens=64)).n_rows == 64
    assert preprocess(picture("A"), cfg, limits(cfg, max_tokens=4)).n_rows == 4
    with pytest.raises(UserError, match="above"):
        limits(cfg, min_tokens=100, max_tokens=10)


def test_the_files_pixel_budget_counts_unless_the_user_gives_one(tmp_path: Path) -> None:
    budget = rewrite(MMPROJ, tmp_path / "budget.gguf", add={"clip.vision.image_min_pixels": 64 * 1024})
    vision = load_vision(budget, text_width=128, device="cpu")
    assert vision.prepare(picture("A")).n_rows == 64
    vision = load_vision(budget, text_width=128, device="cpu", min_tokens=8)
    assert vision.prepare(picture("A")).n_rows == 9


def test_native_rows_match_llamacpp(native: Vision, ref: Any) -> None:
    for name, i, grid in (("A", 0, (3, 3)), ("B", 1, (2, 5)), ("C", 3, (3, 4))):
        enc = native.encode(picture(name))
        assert enc.grid == grid and enc.rows.shape == (grid[0] * grid[1], 128)
        diff = np.abs(enc.rows.numpy() - ref[f"llama_image_embd_{i}"]).max()
        assert diff <= TOL_LLAMA, (name, diff)


def test_exact_rows_match_transformers(exact: Vision, native: Vision, ref: Any) -> None:
    for name, key in (("A", "hf_image_embd_0"), ("B", "hf_image_embd_1"), ("C", "hf_llstyle_image_embd_3")):
        rows = exact.encode(picture(name)).rows.numpy()
        diff = np.abs(rows - ref[key]).max()
        assert diff <= TOL_HF, (name, diff)
        # the native numerics are llama.cpp's (its fp16-table GELU), not transformers' float32
        assert np.abs(native.encode(picture(name)).rows.numpy() - rows).max() > 10 * TOL_HF


def test_torch_path_of_a_gpu_keeps_to_the_same_floors(ref: Any) -> None:
    # on a GPU the matrices are torch's (float16 for the native numerics, float32 for exact) and the tower
    # runs in torch: the same path on the CPU here
    for numerics, dtype, key, tol in (
        (Numerics.EXACT, torch.float32, "hf_image_embd_1", TOL_HF),
        (Numerics.NATIVE, torch.float16, "llama_image_embd_1", 2 * TOL_LLAMA),
    ):
        vision = load_vision(MMPROJ, text_width=128, device="cpu", numerics=numerics)
        for lin in vision.encoder.modules():
            if isinstance(lin, Linear):
                assert lin.matrix is not None
                lin.matrix = TorchMatrix(lin.matrix.dense().to(dtype))
        rows = vision.encode(picture("B")).rows.numpy()
        assert np.abs(rows - ref[key]).max() <= tol, numerics


@pytest.mark.parametrize(
    ("qtype", "scale"),
    [(GGMLQuantizationType.F16, 2), (GGMLQuantizationType.BF16, 8), (GGMLQuantizationType.Q8_0, 20)],
)
def test_a_mmproj_is_multiplied_in_its_stored_type(
    tmp_path: Path, exact: Vision, ref: Any, qtype: GGMLQuantizationType, scale: int
) -> None:
    stored = rewrite(MMPROJ, tmp_path / f"mmproj-{qtype.name}.gguf", qtype=qtype)
    vision = load_vision(stored, text_width=128, device="cpu", numerics=Numerics.NATIVE)
    matrices = [m for m in vision.encoder.modules() if isinstance(m, Linear)]
    assert len(matrices) == 2 + 4 * 3 + 2
    stored_types = []
    for lin in matrices:
        assert isinstance(lin.matrix, GGMLMatrix)
        stored_types.append(GGMLQuantizationType(lin.matrix.weight.qtype))  # as stored: never a float32 copy
    # (Q8_0: the patch embedding's 16-wide conv rows are not whole blocks and stay F16, as the converter does)
    assert set(stored_types) <= {qtype, GGMLQuantizationType.F16}
    assert stored_types.count(qtype) >= len(matrices) - 2
    rows = vision.encode(picture("B")).rows.numpy()
    # the stored type moves the rows by about its rounding (F16 2^-11 relative; BF16 2^-8; Q8_0 a step of
    # 1/127 of its block's largest value, and its products' activations rounded to 8-bit blocks too, as
    # llama.cpp's kernels do), within a multiple of the llama.cpp floor's scale
    assert np.abs(rows - ref["llama_image_embd_1"]).max() <= scale * TOL_LLAMA
    exact_too = load_vision(stored, text_width=128, device="cpu", numerics=Numerics.EXACT)
    assert np.abs(exact_too.encode(picture("B")).rows.numpy() - rows).max() <= scale * TOL_LLAMA


def test_positions_equal_the_fixtures(ref: Any) -> None:
    for i in range(4):
        grids = [(int(h) // 2, int(w) // 2) for _, h, w in ref[f"hf_image_grid_thw_{i}"]]
        segments = segments_of(ref[f"is_image_{i}"], grids)
        hf = ref[f"hf_positions_{i}"]  # the prompt, then 8 greedy tokens
        pos, _ = mrope_positions([*segments, 8])
        np.testing.assert_array_equal(pos, hf)
        np.testing.assert_array_equal(pos[:, : len(ref[f"tokens_{i}"])], ref[f"llama_positions_{i}"][:3])
    pos, after = picture_positions(5, (2, 3))
    assert pos.tolist() == [[5] * 6, [5, 5, 5, 6, 6, 6], [5, 6, 7, 5, 6, 7]] and after == 8


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGB pixels and holds almost none: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_bad_pictures_are_refused_with_the_reason(native: Vision) -> None:
    cases = [
        (b"", "empty"),
        (b"this is not a picture at all", "not a picture"),
        (picture("A")[: len(picture("A")) * 2 // 3], "truncated"),
        (png_header_only(100_000, 100_000), "pixels"),
    ]
    for data, words in cases:
        with pytest.raises(UserError, match=words):
            native.prepare(data)
    with pytest.raises(PictureError, match="96 x 96 pixels"):
        preprocess(picture("A"), native.config, max_picture_pixels=1000)


def test_jpeg_webp_and_other_modes_are_read(native: Vision) -> None:
    rgba = Image.open(io.BytesIO(picture("B"))).convert("RGBA")
    grey16 = Image.fromarray((np.asarray(rgba.convert("L"), dtype=np.uint16) * 257).astype(np.uint16))
    for fmt, img in (
        ("PNG", grey16),
        ("JPEG", rgba.convert("RGB")),
        ("WEBP", rgba),
        ("PNG", rgba),
        ("PNG", rgba.convert("L")),
    ):
        buf = io.BytesIO()
        img.save(buf, format=fmt, quality=95) if fmt != "PNG" else img.save(buf, format=fmt)
        enc = native.encode(buf.getvalue())
        assert enc.grid == (2, 5) and bool(np.isfinite(enc.rows.numpy()).all())
    # 16-bit grey reads as its high byte (Pillow's own conversion would clip it to white)
    grey = [io.BytesIO(), io.BytesIO()]
    grey16.save(grey[0], format="PNG")
    rgba.convert("L").save(grey[1], format="PNG")
    np.testing.assert_array_equal(*(native.prepare(b.getvalue()).pixels for b in grey))
    # a lossless RGBA picture: the alpha channel is dropped, the colours read as they are
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    np.testing.assert_array_equal(native.prepare(buf.getvalue()).pixels, native.prepare(picture("B")).pixels)


def test_files_that_are_not_this_projector_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not a vision projector"):
        open_mmproj(TEXT_MODEL)
    with pytest.raises(GGUFError, match="rows of 128 values .* have 64"):
        load_vision(MMPROJ, text_width=64, device="cpu")
    other = rewrite(MMPROJ, tmp_path / "gemma.gguf", {"clip.projector_type": b"gemma3"})
    with pytest.raises(GGUFError, match="'gemma3' is not one swarm reads"):
        open_mmproj(other)
    wide = rewrite(MMPROJ, tmp_path / "wide.gguf", {"clip.vision.projection_dim": 256})
    with pytest.raises(GGUFError, match="rows of 256 values"):
        open_mmproj(wide, text_width=128)
    deep = rewrite(MMPROJ, tmp_path / "deep.gguf", {"clip.vision.is_deepstack_layers": [True, False, False]})
    with pytest.raises(GGUFError, match="deepstack"):
        open_mmproj(deep)


def rewrite(
    src: Path,
    dst: Path,
    changes: dict[str, Any] | None = None,
    qtype: GGMLQuantizationType | None = None,
    add: dict[str, int] | None = None,
) -> Path:
    """A copy of a GGUF with some metadata values replaced, `add`ed as uint32 and, with `qtype`, its matrices
    stored in that type."""
    changes = changes or {}
    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), "clip")
    writer.kv_data[0].clear()  # the keys come from the source, in its order
    for kv in copy_kvs(reader):
        writer.add_key_value(kv.key, changes.get(kv.key, kv.value), kv.vtype, kv.sub_type)
    for key, value in (add or {}).items():
        writer.add_uint32(key, value)
    for t in reader.tensors:
        values = tensor_to_numpy(t)
        if qtype is None or values.ndim < 2:
            writer.add_tensor(t.name, values)
        elif qtype == GGMLQuantizationType.Q8_0 and values.shape[-1] % 32:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            data = quants.quantize(np.ascontiguousarray(values, np.float32), qtype)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
