"""Open a model for inference: dense path from the GGUF (or shard dir), experts in process or on the swarm.

engine = open_engine("model.swarm", local=False)          # nodes found by mDNS
for token in generate(engine.model, engine.tokenizer.encode("Hi"), SamplingParams(), engine.device): ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.compute.expert_copies import default_memory_budget, within_cap
from swarm.compute.expert_weights import slab_dims
from swarm.compute.slabs import allow_open_files, load_slabs, slab_progress
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks.audit import DEFAULT_RATE, Auditor
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.experts.remote.discovery import connect
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.coordinator.loader import default_device, load_model, load_mtp_head
from swarm.coordinator.models.base import DecoderModel
from swarm.coordinator.models.mtp import MTPHead
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.node.auth import SwarmKey
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError
from swarm.sharding.identity import first_mtp_layer, model_identity
from swarm.sharding.manifest import EXPERTS_DIR
from swarm.sharding.slabs import ExpertSlab, LazySlabs, SlabKey

log = logging.getLogger(__name__)

# q8: float32 values, sent as the kernels' 8-bit blocks where the answers keep their bits (SwarmExperts.q8_rows)
WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8": torch.float32}
# The copies of experts audits keep, least recently used first out: repacked ones (native numerics, Q4_0 /
# Q4_K / IQ4_NL on x86: 1.8 MB an expert at the 35B shape) or float32 ones (exact). Without a bound they would
# grow towards the size of every expert the coordinator has ever checked.
AUDIT_MEMORY = 512 << 20


@dataclass
class Engine:
    model: DecoderModel
    meta: dict[str, Any]
    tokenizer: GGUFTokenizer
    experts: LocalExperts | SwarmExperts
    device: torch.device
    source: str
    fingerprint: str
    numerics: Numerics = Numerics.NATIVE
    mtp: MTPHead | None = None  # the model's MTP head, loaded with open_engine(mtp=True)
    vision: Any = None  # its vision tower (coordinator.pictures.Pictures), loaded with open_engine(mmproj=)

    @property
    def checker(self) -> Auditor | None:
        """What checks the nodes' answers (None in process, or with --audit 0)."""
        return self.experts.auditor if isinstance(self.experts, SwarmExperts) else None

    def close(self) -> None:
        if isinstance(self.experts, SwarmExperts):
            self.experts.close()


def make_auditor(
    path: str | Path,
    numerics: Numerics,
    wire_dtype: torch.dtype,
    rate: float,
    seed: int | None,
    every_row: bool = False,
) -> Auditor | None:
    """The coordinator's own slabs, to check node answers with; None (and a warning) when it has none."""
    shard_dir = Path(path) if Path(path).is_dir() else None
    no_files = shard_dir is not None and next((shard_dir / EXPERTS_DIR).rglob("*.gguf"), None) is None
    store = None if no_files else _audit_store(path)
    if store is None or not store.slabs:
        log.warning("%s holds no expert slabs here: node answers cannot be audited", path)
        return None
    return Auditor(store, numerics, wire_dtype, rate, shard_dir, seed, every_row=every_row)


def _audit_store(path: str | Path) -> ExpertStore:
    """The coordinator's own slabs, memory-mapped: a shard directory's slab files each read on the first
    audit that draws it (LazySlabs: none at start), a GGUF's experts as views of its map. Neither is hashed
    here: a slab whose bytes an audit finds different is checked against the manifest before it counts."""
    if Path(path).is_dir():
        slabs: Mapping[SlabKey, ExpertSlab] = LazySlabs(path, dims=slab_dims)
        allow_open_files(len(slabs))  # a file read is a descriptor kept: a long run's audits draw them all
    else:
        slabs = load_slabs(path, verify=False).slabs
    return ExpertStore(slabs, torch.device("cpu"), within_cap(AUDIT_MEMORY), stacked=False)


