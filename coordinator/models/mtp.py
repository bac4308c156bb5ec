"""The MTP (multi-token prediction, "NextN") head of qwen35moe / qwen3next files: one more full-attention MoE
block after the main ones (blk.L with L = the main pass's block count), which reads a token and the trunk's
hidden row of the position before it and predicts the token after it. It drafts tokens for a checking window.

What it computes for token x at position p with hidden row h (h as the trunk leaves it, after output_norm):
    x0 = nextn.eh_proj @ [rmsnorm(embed(x)) * nextn.enorm, rmsnorm(h) * nextn.hnorm]   (the embedding first)
    x2 = the block (gated attention over the head's own KV cache, then the routed MoE) on x0
    h_mtp = rmsnorm(x2) * nextn.shared_head_norm;  logits = head @ h_mtp
`embed` is nextn.embed_tokens where the file has one, else the trunk's token_embd; shared_head_norm and
`head` (nextn.shared_head_head) fall back to the trunk's output_norm and output the same way. The block's
routed experts are layer L's slabs, computed by the same expert backend as the trunk's.

Dimension letters: N rows of all sequences in a call, M rows whose output is wanted, D model width, V vocabulary.
Module names follow the GGUF tensors under blk.L (the block's and the MoE's segments are transparent).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models.attention import KVCache
from swarm.coordinator.models.base import Batch, PackedEmbedding
from swarm.coordinator.models.hybrid import Block, HybridConfig
from swarm.coordinator.models.linear import Linear, RMSNorm, project
from swarm.coordinator.models.moe import MoE

Embedding = nn.Embedding | PackedEmbedding


class TrunkParts(NamedTuple):
    """What the head shares with the trunk where the file gives it none of its own (a tuple, so that these
    modules are not registered twice)."""

    embed: Embedding  # token_embd
    norm: RMSNorm  # output_norm
    output: Linear  # output


class NextN(nn.Module):
    """blk.L.nextn.*: the projection of [embedding, hidden] into the block, its two norms, and the optional
    head of its own (norm, matrix; the embedding table is the loader's, like token_embd)."""

    def __init__(self, cfg: HybridConfig, own_norm: bool, own_head: bool) -> None:
        super().__init__()
        d = cfg.n_embd
        self.eh_proj = Linear(2 * d, d)
        self.enorm = RMSNorm(d, cfg.eps)
        self.hnorm = RMSNorm(d, cfg.eps)
        self.shared_head_norm = RMSNorm(d, cfg.eps) if own_norm else None
        self.shared_head_head = Linear(d, cfg.n_vocab) if own_head else None
        self.embed_tokens: Embedding | None = None  # the loader's PackedEmbedding where the file has one


class MTPBlock(Block):
    """The ordinary full-attention MoE block, its tensors directly under blk.L."""

    GGUF_TRANSPARENT: ClassVar[bool] = True


class MTPHead(nn.Module):
    """The head: NextN's front, the block, the shared head. forward() runs one pass over several sequences'
    rows (attention per sequence against its own cache, one expert fan-out for the rows whose output is
    wanted)."""

    def __init__(
        self,
        cfg: HybridConfig,
        experts: ExpertBackend,
        trunk: TrunkParts,
        own_norm: bool = False,
        own_head: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = cfg.n_layer  # the first block after the main pass
        self.nextn = NextN(cfg, own_norm, own_head)
        attention_only = replace(cfg, recurrent=(*cfg.recurrent, False))  # the MTP block is full attention
        self.block = MTPBlock(attention_only, self.layer, experts)
        self.trunk = trunk
        # Each half of [embedding, hidden] normed on its own: a plain RMSNorm per group of D in the projection's
        # graph, then times [enorm, hnorm] (llama.cpp's rms_norm then mul, the same ops).
        self.eh_norm = _Unit(cfg.n_embd, cfg.eps)
        self.register_buffer("eh_scale", torch.ones(2 * cfg.n_embd), persistent=False)

    def bind(self) -> None:
        """Take the loaded enorm / hnorm weights into the projection's gate (after loading)."""
        with torch.no_grad():
            self.eh_scale.copy_(torch.cat([self.nextn.enorm.weight, self.nextn.hnorm.weight]))

    def set_experts(self, experts: ExpertBackend) -> None:
        """Swap the block's expert backend (in process <-> swarm), as DecoderModel.set_experts does."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.experts = experts

    def warm_up(self) -> None:
        """One row through every expert of the MTP layer (DecoderModel.warm_up does the trunk's), so that their
        weights are paged in, and every node has answered for them, before the first draft."""
        moe = self.block.moe
        kept = moe.cfg
        moe.cfg = replace(kept, n_expert_used=kept.n_expert)
        one = torch.zeros(1, dtype=torch.long)
        try:
            with torch.inference_mode():
                h = torch.zeros(1, self.cfg.n_embd, device=self.eh_scale.device)
                self(one, h, Batch((1,), (0,), one.to(h.device)), [KVCache()], one)
        finally:
            moe.cfg = kept

    def new_state(self) -> MTPState:
        return MTPState(KVCache(), torch.zeros(self.cfg.n_embd, device=self.eh_scale.device))

    def forward(
        self, tokens: torch.Tensor, h: torch.Tensor, batch: Batch, caches: list[KVCache], rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N] with h [N, D] (each the trunk's or the head's hidden row of the position before), laid
        out as `batch` (sequence i's rows at its positions, appended to caches[i]) -> (h_mtp [M, D], logits
        [M, V]) of `rows` [M] only: the other rows just fill the caches, so their MoE is never computed."""
        d = self.cfg.n_embd
        embed = self.nextn.embed_tokens if self.nextn.embed_tokens is not None else self.trunk.embed
        device = self.eh_scale.device
        pair = torch.cat([embed(tokens.to(device)), h.to(device, torch.float32)], dim=1)  # [N, 2D]
        gate = self.eh_scale.expand(pair.shape[0], 2 * d)
        x0 = project(pair, self.nextn.eh_proj, norm=self.eh_norm, gate=gate)[0]  # [N, D]
        blk = self.block
        x1 = blk.mixer(x0, blk.attn_norm, batch, caches)  # x0 + attention [N, D]
        if rows.shape[0] == 0:  # rows that only fill the caches
            return x1.new_empty(0, self.cfg.n_embd), x1.new_empty(0, self.cfg.n_vocab)
        if rows.shape[0] != x1.shape[0]:
            x1 = x1.index_select(0, rows.to(device))  # [M, D]
        x2 = blk.moe(x1, blk.post_attention_norm)  # [M, D]: one fan-out for every sequence's rows
        nextn = self.nextn
        norm = nextn.shared_head_norm if nextn.shared_head_norm is not None else self.trunk.norm
        head = nextn.shared_head_head if nextn.shared_head_head is not None else self.trunk.output
        h_mtp, logits = project(x2, head, norm=norm, normed=True)
        return h_mtp.float(), logits.float()


class _Unit(RMSNorm):
    """A plain RMSNorm (weight ones, no tensor of the file)."""

    def __init__(self, dim: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim), persistent=False)


class HeadCheckpoint(NamedTuple):
    """An MTPState as it was: its cache's length and the trunk's hidden row the next row pairs with."""

    length: int
    pending_h: torch.Tensor  # [D]


@dataclass
class MTPState:
    """One sequence's MTP state: the head's own KV cache (rows (x_p, h_{p-1}) of the committed positions) and
    the trunk's hidden row of the last committed position, which the next row pairs with (zeros at first:
    position 0 has no row before it)."""

    kv: KVCache
    pending_h: torch.Tensor  # [D]

    @property
    def length(self) -> int:
        """Positions the cache holds = the position of the next committed row."""
        return self.kv.length

    def checkpoint(self) -> HeadCheckpoint:
        return HeadCheckpoint(
            self.kv.checkpoint(), self.pending_h
        )  # (pending_h is replaced, never written in place)

    def restore(self, cp: HeadCheckpoint) -> None:
        self.pending_h = cp.pending_h
        self.kv.restore(cp.length)
