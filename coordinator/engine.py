"""Open a model for inference: dense path from the GGUF (or shard dir), experts in process or on the swarm.

engine = open_engine("model.swarm", EngineConfig())          # nodes found by mDNS
for token in generate(engine.model, engine.tokenizer.encode("Hi"), SamplingParams(), engine.device): ...
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.compute.expert_copies import default_memory_budget
from swarm.compute.slabs import load_slabs, slab_progress
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks.audit import Auditor, make_auditor
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.experts.remote.discovery import connect
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.coordinator.loader import default_device, load_model, load_mtp_head
from swarm.coordinator.models.base import DecoderModel
from swarm.coordinator.models.mtp import MTPHead
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError
from swarm.sharding.identity import first_mtp_layer, model_identity

log = logging.getLogger(__name__)


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
    mtp_head: MTPHead | None = None  # the model's MTP head, loaded with EngineConfig(mtp_head=True)
    vision: Any = None  # its vision tower (text.pictures.Pictures), loaded with EngineConfig(mmproj=...)

    @property
    def checker(self) -> Auditor | None:
        """What checks the nodes' answers (None in process, or with --audit 0)."""
        return self.experts.auditor if isinstance(self.experts, SwarmExperts) else None

    def close(self) -> None:
        if isinstance(self.experts, SwarmExperts):
            self.experts.close()


def open_engine(path: str | Path, config: EngineConfig) -> Engine:
    """The model at `path` with its experts computed here (`config.local`) or by the swarm's nodes, as
    `config` says (swarm.coordinator.config). Nodes are asked for the same numerics; their answers are
    checked (swarm.coordinator.checks) on the coordinator's own slabs. The engine returned is ready: the
    nodes found at start are admitted (probed) while the model loads, and its first prompt waits for nothing."""
    dev = torch.device(config.device) if config.device else default_device()
    experts: LocalExperts | SwarmExperts
    if config.local:
        experts, fingerprint = _local_experts(path, dev, config)
    else:
        experts, fingerprint = _swarm_experts(path, config)
    try:
        model, meta = load_model(path, experts, dev, progress=config.progress, numerics=config.numerics)
        head = load_mtp_head(path, model, experts, config.numerics) if config.mtp_head else None
        tokenizer = GGUFTokenizer(meta)
        vision = None
        if config.mmproj is not None:
            from swarm.coordinator.text.pictures import open_vision

            vision = open_vision(meta, config.mmproj, config.numerics, dev, *config.image_tokens)
        if isinstance(experts, SwarmExperts):
            waited = time.perf_counter()
            experts.await_admission()
            log.debug(
                "the nodes' admission ended %.2f s after the model loaded", time.perf_counter() - waited
            )
    except BaseException:
        if isinstance(experts, SwarmExperts):
            experts.close()
        raise
    return Engine(model, meta, tokenizer, experts, dev, str(path), fingerprint, config.numerics, head, vision)


def _swarm_experts(path: str | Path, config: EngineConfig) -> tuple[SwarmExperts, str]:
    """(the swarm backend, its nodes found and their admission begun; the model's fingerprint). Without
    `config.mtp_head` the MTP block's experts are never asked for, so no node need hold them."""
    identity, needed = model_identity(path)
    first_mtp = None if config.mtp_head else first_mtp_layer(path)
    if first_mtp is not None:
        needed = [k for k in needed if k[0] < first_mtp]
    checker = functools.partial(make_auditor, path, config) if config.checks_answers else None
    experts = connect(needed, identity, str(path), config, checker)
    experts.admit_known()  # beside the model's loading
    return experts, identity.fingerprint


def _local_experts(path: str | Path, dev: torch.device, config: EngineConfig) -> tuple[LocalExperts, str]:
    """(the experts computed in this process, every slab checked as it loads; the model's fingerprint).
    Without `config.mtp_head` the MTP block's experts stay on disk (nothing asks for them)."""
    first_mtp = None if config.mtp_head else first_mtp_layer(path)
    with slab_progress("checking slabs", enabled=config.progress) as on_slab:
        loaded = load_slabs(path, layers=range(first_mtp) if first_mtp is not None else None, progress=on_slab)
    if loaded.problems:
        raise UserError(f"{path}: some expert slabs cannot be used: " + "; ".join(loaded.problems[:5]))
    budget = default_memory_budget() if config.memory_budget is None else config.memory_budget
    store = ExpertStore(loaded.slabs, dev, budget)
    if config.numerics == Numerics.NATIVE:
        store.prepare()  # repacked copies now, as llama.cpp's load makes them, not in the first prompt
    return LocalExperts(store, config.wire, config.numerics), loaded.fingerprint
