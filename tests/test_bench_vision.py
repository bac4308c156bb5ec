"""bench/vision.py's own logic: the random mmproj it writes (types as llama.cpp's converter gives them, readable
by swarm's loader), the picture sizes that encode to an exact row count, and the parsing of llama-mtmd-cli's
log."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _vision_figures import Case, picture_size, speed_table  # noqa: E402
from _vision_llama import parse_log  # noqa: E402
from _vision_mmproj import QWEN36, TowerShape, file_bytes, write_mmproj  # noqa: E402

from swarm.coordinator.vision import load_vision  # noqa: E402
from swarm.proto.numerics import Numerics  # noqa: E402

# ffn_down's rows (n_ff = 80) are not whole Q8_0 blocks, as the real tower's 4304 are not
TINY = TowerShape(n_layer=2, n_embd=64, n_ff=80, n_head=4, patch=16, merge=2, pos_side=4, n_out=32)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_random_mmproj_has_the_converters_types_and_loads(tmp_path: Path, kind: str) -> None:
    path = write_mmproj(tmp_path / f"m-{kind}.gguf", kind, TINY)
    reader = GGUFReader(path)
    types = {t.name: GGMLQuantizationType(int(t.tensor_type)) for t in reader.tensors}
    assert sum(int(t.n_bytes) for t in reader.tensors) == file_bytes(TINY, kind)
    matrix = GGMLQuantizationType.F16 if kind == "f16" else GGMLQuantizationType.Q8_0
    assert types["v.blk.1.attn_qkv.weight"] == types["mm.2.weight"] == matrix
    assert types["v.blk.0.ffn_down.weight"] == GGMLQuantizationType.F16  # the converter's fallback
    assert types["v.patch_embd.weight"] == (
        GGMLQuantizationType.F16 if kind == "f16" else GGMLQuantizationType.F32
    )
    assert types["v.position_embd.weight"] == types["v.blk.0.ln1.bias"] == GGMLQuantizationType.F32

    vision = load_vision(path, text_width=TINY.n_out, device="cpu", numerics=Numerics.NATIVE)
    w, h = picture_size(12, QWEN36)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    enc = vision.encode(buf.getvalue())
    assert enc.rows.shape == (12, TINY.n_out) and enc.grid == (3, 4)
    assert bool(enc.rows.isfinite().all())
    # deterministic: written again, the file is the same bytes
    again = write_mmproj(tmp_path / f"again-{kind}.gguf", kind, TINY)
    assert again.read_bytes() == path.read_bytes()


def test_picture_sizes_encode_to_exactly_that_many_rows(tmp_path: Path) -> None:
    assert picture_size(260, QWEN36) == (640, 416)  # 20 x 13 windows of 32 pixels
    assert picture_size(1024, QWEN36) == (1024, 1024)
    vision = load_vision(write_mmproj(tmp_path / "m.gguf", "f16", TINY), device="cpu")
    for tokens in (260, 1024, 8, 4096, 17):
        w, h = picture_size(tokens, QWEN36)
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (90, 120, 150)).save(buf, "PNG")
        assert vision.prepare(buf.getvalue()).n_rows == tokens
    with pytest.raises(ValueError, match="budget"):
        picture_size(7, QWEN36)  # below the 8 rows a picture gets at least: it would be scaled up


def test_llama_log_gives_the_encode_time_and_grid() -> None:
    log = [
        "0.01.55 D image_tokens->nx = 20\n",
        "0.01.55 D image_tokens->ny = 13\n",
        "0.02.53 I encoding mtmd batch, n_chunks = 1\n",
    ]
    assert parse_log(log) is None  # not encoded yet
    done = parse_log([*log, "0.08.33 I mtmd batch encoding done in 5806 ms\n"])
    assert done is not None and done.seconds == pytest.approx(5.806)
    assert done.rows == 260 and done.grid == (13, 20)
    slice_done = parse_log([*log, "I image slice encoded in 120 ms\n"])
    assert slice_done is not None and slice_done.seconds == pytest.approx(0.12)
    with pytest.raises(RuntimeError, match="grid"):
        parse_log(["I mtmd batch encoding done in 5 ms\n"])


def test_speed_goal_is_judged_on_medians() -> None:
    case = Case("f16", 260, 2, 2, load=[1.0, 2.0, 1.5])
    case.llama = [10.0, 11.0, 30.0]  # median 11
    case.swarm = [{"seconds": s} for s in (13.0, 14.0, 90.0)]  # median 14: 11 / 14 = 0.79
    (row,) = speed_table([case], 0.8)[2:]
    assert "0.79x" in row and "NOT met" in row
    case.swarm[1]["seconds"] = 13.5  # 11 / 13.5 = 0.81
    assert "| met |" in speed_table([case], 0.8)[2]
