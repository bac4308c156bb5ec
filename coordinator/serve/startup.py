"""What `swarm serve` does with the model before the first request: warm up the passes the scheduler will
run (every batch size's graphs, the largest prompt pass's memory), and size one slot's state for the memory
check.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.coordinator.serve.scheduler import CHUNK, PASS_PROMPT_TOKENS_ALONE

# The prompts of warm_prompts' pass at most: where its prompt tokens fill several prompts' passes, the
# memory of several at once is laid out (warmed with a few long prompts, a pass of many short ones still
# faults its pages in; warmed with many short ones, a pass of a few long ones does not).
WARM_PROMPTS = 8


def warm_batches(model: Any, n: int, device: torch.device) -> None:
    """One decode step of b new sequences for each b from 1 to n, thrown away: every batch size's graphs are
    built now, at start, rather than in the first step that meets it (which then takes several times its
    time). A real step of b sequences finds them whatever its sequences hold. Steps of more sequences than
    swarm.compute.graph.KEEP_ROWS build their graphs every time: not warmed."""
    from swarm.compute.graph import KEEP_ROWS

    with torch.inference_mode():
        for b in range(1, min(n, KEEP_ROWS) + 1):
            ids = torch.zeros(b, dtype=torch.long, device=device)
            model(ids, [model.new_state() for _ in range(b)], [1] * b, last_only=True)


def warm_prompts(model: Any, n: int, device: torch.device) -> None:
    """One pass reading the most prompt tokens a pass takes (PASS_PROMPT_TOKENS_ALONE, over up to n new
    prompts of at most CHUNK tokens each), thrown away: the memory of the largest pass is then mapped, and
    with swarm.compute.malloc's policy kept, so the first burst of prompts finds it instead of faulting tens
    of thousands of pages in. Run it on the thread that will run the passes: ggml's graph allocator buffer
    is that thread's."""
    k = max(1, min(n, WARM_PROMPTS))
    each = min(CHUNK, PASS_PROMPT_TOKENS_ALONE // k)
    with torch.inference_mode():
        ids = torch.zeros(k * each, dtype=torch.long, device=device)
        model(ids, [model.new_state() for _ in range(k)], [each] * k, last_only=True)


def slot_bytes(model: Any, ctx_size: int, state_copies: int) -> int:
    """Memory one slot's sequence state takes at `ctx_size` tokens: the attention layers' keys and values
    (float32) and the linear-attention layers' conv and recurrent states, those `state_copies` times (the
    live state, its prefix checkpoints, the checker's anchor)."""
    from swarm.coordinator.models.deltanet import GatedDeltaNet

    kv = recurrent = 0
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            c = m.cfg
            recurrent += 4 * (c.conv_dim * (c.conv_kernel - 1) + c.n_v_heads * c.d_state * c.d_state)
        elif hasattr(m, "attn_k") and hasattr(m, "attn_v"):
            kv += 4 * ctx_size * (m.attn_k.d_out + m.attn_v.d_out)
    return kv + state_copies * recurrent
