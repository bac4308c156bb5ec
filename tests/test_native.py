"""The native numerics (every weight multiplied in its file type by ggml's kernels) against llama.cpp's own.

llama.cpp quantizes the activations inside its BF16/quantized matmuls, so on these files it sits about 8e-3
(mean KL) from exact math; the native numerics computes what it computes. The issue's criterion, on the
fixture GGUFs against the fixtures' llama.cpp logits (its default kernels): mean KL(llama.cpp || ours) <= 1e-4
over every prompt position, top-1 agreement >= 0.99. Those defaults also run tiled and tinyBLAS GEMMs, and
repacked GEMMs, for prompt batches, which sum in another order than the per-row kernels an engine must use to
keep each row independent of its batch; so on our own references, on 20 quant types, the comparison is with
llama.cpp fed one token per call (`llama_rowwise_*`: its per-row kernels, repacked weights' GEMV included),
which the native numerics should reproduce to rounding. Every figure is in docs/BENCHMARKS.md
(`bench/fidelity.py`).

References: the fixtures' `llama_<q>_*` (tests/fixtures/README.md) and our own llama.cpp references on
more quant types (tests/fixtures/llama-refs/README.md, made with llama-quantize and llama.cpp at the
fixtures' commit). Decode is checked with llama.cpp's greedy tokens fed back (teacher forcing), so both
engines see the same inputs at every step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from reference import as_f64, log_softmax

from swarm.compute.store import ExpertStore
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.loader import load_model
from swarm.coordinator.models.base import DecoderModel
from swarm.sharding.slabs import slabs_from_gguf

MAX_MEAN_KL = 1e-4  # the bound against llama.cpp's default kernels, on the prompt positions
MIN_TOP1 = 0.99
# Against llama.cpp's per-row kernels (fed one token per call: tests/fixtures/llama-refs/README.md) the matmuls,
# norms and the router's softmax are the same ggml ops on the same bits: most files agree to 1e-13 and every
# greedy token agrees. What is left are the float32 ops torch computes here and ggml there (attention,
# rope), whose last-bit differences the 8-bit rounding of the next matmul's activations amplifies in these
# small random models: measured up to 7e-6. Exact math instead of the native numerics sits near 8e-3 with
# top-1 about 0.9.
MAX_MEAN_KL_PER_ROW = 2e-4
MIN_TOP1_PER_ROW = 0.99
MIN_TOP1_PER_ROW_DECODE = 0.97
N_PROMPTS = 4
REFS = FIXTURES / "llama-refs"


def _variants() -> dict[str, tuple[Path, Path, str]]:
    """name -> (GGUF, reference npz, key prefix of llama.cpp's arrays in it)."""
    out = {
        "qwen35moe-tiny-bf16": (FIXTURES / "qwen35moe-tiny" / "model-bf16.gguf",
                                FIXTURES / "qwen35moe-tiny" / "reference.npz", "llama_bf16"),
        "qwen35moe-quant-q8_0": (FIXTURES / "qwen35moe-quant" / "model-q8_0.gguf",
                                 FIXTURES / "qwen35moe-quant" / "reference.npz", "llama_q8_0"),
        "qwen35moe-quant-q4_k_m": (FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf",
                                   FIXTURES / "qwen35moe-quant" / "reference.npz", "llama_q4_k_m"),
    }  # fmt: skip
    for p in sorted(REFS.glob("*.npz")):
        if not p.stem.startswith("fixture-"):
            out[p.stem] = (p.with_suffix(".gguf"), p, "llama")
    return out


def _per_row_variants() -> dict[str, tuple[Path, Path, str]]:
    out = {}
    for p in sorted(REFS.glob("*.npz")):
        with np.load(p) as z:
            if "llama_rowwise_logits_0" not in z:
                continue
            gguf = FIXTURES / str(z["gguf"]) if "gguf" in z else p.with_suffix(".gguf")
        out[p.stem] = (gguf, p, "llama_rowwise")
    return out


VARIANTS = _variants()
PER_ROW = _per_row_variants()
FIXTURE_VARIANTS = ["qwen35moe-tiny-bf16", "qwen35moe-quant-q8_0", "qwen35moe-quant-q4_k_m"]


def load_native(path: Path) -> DecoderModel:
    experts = LocalExperts(ExpertStore(slabs_from_gguf(path)), numerics="native")
    model, _ = load_model(path, experts, device="cpu", numerics="native")
    return model


def kl_rows(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(p_ref || p_ours) of every row, float64."""
    lp, lq = log_softmax(as_f64(ref)), log_softmax(as_f64(ours))
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def agreement(model: DecoderModel, ref: np.lib.npyio.NpzFile, prefix: str) -> dict[str, float]:
    """Prefill logits at every position, teacher-forced decode logits and our own greedy tokens, each
    against llama.cpp's: mean KL, top-1 agreement and how many of its 16 greedy tokens we reproduce."""
    kls, top1, dkls, dtop1, greedy_same, greedy_all = [], [], [], [], 0, 0
    for i in range(N_PROMPTS):
        prompt = ref[f"tokens_{i}"].tolist()
        want = ref[f"{prefix}_logits_{i}"]
        state = model.new_state()
        got = model.run(prompt, state).numpy()
        kls.append(kl_rows(want, got))
        top1.append(got.argmax(-1) == want.argmax(-1))
        # decode, fed llama.cpp's own greedy tokens: row j follows token j
        forced = ref[f"{prefix}_greedy_{i}"].tolist()
        rows = np.stack([model.run([t], state)[0].numpy() for t in forced])
        dwant = ref[f"{prefix}_greedy_logits_{i}"]
        dkls.append(kl_rows(dwant, rows))
        dtop1.append(rows.argmax(-1) == dwant.argmax(-1))
        # free-running greedy from the prompt
        state = model.new_state()
        last = model.run(prompt, state)[-1]
        ours = []
        for _ in forced:
            ours.append(int(last.argmax()))
            last = model.run([ours[-1]], state)[0]
        same = next((j for j, (a, b) in enumerate(zip(ours, forced, strict=True)) if a != b), len(forced))
        greedy_same += same
        greedy_all += len(forced)
    return {
        "prefill_kl": float(np.concatenate(kls).mean()),
        "prefill_top1": float(np.concatenate(top1).mean()),
        "decode_kl": float(np.concatenate(dkls).mean()),
        "decode_top1": float(np.concatenate(dtop1).mean()),
        "greedy_prefix": greedy_same,
        "greedy_total": greedy_all,
    }


@pytest.mark.parametrize("name", FIXTURE_VARIANTS)
def test_native_numerics_match_llama_cpp_on_the_fixtures(
    name: str, record_property: pytest.RecordProperty
) -> None:
    """The issue's criterion on every quantized and BF16 fixture GGUF, against the fixtures' llama.cpp
    logits (its default kernels, on the machine that made the fixtures): prompt mean KL <= 1e-4 and top-1
    >= 0.99 (q4_k_m: 6e-5 and 0.990 with ggml's repacked Q4_K kernels, the ones llama.cpp loads Q4_K into;
    1.9e-4 and 0.981 without them)."""
    gguf, npz, prefix = VARIANTS[name]
    a = agreement(load_native(gguf), np.load(npz), prefix)
    for k, v in a.items():
        record_property(k, v)
    assert a["prefill_kl"] <= MAX_MEAN_KL, f"{name}: prompt mean KL {a['prefill_kl']:.3g} ({a})"
    assert a["prefill_top1"] >= MIN_TOP1, f"{name}: prompt top-1 {a['prefill_top1']:.3f} ({a})"


@pytest.mark.parametrize("name", list(PER_ROW))
def test_native_numerics_equal_llama_cpp_per_row_kernels(
    name: str, record_property: pytest.RecordProperty
) -> None:
    """Every variant (20 quant types and models of our own making, and the fixtures) against llama.cpp fed
    one token per call (its per-row kernels): prompt logits, decode logits (its greedy tokens fed back), top-1."""
    gguf, npz, prefix = PER_ROW[name]
    a = agreement(load_native(gguf), np.load(npz), prefix)
    for k, v in a.items():
        record_property(k, v)
    assert a["prefill_kl"] <= MAX_MEAN_KL_PER_ROW, f"{name}: prompt mean KL {a['prefill_kl']:.3g} ({a})"
    assert a["decode_kl"] <= MAX_MEAN_KL_PER_ROW, f"{name}: decode mean KL {a['decode_kl']:.3g} ({a})"
    assert a["prefill_top1"] >= MIN_TOP1_PER_ROW, f"{name}: prompt top-1 ({a})"
    assert a["decode_top1"] >= MIN_TOP1_PER_ROW_DECODE, f"{name}: decode top-1 ({a})"


def test_native_differs_from_exact_on_quantized_weights() -> None:
    """The two numerics are really two: llama.cpp's kernels round the activations, exact math does not."""
    path = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
    ref = np.load(FIXTURES / "qwen35moe-quant" / "reference.npz")
    native = load_native(path)
    experts = LocalExperts(ExpertStore(slabs_from_gguf(path)), numerics="exact")
    exact, _ = load_model(path, experts, device="cpu", numerics="exact")
    prompt = ref["tokens_0"].tolist()
    a = native.run(prompt, native.new_state())
    b = exact.run(prompt, exact.new_state())
    assert float(kl_rows(b.numpy(), a.numpy()).mean()) > 10 * MAX_MEAN_KL
    deq = ref["llama_q4_k_m_deq_logits_0"]
    assert float(kl_rows(deq, b.numpy()).mean()) < 1e-8  # exact is llama.cpp on the dequantized weights
    assert torch.isfinite(a).all()
