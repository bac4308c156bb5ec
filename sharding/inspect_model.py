"""`swarm inspect`: what a MoE GGUF (or a shard directory) is made of, at the expert grain.

The figures that decide how a model spreads over a swarm: how many bytes the dense path needs on the
coordinator, how many are experts, and how big one (layer, expert) slab is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gguf import Keys

from swarm.sharding.manifest import MANIFEST_NAME, read_manifest
from swarm.sharding.source import arch_int, load_source, slab_kind


@dataclass(frozen=True)
class ModelSurvey:
    path: str
    arch: str
    file_bytes: int
    n_layer: int
    moe_layers: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int
    expert_qtypes: dict[str, int]  # quant type -> number of expert tensors
    dense_qtypes: dict[str, int]  # quant type -> number of dense tensors
    expert_bytes: int
    dense_bytes: int  # dense tensors' bytes (the header and padding are neither)
    slab_bytes: tuple[int, ...]  # bytes of one (layer, expert) slab, per MoE layer
    n_slabs: int
    slab_kinds: tuple[str, ...]
    n_mtp: int = (
        -1
    )  # MTP (next-token prediction) blocks after the main ones; -1: not known (a shard directory)


def survey(path: str | Path) -> ModelSurvey:
    """Survey a GGUF file, or a shard directory (from its manifest, without reading the slabs)."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST_NAME).exists():
        return _survey_shard(path)
    src = load_source(path)
    names = {et.name for et in src.experts}
    per_layer: dict[int, int] = {}
    for et in src.experts:
        per_layer[et.layer] = per_layer.get(et.layer, 0) + et.slab_bytes
    expert_bytes = sum(et.slab_bytes * et.n_expert for et in src.experts)
    ff = arch_int(src, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    return ModelSurvey(
        path=str(path),
        arch=src.arch,
        file_bytes=src.size,
        n_layer=arch_int(src, Keys.LLM.BLOCK_COUNT),
        moe_layers=len(src.moe_layers),
        n_expert=src.n_expert,
        n_expert_used=arch_int(src, Keys.LLM.EXPERT_USED_COUNT),
        n_embd=arch_int(src, Keys.LLM.EMBEDDING_LENGTH),
        n_ff_exp=ff,
        expert_qtypes=dict(Counter(et.qtype.name for et in src.experts)),
        dense_qtypes=dict(Counter(t.tensor_type.name for t in src.reader.tensors if t.name not in names)),
        expert_bytes=expert_bytes,
        dense_bytes=sum(t.n_bytes for t in src.dense),
        slab_bytes=tuple(per_layer[layer] for layer in src.moe_layers),
        n_slabs=len(src.moe_layers) * src.n_expert,
        slab_kinds=tuple(sorted({slab_kind(et) for et in src.experts})),
        n_mtp=arch_int(src, Keys.LLM.NEXTN_PREDICT_LAYERS),
    )


def _survey_shard(directory: Path) -> ModelSurvey:
    m = read_manifest(directory)
    per_layer: dict[int, int] = {}
    for t in m.expert_tensors:
        per_layer[t.layer] = per_layer.get(t.layer, 0) + t.slab_bytes
    expert_bytes = sum(t.slab_bytes * t.shape[0] for t in m.expert_tensors)
    return ModelSurvey(
        path=f"{directory} (shards of {m.source.name}, {len(m.slabs)} slab files here)",
        arch=m.arch,
        file_bytes=m.source.size,
        n_layer=m.n_layer,
        moe_layers=len(m.moe_layers),
        n_expert=m.n_expert,
        n_expert_used=m.n_expert_used,
        n_embd=m.n_embd,
        n_ff_exp=m.n_ff_exp,
        expert_qtypes=dict(Counter(t.qtype for t in m.expert_tensors)),
        dense_qtypes={},
        expert_bytes=expert_bytes,
        dense_bytes=m.source.size - expert_bytes,
        slab_bytes=tuple(per_layer[layer] for layer in m.moe_layers),
        n_slabs=len(m.moe_layers) * m.n_expert,
        slab_kinds=tuple(sorted({t.kind for t in m.expert_tensors})),
    )


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def format_survey(s: ModelSurvey) -> str:
    def qt(d: dict[str, int]) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"

    sizes = sorted(set(s.slab_bytes))
    slab = human(sizes[0]) if len(sizes) == 1 else f"{human(sizes[0])} - {human(sizes[-1])} (varies by layer)"
    rows = [
        ("file", s.path),
        ("architecture", s.arch),
        ("layers", f"{s.n_layer} ({s.moe_layers} with experts)"),
        *(
            [("MTP blocks", f"{s.n_mtp} (drafts with --mtp N)" if s.n_mtp else "none (--mtp cannot draft)")]
            if s.n_mtp >= 0
            else []
        ),
        ("experts per layer", f"{s.n_expert}, top-{s.n_expert_used} used per token"),
        ("model width / expert width", f"{s.n_embd} / {s.n_ff_exp}"),
        ("expert tensors", f"{', '.join(s.slab_kinds)}"),
        ("expert quant types", qt(s.expert_qtypes)),
    ]
    if s.dense_qtypes:
        rows.append(("dense quant types", qt(s.dense_qtypes)))
    other = s.file_bytes - s.expert_bytes - s.dense_bytes
    rows += [
        ("file size", human(s.file_bytes)),
        ("experts", f"{human(s.expert_bytes)} ({100 * s.expert_bytes / s.file_bytes:.1f} % of the file)"),
        (
            "dense path" if s.dense_qtypes else "dense path + metadata",
            f"{human(s.dense_bytes)} ({100 * s.dense_bytes / s.file_bytes:.1f} % of the file)",
        ),
        *([("metadata (tokenizer, ...)", f"{human(other)}")] if s.dense_qtypes else []),
        ("bytes per (layer, expert) slab", slab),
        ("slabs", f"{s.n_slabs:,} ({s.moe_layers} layers x {s.n_expert} experts)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
