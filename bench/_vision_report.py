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
        "as it ships, with 3-D [H, P, hd] inputs, for which torch's CPU `scaled_dot_product_attention` picks "
        "its math backend (the [H, P, P] scores materialised), against the same call with a batch dimension "
        "added (4-D, torch's CPU flash-attention kernel):",
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


def memory_after_flash(
    cases: list[Case],
    shapes: dict[int, TowerShape],
    files: dict[tuple[str, int], int],
    baseline: dict[int, int],
    attention: list[dict[str, Any]],
) -> list[str]:
    """The encoder's peak less what the attention table says the flash kernel would save, against the bound."""
    saved = {}
    for r in attention:
        saved[r["tokens"]] = saved.get(r["tokens"], 0) + (
            r["peak_growth"] if r["variant"] == "3-D" else -r["peak_growth"]
        )
    rows = []
    for c in cases:
        if c.threads != 2 or c.tokens not in saved:
            continue
        bound = MEMORY_BOUND * files[(c.kind, c.blocks)] + activation_bytes(shapes[c.blocks], c.tokens)
        after = c.peak_rss() - baseline[2] - saved[c.tokens]
        rows.append(
            f"{c.label} {after / MiB:.0f} MiB against {bound / MiB:.0f} ({'met' if after <= bound else 'over'})"
        )
    if not rows:
        return []
    return [
        "",
        "With attention's peak growth at the flash kernel's instead (the attention table's difference taken off "
        "each peak): " + "; ".join(rows) + ". What stays above the bound is not explained here; ggml's graph "
        "buffers (kept per thread at the largest graph's size) and the MLP chain's intermediates beyond the "
        "estimate's two [P, F] tensors are the next suspects.",
    ]


def both_fixes(cases: list[Case], attention: list[dict[str, Any]]) -> list[str]:
    """An estimate of swarm's speed with both fixes: the batched what-if's time (or the plain time where the
    products are batched already) with its attention part scaled by the attention table's flash / math ratio."""
    ratio = {}
    for tokens in {r["tokens"] for r in attention}:
        by = {r["variant"]: r["seconds"] for r in attention if r["tokens"] == tokens}
        ratio[tokens] = by["4-D"] / by["3-D"]
    rows = []
    for c in cases:
        if c.tokens not in ratio or c.threads != 2:
            continue
        batched = bool(c.batched) or c.kind != "f16"
        if not batched:
            continue
        seconds = c.swarm_s(bool(c.batched))
        est = seconds - c.parts(bool(c.batched))["attention"] * (1 - ratio[c.tokens])
        rows.append(f"{c.label} {est:.1f} s, {c.llama_s() / est:.2f}x llama.cpp")
    if not rows:
        return []
    return [
        "",
        "Both fixes together, estimated (batched products as measured -- Q8_0 plain, F16 from the what-if -- with "
        "attention's time scaled by the attention table's flash / math ratio at that size): "
        + "; ".join(rows)
        + ". Q8_0 keeps its row-by-row F16 ffn_down in these figures.",
    ]


def share_of(parts: dict[str, float], key: str, total: float) -> str:
    return f"{parts[key] / total:.0%}"


# Why the F16 products are slow and what would fix it: facts of the code (swarm.compute.graph, probes), which the
# what-if runs measure; the verdict lines above come from the figures.
CAUSE = [
    "Cause: `swarm.compute.graph.Graph.mul_mat` multiplies a matrix whose batched product rounds differently "
    "from one row's one row at a time: DESIGN.md's rule that a row's result never depends on the other rows in "
    "its matmul. On this x86 build that is F16: ggml's batched F16 product goes through llamafile's tinyBLAS, "
    "whose sums differ from the one-row kernel's (`swarm.compute.probes.rows_independent(F16)` is False; Q8_0 "
    "is True, so a Q8_0 tower's products are batched already, but for ffn_down, which the converter leaves F16 "
    "in a Q8_0 file since its 4304-wide rows are not whole Q8_0 blocks: hence `ln2+ffn`'s lower GFLOP/s there). "
    "Every F16 product of the tower is thus one "
    "matrix-vector product per patch row, each reading the whole matrix from memory, where llama.cpp's clip "
    "graph makes one batched ggml_mul_mat.",
    "",
    "Fix (described, not made: coordinator/vision is not this bench's): let the vision tower's graphs "
    "(`coordinator/vision/native.py`, `chain` and `pair`) multiply the whole batch with `ggml_mul_mat` instead "
    "of `Graph.mul_mat`'s row-by-row path. The what-if column is exactly that change (`bench/_vision_swarm.py "
    "--batched`: every product of the process takes the batched kernels). It would be an exception to the "
    "row-independence rule, defensible for pictures only: a picture is always encoded whole, so the same "
    "picture gives the same rows, and the batched kernel is the one llama.cpp's encoder uses (its rounding of "
    "these products). Keeping the rule instead needs a batched F16 kernel that sums each row in the one-row "
    "kernel's order (a compute/ change), or F16 matrices widened to F32 at load if F32's batched product keeps "
    "rows (twice the memory; probe first).",
]


ATTENTION = [
    "Attention and memory: `coordinator/vision/encoder.attention` hands torch 3-D [H, P, hd] tensors, and "
    "torch's CPU `scaled_dot_product_attention` takes its flash-attention kernel only for 4-D inputs, so it "
    "runs the math backend, which holds the [H, P, P] scores and their softmax (16 x P^2 x 4 bytes each: 66 MiB "
    "at 260 rows, 1 GiB at 1,024, 16 GiB at 4,096) -- the comment there says the opposite. That is what puts "
    "most of the encoder's peak above its file plus activations (the attention table's peak growth), and a "
    "picture at the default maximum of 4,096 rows would need twice 16 GiB for it. Fix (described): add a batch dimension "
    "(`q[None]`, `k[None]`, `v[None]`, then `[0]`), so that torch takes its flash kernel (O(P) memory); the "
    "attention table measures that change on its own.",
]
