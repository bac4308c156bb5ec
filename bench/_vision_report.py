"""The text of bench/vision.py's section beyond its tables of runs: the attention check's table, the goals'
verdicts, where swarm's time goes, and what would fix it (from the figures, and facts of the code)."""

from __future__ import annotations

from typing import Any

from _vision_figures import Case, MiB, activation_bytes, flops
from _vision_mmproj import QWEN36, TowerShape

SPEED_GOAL = 0.8
MEMORY_BOUND = 1.2


def attention_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = [
        "One block's attention alone (`encoder.attention`, 16 heads x 72, 2 threads, 3 runs each, alternating): "
        "as it ships, with 4-D [1, H, P, hd] inputs (torch's CPU flash-attention kernel), against the same call "
        "with the batch dimension taken off (3-D, for which torch's CPU `scaled_dot_product_attention` picks "
        "its math backend: the [H, P, P] scores materialised):",
        "",
        "| rows (patches) | inputs | torch backend | seconds | peak RSS growth MiB |",
        "| ---: | --- | --- | ---: | ---: |",
    ]
    names = {0: "math", 1: "flash attention"}
    for r in rows:
        out.append(
            f"| {r['tokens']} ({r['tokens'] * QWEN36.merge**2}) | {r['variant']} | {names.get(r['backend'], r['backend'])} "
            f"| {r['seconds']:.2f} | {r['peak_growth'] / MiB:.0f} |"
        )
    return out


def findings(
    cases: list[Case],
    shapes: dict[int, TowerShape],
    files: dict[tuple[str, int], int],
    baseline: dict[int, int],
) -> list[str]:
    """The goals' verdicts and, where swarm is slower, where its time goes (figures from `cases`)."""
    slow = [c for c in cases if c.speed() < SPEED_GOAL]
    measured = [c for c in cases if c.threads == 2]
    over = [
        c
        for c in measured
        if c.peak_rss() - baseline[2]
        > MEMORY_BOUND * files[(c.kind, c.blocks)] + activation_bytes(shapes[c.blocks], c.tokens)
    ]
    out = [
        f"**Speed goal (swarm >= {SPEED_GOAL}x llama.cpp's speed): "
        + (
            f"met in all {len(cases)} configurations.**"
            if not slow
            else f"NOT met in {len(slow)} of {len(cases)}"
            f" configurations ({'; '.join(c.label for c in slow)}).**"
        ),  # fmt: skip
        "",
        f"**Memory goal (encoder <= {MEMORY_BOUND}x file + activations): "
        + (
            f"met in all {len(measured)} configurations.**"
            if not over
            else f"NOT met in {len(over)} of {len(measured)} ({'; '.join(c.label for c in over)}).**"
        ),
    ]
    f16 = [c for c in cases if c.batched]
    if f16:
        chains = ("patch_embd", "ln1+attn_qkv", "attn_out", "ln2+ffn", "merger")
        lines = []
        for c in f16:
            work = flops(shapes[c.blocks], c.tokens)
            plain, batched = c.parts(), c.parts(True)
            gflop = sum(work[k] for k in chains) / 1e9
            share = sum(plain[k] for k in chains) / c.swarm_s()
            lines.append(
                f"{c.label}: the ggml products take {share:.0%} of the encode at {gflop / sum(plain[k] for k in chains):.1f}"
                f" GFLOP/s, batched {gflop / sum(batched[k] for k in chains):.1f} GFLOP/s; attention "
                f"{plain['attention']:.2f} s ({share_of(plain, 'attention', c.swarm_s())}), Python and the rest "
                f"{plain['other']:.2f} s ({share_of(plain, 'other', c.swarm_s())})"
            )
        out += ["", "Where the F16 encode's time goes: " + "; ".join(lines) + "."]
    out += ["", *CAUSE, "", *ATTENTION]
    return out


def share_of(parts: dict[str, float], key: str, total: float) -> str:
    return f"{parts[key] / total:.0%}"


# Why the F16 products are slow and what would fix it: facts of the code (swarm.compute.graph, probes), which the
# what-if runs measure; the verdict lines above come from the figures.
CAUSE = [
    "The tower's products are batched (`coordinator/vision/native.py`: all of a picture's patches in one "
    "`ggml_mul_mat`, the kernels llama.cpp's encoder runs: tinyBLAS for F16 on this build). Row by row "
    "(`Graph.mul_mat`, which keeps the text model's rule that a row's result never depends on the other rows "
    "of its matmul), F16 ran at 5-10 GFLOP/s and the tower at 0.37-0.47x llama.cpp's speed (the run before "
    "this change, in git history). A picture is always encoded whole and on its own, so its rows do not depend "
    "on what is read beside it. The what-if column (`--batched`: every product of the process batched) now "
    "runs the same kernels as the plain one.",
]


ATTENTION = [
    "Attention (`encoder.attention`) gives torch 4-D inputs, so that its CPU `scaled_dot_product_attention` "
    "takes the flash kernel; with 3-D inputs it took the math backend and held every [H, P, P] score (the "
    "attention table above measures the two). Memory: at the real depth (27 blocks, 260 rows) the encoder stays "
    "within 1.2x its file plus activations; the 2-block towers are over: their files are small, and what the "
    "estimate leaves out (ggml's per-thread graph buffers, kept at the largest graph's size; the MLP chain's "
    "intermediates beyond the estimate's two [P, F] tensors) weighs more beside them. 27 blocks at 1,024 rows "
    "was not measured (about five minutes a run for each engine here).",
]
