"""Build a model from a GGUF (or a `swarm shard` directory's dense.gguf): config, modules, dense weights.

Every non-expert tensor is loaded by name: the GGUF name of a parameter is its module path with the
segments of "transparent" modules (class attribute GGUF_TRANSPARENT, e.g. the block's `moe`) dropped.
Matrices (every Linear: projections, shared expert, router, output head) stay as the file stores them:
on the CPU ggml multiplies them in place in the memory map (native numerics), or as float32 copies
dequantized exactly (exact numerics); on a GPU they are copied there as float16/bfloat16 (native) or
float32 (exact). `token_embd` stays in the memory map, rows decoded per lookup. The small rest (norms,
biases, convolution and decay vectors) is dequantized into float32 parameters. Loading is strict: a tensor the model needs and the file lacks, or
one the file has and the model does not use, is an error naming it. Expert tensors (`*_exps`) are
left to the expert backend; MTP blocks (`nextn_predict_layers`) are not part of the main pass: the first of
them loads on request as a head of its own (`load_mtp_head`), the same way.
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

from swarm.compute import pages, weights
from swarm.compute.dequant import dequantize
from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models import get_arch
from swarm.coordinator.models.base import DecoderModel, PackedEmbedding
from swarm.coordinator.models.gguf_meta import n_main_layers
from swarm.coordinator.models.hybrid import HybridConfig
from swarm.coordinator.models.linear import GGMLMatrix, Linear, Matrix, TorchMatrix
from swarm.coordinator.models.mtp import MTPHead, TrunkParts
from swarm.proto.numerics import Numerics
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
MTP_EMBED = "nextn.embed_tokens.weight"  # an MTP block's own embedding table, where the file has one


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
    numerics: Numerics = Numerics.NATIVE,
) -> tuple[DecoderModel, dict[str, Any]]:
    """(model on `device`, every metadata key of the file). device: cuda when present, else cpu.
    `progress`: a progress bar on stderr (when it is a terminal) while the dense weights load.
    `numerics`: native (matrices multiplied in their file types) or exact (float32)."""
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
    load_dense_tensors(model, reader, meta, gguf_path, progress, numerics)
    for mod in model.modules():  # layers that compute some steps as llama.cpp does in native numerics
        if hasattr(mod, "native_steps"):
            mod.native_steps = numerics == Numerics.NATIVE
    model.eval()
    log.info("loaded %s (%s) on %s", gguf_path, meta[Keys.General.ARCHITECTURE], device)
    return model, meta


def _gguf_name(key: str, transparent: set[str]) -> str:
    path, kept = "", []
    for seg in key.split("."):
        path = f"{path}.{seg}" if path else seg
        if path not in transparent:
            kept.append(seg)
    return ".".join(kept)


def gguf_names(model: nn.Module) -> dict[str, str]:
    """state_dict key -> GGUF tensor name, dropping the path segments of transparent modules (token_embd,
    which the loader maps, aside)."""
    transparent = {name for name, mod in model.named_modules() if getattr(mod, "GGUF_TRANSPARENT", False)}
    names = {key: _gguf_name(key, transparent) for key in model.state_dict() if key != TOKEN_EMBD}
    assert len(set(names.values())) == len(names), "two parameters map to one GGUF name"
    return names


def linear_names(model: nn.Module) -> dict[str, Linear]:
    """GGUF tensor name of each Linear's matrix ("<path>.weight") -> the Linear."""
    transparent = {name for name, mod in model.named_modules() if getattr(mod, "GGUF_TRANSPARENT", False)}
    return {
        _gguf_name(name + ".weight", transparent): mod
        for name, mod in model.named_modules()
        if isinstance(mod, Linear)
    }


def make_matrix(t: ReaderTensor, shape: tuple[int, int], device: torch.device, numerics: Numerics) -> Matrix:
    """A Linear's matrix [out, in] from a file tensor, in the form `numerics` multiplies on `device`."""
    if device.type == "cpu":
        return GGMLMatrix(weights.stored_weight(t.data, t.tensor_type, shape, numerics, t.name))
    w = dequantize(t.data, t.tensor_type, shape)
    if numerics == Numerics.NATIVE:  # compact on the GPU: the file's own bf16, else f16
        w = w.to(torch.bfloat16 if t.tensor_type == GGMLQuantizationType.BF16 else torch.float16)
    return TorchMatrix(w.to(device))


