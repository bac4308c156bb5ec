"""One timed picture encoding with swarm's vision tower, in a process of its own (run by bench/vision.py).

    python bench/_vision_swarm.py MMPROJ PICTURE THREADS [--batched]   # load, prepare, encode once: JSON
    python bench/_vision_swarm.py --baseline THREADS   # the same imports, ggml's probes, a tiny attention
    python bench/_vision_swarm.py --attention GH GW THREADS [--4d]   # one block's attention, gh x gw patches

The JSON holds the encode's seconds (prepare excluded, as llama.cpp's "image slice encoded" excludes mtmd's
preprocessing), the rows and merged grid, whether every value is finite, the process's peak RSS (VmHWM) and
where the encode's time went: the ggml graphs (LayerNorm -> products -> GELU chains, the patch embedding), torch's
attention with its RoPE, and the rest (Python, position grid, copies).

--batched is a what-if, not swarm as it ships: swarm.compute.graph multiplies a matrix whose batched product
rounds differently from one row's (F16 under tinyBLAS on x86) one row at a time, so that a token's bits never
depend on its batch; this flag lets every product take ggml's batched kernels, to show what the vision tower
would gain from them (a picture is encoded whole, once, so batch-invariance buys it nothing).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from swarm.compute import graph as compute_graph
from swarm.compute.ggml import set_threads
from swarm.compute.probes import rows_independent
from swarm.coordinator.vision import encoder as vision_encoder
from swarm.coordinator.vision import load_vision
from swarm.coordinator.vision import native as vision_native
from swarm.proto.numerics import Numerics


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def timed(spent: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, adding its wall seconds to spent[key]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

    return wrapper


def chain_name(norm: Any, steps: Any, group: int) -> str:
    """Which of the tower's four ggml chains a native.chain call is (encoder.py's calls)."""
    if group > 1:
        return "merger"
    if len(steps) == 2:
        return "ln2+ffn"
    return "attn_out" if norm is None else "ln1+attn_qkv"


def encode_once(mmproj: Path, picture: Path, threads: int, batched: bool = False) -> dict[str, Any]:
    set_threads(threads)
    if batched:
        compute_graph.rows_independent = lambda qtype: True
    spent: dict[str, float] = {}
    # the encoder reaches these through module attributes, so wrapping them there times every call
    chain = vision_native.chain

    def named_chain(x: Any, norm: Any, steps: Any, group: int = 1, residual: Any = None) -> Any:
        return timed(spent, chain_name(norm, steps, group), chain)(x, norm, steps, group, residual)

    vision_native.chain = named_chain
    vision_native.pair = timed(spent, "patch_embd", vision_native.pair)
    vision_encoder.attention = timed(spent, "attention", vision_encoder.attention)
    t0 = time.perf_counter()
    vision = load_vision(mmproj, device="cpu", numerics=Numerics.NATIVE)
    load_s = time.perf_counter() - t0
    pic = vision.prepare(picture.read_bytes())
    t0 = time.perf_counter()
    enc = vision.encode_picture(pic)
    seconds = time.perf_counter() - t0
    spent["other"] = seconds - sum(spent.values())
    return {
        "seconds": seconds,
        "load_s": load_s,
        "rows": int(enc.rows.shape[0]),
        "grid": list(enc.grid),
        "finite": bool(torch.isfinite(enc.rows).all()),
        "rms": float(enc.rows.pow(2).mean().sqrt()),
        "peak_rss": vm_hwm(),
        "spent": spent,
    }


def attention_once(gh: int, gw: int, threads: int, three_d: bool) -> dict[str, Any]:
    """encoder.attention as it ships (4-D [1, H, P, hd] inputs to torch's scaled_dot_product_attention, which
    its CPU flash-attention kernel needs) or with the batch dimension taken off (3-D: the math backend), on a
    real tower width: seconds, the growth of peak RSS over the inputs (VmHWM reset through clear_refs) and
    torch's backend."""
    set_threads(threads)
    heads, dim, patches = 16, 1152, gh * gw
    qkv = torch.randn(patches, 3 * dim)
    cos, sin = vision_encoder.rope_tables(gh, gw, 2, dim // heads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if three_d:

        def unbatched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
            return sdpa(q[0], k[0], v[0], **kw)[None]

        torch.nn.functional.scaled_dot_product_attention = unbatched  # the encoder calls it through F
    q = qkv[:, :dim].reshape(patches, heads, -1).transpose(0, 1)
    backend = int(torch._fused_sdp_choice(*(q if three_d else q[None],) * 3))
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    before = vm_hwm()
    t0 = time.perf_counter()
    out = vision_encoder.attention(qkv, cos, sin, heads)
    seconds = time.perf_counter() - t0
    assert out.shape == (patches, dim)
    return {"seconds": seconds, "peak_growth": vm_hwm() - before, "backend": backend}


def main(argv: list[str]) -> None:
    if argv[0] == "--baseline":
        set_threads(int(argv[1]))
        # what an encode sets up besides the file: ggml loaded with its kernel probes, torch's first ops
        for qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0):
            rows_independent(int(qtype))
        q = torch.randn(1, 16, 64, 72)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        out: dict[str, Any] = {"peak_rss": vm_hwm()}
    elif argv[0] == "--attention":
        out = attention_once(int(argv[1]), int(argv[2]), int(argv[3]), "--3d" in argv[4:])
    else:
        out = encode_once(Path(argv[0]), Path(argv[1]), int(argv[2]), "--batched" in argv[3:])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
