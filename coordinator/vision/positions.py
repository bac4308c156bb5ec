"""M-RoPE positions of a prompt holding pictures (Qwen3-VL / Qwen3.5 / Qwen3.6; transformers' get_rope_index,
llama.cpp's image chunks with their n_pos).

Each token has three positions (t, h, w). A text token at position p has (p, p, p). A picture whose first
row comes at position p has, for the row of its merged grid at (row, column), (p, p + row, p + column); the
token after it is at p + max(rows, columns) (not p + rows * columns). Pure functions over counts: the text
model's rope reads the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# a run of text tokens (its length), or a picture's merged grid (rows, columns)
Segment = int | tuple[int, int]


def picture_positions(start: int, grid: tuple[int, int]) -> tuple[np.ndarray, int]:
    """([3, rows * columns] int64 positions of a picture's rows in raster order, the position of the token
    after it) for a picture whose first row is at position `start`."""
    rows, cols = grid
    if rows < 1 or cols < 1:
        raise ValueError(f"a picture of {rows} x {cols} rows")
    r = np.repeat(np.arange(rows, dtype=np.int64), cols)
    c = np.tile(np.arange(cols, dtype=np.int64), rows)
    pos = np.stack((np.full(rows * cols, start, dtype=np.int64), start + r, start + c))
    return pos, start + max(rows, cols)


def text_positions(start: int, n: int) -> tuple[np.ndarray, int]:
    """([3, n] positions of n text tokens from `start`, the position after them)."""
    p = np.arange(start, start + n, dtype=np.int64)
    return np.stack((p, p, p)), start + n


def mrope_positions(segments: Sequence[Segment], start: int = 0) -> tuple[np.ndarray, int]:
    """([3, T] positions of a token sequence given as segments in order, the position of the next token):
    an int is that many text tokens, a (rows, columns) pair a picture's rows."""
    parts: list[np.ndarray] = []
    p = start
    for seg in segments:
        if isinstance(seg, tuple):
            pos, p = picture_positions(p, seg)
        else:
            pos, p = text_positions(p, int(seg))
        parts.append(pos)
    if not parts:
        return np.zeros((3, 0), dtype=np.int64), p
    return np.concatenate(parts, axis=1), p


def segments_of(is_picture: Sequence[bool] | np.ndarray, grids: Sequence[tuple[int, int]]) -> list[Segment]:
    """The segments of a token sequence from its per-token picture mask (1 at each picture row, the pictures'
    rows back to back in the order of `grids`) and each picture's merged grid."""
    mask = [bool(b) for b in is_picture]
    out: list[Segment] = []
    i, k = 0, 0
    while i < len(mask):
        if mask[i]:
            if k >= len(grids):
                raise ValueError(f"picture rows at token {i} but only {len(grids)} pictures")
            rows, cols = grids[k]
            n = rows * cols
            if not all(mask[i : i + n]) or i + n > len(mask):
                raise ValueError(f"picture {k} needs {n} rows from token {i}")
            out.append((rows, cols))
            i, k = i + n, k + 1
        else:
            j = i
            while j < len(mask) and not mask[j]:
                j += 1
            out.append(j - i)
            i = j
    if k != len(grids):
        raise ValueError(f"{len(grids)} pictures but rows for {k}")
    return out