def main_pass_tensor(name: str, n_main: int) -> bool:
    """False for expert tensors (the backend's) and MTP tensors (blocks >= n_main, nextn.*)."""
    if EXPERT_TENSOR_RE.match(name) or name.startswith("nextn.") or ".nextn." in name:
        return False
    m = _BLOCK_RE.match(name)
    return m is None or int(m.group(1)) < n_main


def load_dense_tensors(
    model: nn.Module,
    reader: GGUFReader,
    meta: dict[str, Any],
    path: Path,
    progress: bool = False,
    numerics: Numerics = Numerics.NATIVE,
) -> None:
    arch = meta[Keys.General.ARCHITECTURE]
    n_main = n_main_layers(meta, arch)
    file_tensors = {t.name: t for t in reader.tensors if main_pass_tensor(t.name, n_main)}
    skipped = len(reader.tensors) - len(file_tensors)
    names = gguf_names(model)
    linears = linear_names(model)
    wanted = set(names.values()) | set(linears) | {TOKEN_EMBD}

    # Tied embeddings: without an output matrix the head reuses token_embd, as llama.cpp does.
    aliases = {}
    if "output.weight" in wanted and "output.weight" not in file_tensors and TOKEN_EMBD in file_tensors:
        aliases["output.weight"] = TOKEN_EMBD
        log.info("%s: no output.weight; the output head reuses token_embd.weight", path)

    check_names(wanted, set(file_tensors), aliases, path, f"{arch} model")

    device = model.output_norm.weight.device
    embd = model.token_embd
    model.token_embd = packed_embedding(
        file_tensors[TOKEN_EMBD], embd.num_embeddings, embd.embedding_dim, path, device
    )
    fill_tensors(model, file_tensors, aliases, path, arch, device, numerics, progress)
    log.debug("%s: loaded %d tensors, left %d to the experts/MTP", path, len(names), skipped)


def check_names(wanted: set[str], held: set[str], aliases: dict[str, str], path: Path, what: str) -> None:
    """Strict loading: a tensor wanted and not held (nor aliased), or held and not wanted, is an error."""
    missing = sorted(n for n in wanted if n not in held and n not in aliases)
    if missing:
        raise GGUFError(
            f"{path}: tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more: {', '.join(missing[1:6])})" if len(missing) > 1 else "")
            + f"; the file does not hold a complete {what}, convert it again"
        )
    unexpected = sorted(n for n in held if n not in wanted)
    if unexpected:
        raise GGUFError(
            f"{path}: unexpected tensor {unexpected[0]}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f" that the {what} does not use; the file does not match its architecture"
        )


def fill_tensors(
    module: nn.Module,
    file_tensors: dict[str, ReaderTensor],
    aliases: dict[str, str],
    path: Path,
    arch: str,
    device: torch.device,
    numerics: Numerics,
    progress: bool = False,
    prefix: str = "",
) -> None:
    """Set every Linear's matrix and copy every other parameter of `module` from the file tensor of its GGUF
    name (prefix + the module path's name; `aliases`: a name read from another tensor); the names were
    checked present."""
    names = gguf_names(module)
    linears = linear_names(module)
    state = module.state_dict(keep_vars=True)
    names = {k: prefix + n for k, n in names.items()}
    linears = {prefix + n: lin for n, lin in linears.items()}
    total = sum(int(file_tensors[aliases.get(n, n)].n_bytes) for n in [*names.values(), *linears])
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
    for name, lin in linears.items():
        t = file_tensors[aliases.get(name, name)]
        _check_shape(path, arch, name, torch_shape(t), (lin.d_out, lin.d_in))
        lin.matrix = make_matrix(t, (lin.d_out, lin.d_in), device, numerics)
        bar.update(int(t.n_bytes))
    for key, name in names.items():
        t = file_tensors[aliases.get(name, name)]
        target = state[key]
        shape = torch_shape(t)
        _check_shape(path, arch, name, shape, tuple(target.shape))
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
    # the matrices' pages are mapped in while start-up goes on (the token table is read a row at a time)
    # (a repacked matrix was read already, into its own memory)
    pages.populate(
        np.asarray(lin.matrix.weight.keep)
        for lin in linears.values()
        if isinstance(lin.matrix, GGMLMatrix) and lin.matrix.weight.repack is None
    )


