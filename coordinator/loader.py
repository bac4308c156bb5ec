"""Build a model from a GGUF (or a `swarm shard` directory's dense.gguf): config, modules, dense weights.

Every non-expert tensor is dequantized to float32 and loaded by name: the GGUF name of a parameter
is its module path with the segments of "transparent" modules (class attribute GGUF_TRANSPARENT,
e.g. the block's `moe`) dropped. Loading is strict: a tensor the model needs and the file lacks, or
one the file has and the model does not use, is an error naming it. Expert tensors (`*_exps`) are
left to the expert backend; MTP blocks (`nextn_predict_layers`) are not part of the main pass.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, Keys
from gguf.gguf_reader import ReaderTensor
from torch import nn
from tqdm import tqdm

from swarm.coordinator.experts import ExpertBackend
from swarm.coordinator.models import get_arch
from swarm.coordinator.models.layers import DecoderModel, PackedEmbedding, n_main_layers
from swarm.node.dequant import dequantize
from swarm.sharding.gguf_io import (
    EXPERT_TENSOR_RE,
    GGUFError,
    architecture,
    open_gguf,
    read_metadata,
    torch_shape,
)

log = logging.getLogger(__name__)

DENSE_FILE = "dense.gguf"  # the non-expert half of a `swarm shard` directory
TOKEN_EMBD = "token_embd.weight"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_gguf(path: str | Path) -> Path:
    """A GGUF file as given, or DIR/dense.gguf for a shard directory."""
    path = Path(path)
    if path.is_dir():
        dense = path / DENSE_FILE
        if not dense.is_file():
            raise GGUFError(
                f"{path}: a directory without {DENSE_FILE}; give a GGUF file or a `swarm shard` output"
            )
        return dense
    return path


def load_model(
    path: str | Path,
    experts: ExpertBackend,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> tuple[DecoderModel, dict[str, Any]]:
    """(model on `device`, every metadata key of the file). device: cuda when present, else cpu.
    `progress`: a progress bar on stderr (when it is a terminal) while the dense weights load."""
    gguf_path = resolve_gguf(path)
    device = torch.device(device) if device is not None else default_device()
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    arch = get_arch(architecture(meta, gguf_path))
    try:
        cfg = arch.Config.from_metadata(meta)
    except GGUFError as e:
        raise GGUFError(f"{gguf_path}: {e}") from e
    refine = getattr(arch, "refine_config", None)  # layouts the metadata does not announce
    if refine is not None:
        cfg = refine(cfg, [t.name for t in reader.tensors])
    with torch.device(device):
        model = arch.Model(cfg, experts)
    load_dense_tensors(model, reader, meta, gguf_path, progress)
    model.eval()
    log.info("loaded %s (%s) on %s", gguf_path, meta[Keys.General.ARCHITECTURE], device)
    return model, meta


def gguf_names(model: nn.Module) -> dict[str, str]:
    """state_dict key -> GGUF tensor name, dropping the path segments of transparent modules."""
    transparent = {name for name, mod in model.named_modules() if getattr(mod, "GGUF_TRANSPARENT", False)}
    names: dict[str, str] = {}
    for key in model.state_dict():
        path, kept = "", []
        for seg in key.split("."):
            path = f"{path}.{seg}" if path else seg
            if path not in transparent:
                kept.append(seg)
        names[key] = ".".join(kept)
    assert len(set(names.values())) == len(names), "two parameters map to one GGUF name"
    return names


def main_pass_tensor(name: str, n_main: int) -> bool:
    """False for expert tensors (the backend's) and MTP tensors (blocks >= n_main, nextn.*)."""
    if EXPERT_TENSOR_RE.match(name) or name.startswith("nextn.") or ".nextn." in name:
        return False
    m = _BLOCK_RE.match(name)
    return m is None or int(m.group(1)) < n_main


def load_dense_tensors(
    model: nn.Module, reader: GGUFReader, meta: dict[str, Any], path: Path, progress: bool = False
) -> None:
    arch = meta[Keys.General.ARCHITECTURE]
    n_main = n_main_layers(meta, arch)
    file_tensors = {t.name: t for t in reader.tensors if main_pass_tensor(t.name, n_main)}
    skipped = len(reader.tensors) - len(file_tensors)
    names = gguf_names(model)
    wanted = set(names.values())

    # Tied embeddings: without an output matrix the head reuses token_embd, as llama.cpp does.
    aliases = {}
    if "output.weight" in wanted and "output.weight" not in file_tensors and TOKEN_EMBD in file_tensors:
        aliases["output.weight"] = TOKEN_EMBD
        log.info("%s: no output.weight; the output head reuses token_embd.weight", path)

    if pack_token_embd(model, file_tensors, aliases):  # loaded now: nothing to copy below
        names = {k: v for k, v in names.items() if v != TOKEN_EMBD}

    missing = sorted(n for n in wanted if n not in file_tensors and n not in aliases)
    if missing:
        raise GGUFError(
            f"{path}: tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more: {', '.join(missing[1:6])})" if len(missing) > 1 else "")
            + f"; the file does not hold a complete {arch} model, convert it again"
        )
    unexpected = sorted(n for n in file_tensors if n not in wanted)
    if unexpected:
        raise GGUFError(
            f"{path}: unexpected tensor {unexpected[0]}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f" that the {arch} model does not use; the file does not match its architecture"
        )

    state = model.state_dict(keep_vars=True)
    total = sum(int(file_tensors[aliases.get(n, n)].n_bytes) for n in names.values())
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="loading dense weights",
        file=sys.stderr,
        disable=None if progress else True,  # None: only on a terminal
        leave=False,
    )
    for key, name in names.items():
        t = file_tensors[aliases.get(name, name)]
        target = state[key]
        shape = torch_shape(t)
        if tuple(target.shape) != shape:
            # {D} and {D, 1} are the same vector; anything else is a different model.
            if _squeezed(tuple(target.shape)) != _squeezed(shape):
                raise GGUFError(
                    f"{path}: tensor {name} has shape {list(shape)}, the {arch} model built from the "
                    f"file's metadata expects {list(target.shape)}"
                )
        with torch.no_grad():
            dest = target.data
            if dest.device.type == "cpu" and dest.dtype == torch.float32 and dest.is_contiguous():
                # Decoded straight into the parameter: no float32 temporary as big as the tensor (2 GB for
                # the output head of a 248k vocabulary).
                dequantize(t.data, t.tensor_type, shape, out=dest)
            else:
                dest.copy_(dequantize(t.data, t.tensor_type, shape).reshape(dest.shape))
        bar.update(int(t.n_bytes))
    bar.close()
    log.debug("%s: loaded %d tensors, left %d to the experts/MTP", path, len(names), skipped)


def pack_token_embd(model: nn.Module, file_tensors: dict[str, ReaderTensor], aliases: dict[str, str]) -> bool:
    """Give the model a PackedEmbedding over the file's own token_embd rows when the table is not float32
    and the output head does not reuse it (a tied head needs the float32 matrix anyway)."""
    t = file_tensors.get(TOKEN_EMBD)
    embd = getattr(model, "token_embd", None)
    if t is None or t.tensor_type == GGMLQuantizationType.F32 or TOKEN_EMBD in aliases.values():
        return False
    if not isinstance(embd, nn.Embedding) or torch_shape(t) != tuple(embd.weight.shape):
        return False  # the shape check below names the mismatch
    n_vocab, n_embd = embd.weight.shape
    qtype = t.tensor_type

    def decode(rows: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        return dequantize(rows, qtype, shape)

    model.token_embd = PackedEmbedding(
        np.asarray(t.data).reshape(n_vocab, -1), n_embd, decode, embd.weight.device
    )
    return True


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)
