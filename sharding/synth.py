"""Random-weight GGUFs with the exact layout llama.cpp's converter gives the Qwen MoE families.

`swarm synth` lets tests, benchmarks, demos and users try a swarm without downloading 20 GB: the file has the
tensor names, shapes, ggml types and metadata keys of a real qwen35moe / qwen3next / qwen2moe / qwen3moe GGUF
(copied from the reference fixtures, which llama.cpp's own converter produced), a small byte-level BPE
tokenizer and the Qwen3.5 chat template, and random weights scaled so a forward pass stays finite and routing
is not uniform. The text such a model writes is meaningless; the machinery that runs it is real.

    spec = preset("qwen3.6-35b-a3b", n_layers=4, experts_type="Q4_K")  # swarm.sharding.synth_spec
    synthesize("model.gguf", spec)  # -> Path

This module writes the file: its metadata and tokenizer, then the tensors. What it holds comes from
swarm.sharding.synth_spec (the layout), synth_plan (the tensors) and synth_values (their bytes).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGUFValueType, GGUFWriter, Keys, LlamaFileType, TokenType
from gguf.utility import size_label

from swarm.sharding.errors import UserError
from swarm.sharding.synth_data import CORPUS, QWEN35_CHAT_TEMPLATE
from swarm.sharding.synth_plan import PlannedTensor, tensor_plan
from swarm.sharding.synth_spec import SPECIAL_TOKENS, SynthSpec
from swarm.sharding.synth_values import tensor_chunks

logger = logging.getLogger(__name__)

# gguf.Keys has no constant for this one; llama.cpp reads it for the hybrid archs.
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"

# general.file_type follows the experts' type, which holds most of the bytes (as llama-quantize's presets do).
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS,
    "IQ1_M": LlamaFileType.MOSTLY_IQ1_M,
}

PROGRESS_MIN_BYTES = 256 << 20


# --- writing ---------------------------------------------------------------------------------------------


def synthesize(path: str | Path, spec: SynthSpec, progress: bool = False) -> Path:
    """Write the random-weight GGUF `spec` describes to `path` (atomically: temp file, then rename).

    Deterministic for a given spec (seed included). Memory stays flat: tensors are generated and written
    a chunk at a time. With `progress`, a bytes bar goes to stderr for outputs over 256 MiB.
    """
    path = Path(path)
    plan = tensor_plan(spec)
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory; create it first")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total = sum(t.n_bytes for t in plan)
    free = shutil.disk_usage(path.parent).free
    if total > free:
        raise UserError(
            f"{path}: needs {total / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB are free there; "
            "use fewer --layers or --experts, a smaller --experts-type, or another disk"
        )
    logger.info("writing %s: %s, %d tensors, %.1f MiB", path, spec.arch, len(plan), total / 2**20)
    try:
        w = GGUFWriter(tmp, spec.arch)
        _write_metadata(w, spec, plan)
        for t in plan:
            # Byte shape + raw type: the writer converts it to the ggml shape for quantized types.
            w.add_tensor_info(
                t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_data(w, plan, spec.seed, progress and total >= PROGRESS_MIN_BYTES)
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{path}: cannot write ({e.strerror or e}); check the path and free disk space"
        ) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --- metadata --------------------------------------------------------------------------------------------


def _size_label(spec: SynthSpec, plan: list[PlannedTensor]) -> str:
    """general.size_label as the converter computes it: "{E}x{params of the shared part + one expert}"."""
    shared = sum(t.n_elements for t in plan if "_exps." not in t.name)
    per_expert = sum(t.n_elements // t.shape[-1] for t in plan if "_exps." in t.name)
    return size_label(shared + per_expert * spec.n_expert, shared, per_expert, spec.n_expert)


def _write_metadata(w: GGUFWriter, spec: SynthSpec, plan: list[PlannedTensor]) -> None:
    """The converter's keys, in its order, with its value types (checked against the fixtures' GGUFs)."""
    arch = spec.arch
    LLM, Att, Rope, SSM, Tok = Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM, Keys.Tokenizer

    def k(key: str) -> str:
        return key.format(arch=arch)

    w.add_string(Keys.General.TYPE, "model")
    w.add_string(Keys.General.NAME, spec.name)
    w.add_string(Keys.General.SIZE_LABEL, _size_label(spec, plan))
    w.add_uint32(k(LLM.BLOCK_COUNT), spec.n_blocks)
    w.add_uint32(k(LLM.CONTEXT_LENGTH), spec.context_length)
    w.add_uint32(k(LLM.EMBEDDING_LENGTH), spec.n_embd)
    if arch != "qwen35moe":
        w.add_uint32(k(LLM.FEED_FORWARD_LENGTH), spec.ff or spec.expert_ff * spec.n_expert_used)
    w.add_uint32(k(Att.HEAD_COUNT), spec.n_head)
    w.add_uint32(k(Att.HEAD_COUNT_KV), spec.n_head_kv)
    if arch == "qwen35moe":
        w.add_key_value(
            k(Rope.DIMENSION_SECTIONS), list(spec.sections), GGUFValueType.ARRAY, GGUFValueType.INT32
        )
    w.add_float32(k(Rope.FREQ_BASE), spec.rope_base)
    w.add_float32(k(Att.LAYERNORM_RMS_EPS), spec.rms_eps)
    w.add_uint32(k(LLM.EXPERT_COUNT), spec.n_expert)
    w.add_uint32(k(LLM.EXPERT_USED_COUNT), spec.n_expert_used)
    if arch != "qwen2moe":
        w.add_uint32(k(Att.KEY_LENGTH), spec.head_dim)
        w.add_uint32(k(Att.VALUE_LENGTH), spec.head_dim)
    w.add_uint32(Keys.General.FILE_TYPE, int(FILE_TYPES[spec.experts_type]))
    w.add_uint32(k(LLM.EXPERT_FEED_FORWARD_LENGTH), spec.expert_ff)
    if arch != "qwen3moe":
        w.add_uint32(k(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), spec.shared_ff)
    if spec.mtp:
        w.add_uint32(k(LLM.NEXTN_PREDICT_LAYERS), spec.mtp)
    if spec.hybrid:
        w.add_uint32(k(SSM.CONV_KERNEL), spec.conv_kernel)
        w.add_uint32(k(SSM.STATE_SIZE), spec.ssm_head_dim)
        w.add_uint32(k(SSM.GROUP_COUNT), spec.ssm_k_heads)
        w.add_uint32(k(SSM.TIME_STEP_RANK), spec.ssm_v_heads)
        w.add_uint32(k(SSM.INNER_SIZE), spec.ssm_v_heads * spec.ssm_head_dim)
        recurrent = [spec.recurrent(i) for i in range(spec.n_blocks)]
        w.add_key_value(k(RECURRENT_LAYERS_KEY), recurrent, GGUFValueType.ARRAY, GGUFValueType.BOOL)
        w.add_uint32(k(LLM.FULL_ATTENTION_INTERVAL), spec.full_attention_interval)
        w.add_uint32(k(Rope.DIMENSION_COUNT), spec.n_rot)
    w.add_uint32(Keys.General.QUANTIZATION_VERSION, 2)

    vocab = build_vocab(spec.n_vocab)
    w.add_string(Tok.MODEL, "gpt2")
    w.add_string(Tok.PRE, "qwen35" if arch == "qwen35moe" else "qwen2")
    w.add_key_value(Tok.LIST, vocab.tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value(Tok.TOKEN_TYPE, vocab.token_types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value(Tok.MERGES, vocab.merges, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_uint32(Tok.EOS_ID, vocab.eos_id)
    w.add_uint32(Tok.PAD_ID, vocab.pad_id)
    w.add_bool(Tok.ADD_BOS, False)
    w.add_bool(Tok.ADD_EOS, False)
    w.add_string(Tok.CHAT_TEMPLATE, QWEN35_CHAT_TEMPLATE)


# --- tokenizer -------------------------------------------------------------------------------------------


class Vocab(NamedTuple):
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int


@functools.lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> Vocab:
    """A byte-level BPE trained deterministically on CORPUS, then specials, then [PAD<i>] up to n_vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    n_bpe = n_vocab - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))), "BPE ids are not dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [int(TokenType.NORMAL)] * len(tokens)
    first_special = len(tokens)
    for text, kind in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(int(kind))
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return Vocab(tokens, types, merges, eos_id=first_special + 2, pad_id=first_special)


# --- tensor data -----------------------------------------------------------------------------------------


def _write_data(w: GGUFWriter, plan: list[PlannedTensor], seed: int, progress: bool) -> None:
    from tqdm import tqdm

    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    bar = tqdm(
        total=sum(t.n_bytes for t in plan), unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
    )
    with bar:
        for t in plan:
            # Same layout as GGUFWriter.write_tensor_data, a chunk at a time: align, data, pad to alignment.
            w.write_padding(fout, fout.tell())
            written = 0
            for chunk in tensor_chunks(t, seed):
                chunk.tofile(fout)
                written += chunk.nbytes
                bar.update(chunk.nbytes)
            assert written == t.n_bytes, (t.name, written, t.n_bytes)
            w.write_padding(fout, written)