def open_engine(
    path: str | Path,
    local: bool = False,
    peers: tuple[str, ...] = (),
    mdns: bool = True,
    mdns_interfaces: list[str] | None = None,
    wait: float = 3.0,
    wire: str = "f32",
    device: str | None = None,
    key: SwarmKey | None = None,
    timeout: float = 30.0,
    memory_budget: int | None = None,
    progress: bool = False,
    numerics: Numerics = Numerics.NATIVE,
    audit: float = DEFAULT_RATE,
    audit_seed: int | None = None,
    degraded: bool = False,
    verify: str = "sample",
    numerics_class: str = "any",
    mtp: bool = False,
    mmproj: str | Path | None = None,
    image_tokens: tuple[int | None, int | None] = (None, None),
) -> Engine:
    """The model at `path` with its experts computed here (`local`) or by the swarm's nodes.
    `progress`: progress bars on stderr (only when it is a terminal) while slabs and weights load.
    `numerics`: native (every weight multiplied in its file type with ggml's kernels, llama.cpp's numerics)
    or exact (float32 on weights dequantized exactly); nodes are asked for the same. `audit`: the share of
    node answers recomputed here to check them (swarm.coordinator.checks.audit; 0: trust every node). `verify`:
    "sample" (that share, and every answer of a prompt pass on one row per expert), "pair" (every call also
    sent to a second holder, the two compared) or "all" (every answer recomputed here). `numerics_class`:
    "same" takes only nodes whose answers are checked bit for bit (swarm.compute.numclass). `mtp`: the
    model's MTP head too (Engine.mtp, for coordinator.mtp_drafts; its experts on the same backend); a file
    without one is a GGUFError. `mmproj`: the vision tower to read pictures with (Engine.vision;
    `image_tokens`: the least and most rows per picture, None: the file's)."""
    dev = torch.device(device) if device else default_device()
    wire_dtype = WIRE_DTYPES[wire]
    experts: LocalExperts | SwarmExperts
    if local:
        experts, fingerprint = _local_experts(path, dev, wire_dtype, numerics, memory_budget, progress, mtp)
    else:
        identity, needed = model_identity(path)
        first_mtp = None if mtp else first_mtp_layer(path)
        if first_mtp is not None:  # without drafts the MTP block's experts are never asked for
            needed = [k for k in needed if k[0] < first_mtp]
        fingerprint = identity.fingerprint
        experts = connect(
            needed,
            identity,
            str(path),
            peers=peers,
            mdns=mdns,
            interfaces=mdns_interfaces,
            wait=wait,
            key=key,
            wire_dtype=wire_dtype,
            timeout=timeout,
            numerics=numerics,
            same_class_only=numerics_class == "same",
        )
        experts.q8_rows = wire == "q8"
        _check_answers(experts, path, numerics, wire_dtype, audit, audit_seed, degraded, verify)
    try:
        model, meta = load_model(path, experts, dev, progress=progress, numerics=numerics)
        head = load_mtp_head(path, model, experts, numerics) if mtp else None
        tokenizer = GGUFTokenizer(meta)
        vision = None
        if mmproj is not None:
            from swarm.coordinator.text.pictures import open_vision

            vision = open_vision(meta, mmproj, numerics, dev, *image_tokens)
        if isinstance(experts, SwarmExperts):
            waited = time.perf_counter()
            experts.await_admission()  # the engine returned is ready: its first prompt waits for nothing
            log.debug(
                "the nodes' admission ended %.2f s after the model loaded", time.perf_counter() - waited
            )
    except BaseException:
        if isinstance(experts, SwarmExperts):
            experts.close()
        raise
    return Engine(model, meta, tokenizer, experts, dev, str(path), fingerprint, numerics, head, vision)


def _local_experts(
    path: str | Path,
    dev: torch.device,
    wire_dtype: torch.dtype,
    numerics: Numerics,
    memory_budget: int | None,
    progress: bool,
    mtp: bool,
) -> tuple[LocalExperts, str]:
    """(the experts computed in this process, every slab checked as it loads; the model's fingerprint).
    Without `mtp` the MTP block's experts stay on disk (nothing asks for them)."""
    first_mtp = None if mtp else first_mtp_layer(path)
    with slab_progress("checking slabs", enabled=progress) as on_slab:
        loaded = load_slabs(path, layers=range(first_mtp) if first_mtp is not None else None, progress=on_slab)
    if loaded.problems:
        raise UserError(f"{path}: some expert slabs cannot be used: " + "; ".join(loaded.problems[:5]))
    budget = default_memory_budget() if memory_budget is None else memory_budget
    store = ExpertStore(loaded.slabs, dev, budget)
    if numerics == Numerics.NATIVE:
        store.prepare()  # repacked copies now, as llama.cpp's load makes them, not in the first prompt
    return LocalExperts(store, wire_dtype, numerics), loaded.fingerprint


def _check_answers(
    experts: SwarmExperts,
    path: str | Path,
    numerics: Numerics,
    wire_dtype: torch.dtype,
    audit: float,
    audit_seed: int | None,
    degraded: bool,
    verify: str,
) -> None:
    """How the swarm's answers are checked (see open_engine), and what an expert with no holder does."""
    experts.degraded = degraded
    experts.pair = verify == "pair"
    if audit > 0 or verify != "sample":  # (pair and all check every answer whatever the rate)
        experts.auditor = make_auditor(path, numerics, wire_dtype, audit, audit_seed, verify == "all")
        if experts.auditor is not None:
            experts.auditor.classes = experts.classes  # (the same dict: nodes that join later too)
            experts.auditor.on_ban = experts.placement.ban
            experts.admit_known()  # beside the model's loading below
