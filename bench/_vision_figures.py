"""The arithmetic of bench/vision.py: picture sizes for a row count, the tower's work and live activations per
picture, and the section's tables."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from _vision_mmproj import TowerShape

MiB = 1 << 20
# llama.cpp's default token budget for qwen3vl_merger (clip.cpp), which swarm's preprocessing takes too
MIN_TOKENS, MAX_TOKENS = 8, 4096
PARTS = ("patch_embd", "ln1+attn_qkv", "attention", "attn_out", "ln2+ffn", "merger", "other")


def picture_size(tokens: int, shape: TowerShape) -> tuple[int, int]:
    """(width, height) in pixels of a picture that encodes to exactly `tokens` rows with no resize: the most
    nearly square merged grid rows x columns = tokens (columns >= rows), each side a multiple of patch * merge,
    which the smart resize of both engines keeps as it is (inside their default budget of 8..4096 rows)."""
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"{tokens} rows lie outside the default budget {MIN_TOKENS}..{MAX_TOKENS}: resized")
    rows = max(r for r in range(1, int(tokens**0.5) + 1) if tokens % r == 0)
    side = shape.patch * shape.merge
    return tokens // rows * side, rows * side


def flops(shape: TowerShape, tokens: int) -> dict[str, float]:
    """Multiply-adds x 2 of one picture per part of the tower (attention: q k^T and the weighted sum of v)."""
    p = tokens * shape.merge**2  # patches
    d, f, layers = shape.n_embd, shape.n_ff, shape.n_layer
    wide = d * shape.merge**2
    return {
        "patch_embd": 2.0 * 2 * p * 3 * shape.patch**2 * d,
        "ln1+attn_qkv": 2.0 * layers * p * d * 3 * d,
        "attention": 2.0 * layers * 2 * p * p * d,
        "attn_out": 2.0 * layers * p * d * d,
        "ln2+ffn": 2.0 * layers * 2 * p * d * f,
        "merger": 2.0 * tokens * (wide * wide + wide * shape.n_out),
    }


def activation_bytes(shape: TowerShape, tokens: int) -> int:
    """The most bytes of activations alive at once while swarm encodes one picture, counted from the code
    (coordinator/vision): the picture's pixels and patch rows (float32, 2 x P x 3 patch^2), plus the wider of
    the block's two steps -- the MLP chain (the residual stream in, its copy for the graph and the result,
    3 x P x D float32; ffn_up's output and its GELU, 2 x P x F float32; the F16 copies of the product inputs,
    P x (D + F) x 2 bytes) or attention (x, qkv, the rotated q and k with their temporaries, the contiguous
    copies torch's attention takes and its output: 12 x P x D float32)."""
    p = tokens * shape.merge**2
    d, f = shape.n_embd, shape.n_ff
    picture = 2 * p * 3 * shape.patch**2 * 4
    mlp = 3 * p * d * 4 + 2 * p * f * 4 + p * (d + f) * 2
    attention = 12 * p * d * 4
    return picture + max(mlp, attention)


@dataclass
class Case:
    """One configuration: a file type, a row count, a thread count, and what both engines measured there."""

    kind: str
    tokens: int
    threads: int
    blocks: int
    what_if: bool = False  # also run swarm with batched products (bench/_vision_swarm.py --batched)
    swarm: list[dict[str, Any]] = field(default_factory=list)
    batched: list[dict[str, Any]] = field(default_factory=list)
    llama: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average before each run pair

    @property
    def label(self) -> str:
        return f"{self.kind.upper()}, {self.blocks} blocks, {self.tokens} rows, {self.threads}t"

    def swarm_s(self, batched: bool = False) -> float:
        return statistics.median(r["seconds"] for r in (self.batched if batched else self.swarm))

    def llama_s(self) -> float:
        return statistics.median(self.llama)

    def speed(self, batched: bool = False) -> float:
        """swarm's speed as a fraction of llama.cpp's (llama seconds / swarm seconds)."""
        return self.llama_s() / self.swarm_s(batched)

    def parts(self, batched: bool = False) -> dict[str, float]:
        runs = self.batched if batched else self.swarm
        return {k: statistics.median(r["spent"].get(k, 0.0) for r in runs) for k in PARTS}

    def peak_rss(self) -> int:
        return int(statistics.median(r["peak_rss"] for r in self.swarm))


def speed_table(cases: list[Case], goal: float) -> list[str]:
    out = [
        "| mmproj | rows (both) | threads | runs | load avg | llama.cpp s | swarm s | swarm speed / llama.cpp | "
        f">= {goal}x | what-if: batched products, s (speed) |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for c in cases:
        load = f"{min(c.load):.1f}-{max(c.load):.1f}"
        what_if = f"{c.swarm_s(True):.2f} ({c.speed(True):.2f}x)" if c.batched else "-"
        out.append(
            f"| {c.kind.upper()}, {c.blocks} blocks | {c.tokens} | {c.threads} | {len(c.llama)} | {load} | "
            f"{c.llama_s():.2f} | {c.swarm_s():.2f} | {c.speed():.2f}x | "
            f"{'met' if c.speed() >= goal else 'NOT met'} | {what_if} |"
        )
    return out


def parts_table(cases: list[Case], shapes: dict[int, TowerShape]) -> list[str]:
    """Where swarm's encode goes, part by part (median seconds and GFLOP/s), beside llama.cpp's whole encode."""
    out = [
        "| mmproj, rows, threads | " + " | ".join(PARTS) + " | swarm total | llama.cpp total |",
        "| --- |" + " ---: |" * (len(PARTS) + 2),
    ]
    for c in cases:
        work = flops(shapes[c.blocks], c.tokens)
        total = sum(work.values()) / 1e9
        for batched in (False, True) if c.batched else (False,):
            parts = c.parts(batched)
            cells = []
            for k in PARTS:
                rate = f" ({work[k] / parts[k] / 1e9:.0f})" if k in work and parts[k] > 0 else ""
                cells.append(f"{parts[k]:.2f}{rate}")
            name = f"{c.kind.upper()}, {c.blocks} blocks, {c.tokens}, {c.threads}t" + (
                ", batched" if batched else ""
            )
            swarm_s = c.swarm_s(batched)
            out.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {swarm_s:.2f} ({total / swarm_s:.0f}) | {c.llama_s():.2f} ({total / c.llama_s():.0f}) |"
            )
    return out


def memory_table(cases: list[Case], shapes: dict[int, TowerShape], files: dict[tuple[str, int], int],
                 baseline: dict[int, int], bound: float) -> list[str]:  # fmt: skip
    out = [
        f"| mmproj | rows | file MiB | activations MiB (est.) | peak RSS MiB | baseline MiB | encoder MiB | "
        f"bound {bound}x file + act. MiB | met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in cases:
        if c.threads != 2:
            continue
        file = files[(c.kind, c.blocks)]
        act = activation_bytes(shapes[c.blocks], c.tokens)
        used = c.peak_rss() - baseline[c.threads]
        limit = bound * file + act
        out.append(
            f"| {c.kind.upper()}, {c.blocks} blocks | {c.tokens} | {file / MiB:.0f} | {act / MiB:.0f} | "
            f"{c.peak_rss() / MiB:.0f} | {baseline[c.threads] / MiB:.0f} | {used / MiB:.0f} | {limit / MiB:.0f} | "
            f"{'met' if used <= limit else 'NOT met'} |"
        )
    return out