def load_mtp_head(
    path: str | Path, model: DecoderModel, experts: ExpertBackend, numerics: Numerics = Numerics.NATIVE
) -> MTPHead:
    """The MTP head of the model file at `path` (its first MTP block, blk.L after the L main blocks) beside
    `model` loaded from the same file: it shares the model's token_embd, output_norm and output where the
    file gives it none of its own, and its routed experts (layer L) are computed by `experts`."""
    gguf_path = resolve_gguf(path)
    reader = open_gguf(gguf_path)
    arch = architecture(read_metadata(reader), gguf_path)
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, HybridConfig):
        raise GGUFError(
            f"{gguf_path}: {arch} models have no MTP head that swarm runs (qwen35moe and qwen3next have); "
            "run without MTP drafts"
        )
    if cfg.n_nextn == 0:
        raise GGUFError(
            f"{gguf_path}: the file has no MTP block ({arch}.nextn_predict_layers is 0 or missing); run "
            "without MTP drafts, or use a GGUF converted with the model's MTP layers"
        )
    prefix = f"blk.{cfg.n_layer}."
    held = {
        t.name: t for t in reader.tensors if t.name.startswith(prefix) and not EXPERT_TENSOR_RE.match(t.name)
    }
    embed_name = prefix + MTP_EMBED
    device = model.output_norm.weight.device
    trunk = TrunkParts(model.token_embd, model.output_norm, model.output)
    with torch.device(device):
        head = MTPHead(
            cfg,
            experts,
            trunk,
            own_norm=prefix + "nextn.shared_head_norm.weight" in held,
            own_head=prefix + "nextn.shared_head_head.weight" in held,
        )
    wanted = {prefix + n for n in [*gguf_names(head).values(), *linear_names(head)]}
    if embed_name in held:
        wanted.add(embed_name)
        head.nextn.embed_tokens = packed_embedding(
            held[embed_name], cfg.n_vocab, cfg.n_embd, gguf_path, device
        )
    check_names(wanted, set(held), {}, gguf_path, f"{arch} MTP block")
    fill_tensors(head, held, {}, gguf_path, arch, device, numerics, prefix=prefix)
    for mod in head.modules():
        if hasattr(mod, "native_steps"):
            mod.native_steps = numerics == Numerics.NATIVE
    head.bind()
    head.eval()
    if cfg.n_nextn > 1:
        log.info("%s: %d MTP blocks; the drafts use the first, blk.%d", gguf_path, cfg.n_nextn, cfg.n_layer)
    return head


def packed_embedding(
    t: ReaderTensor, n_vocab: int, n_embd: int, path: Path, device: torch.device
) -> PackedEmbedding:
    """A PackedEmbedding [n_vocab, n_embd] over the file's own rows of `t` (whatever their type: nothing is
    copied; a tied output head multiplies the same bytes)."""
    _check_shape(path, "model", t.name, torch_shape(t), (n_vocab, n_embd))
    qtype = t.tensor_type

    def decode(rows: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        return dequantize(rows, qtype, shape)

    return PackedEmbedding(np.asarray(t.data).reshape(n_vocab, -1), n_embd, decode, device)


def _check_shape(path: Path, arch: str, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    # {D} and {D, 1} are the same vector; anything else is a different model.
    if shape != want and _squeezed(shape) != _squeezed(want):
        raise GGUFError(
            f"{path}: tensor {name} has shape {list(shape)}, the {arch} model built from the "
            f"file's metadata expects {list(want)}"
        )


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)
