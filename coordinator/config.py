"""How an engine is opened: one frozen record, built once from the command line (`cli/flags.py`
`config_from_args`, which `swarm serve` uses too) or by keywords in tests and benches, and passed down whole
to the engine, the swarm backend and the auditor.

    engine = open_engine("model.swarm", EngineConfig(local=True, device="cpu"))

The module imports no torch: the command line builds its flags from these records before it loads any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.node.auth import SwarmKey
from swarm.proto.numerics import Numerics

if TYPE_CHECKING:
    import torch

DEFAULT_AUDIT_RATE = 0.05
# The most row bytes one Compute call carries: a long prefill goes to a node as several calls. Well under the
# wire's MAX_MESSAGE_BYTES (whatever D and the wire precision), and the node starts computing the first
# call while the next ones are still on their way.
CALL_BYTES = 16 * 1024 * 1024


class Wire(Enum):
    """How a call's rows travel (`--wire`): as float rows of a type, or (q8) as the 8-bit blocks the experts'
    kernels quantize them to, with float32 values where a layer's experts take no such blocks."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8 = "q8"

    @property
    def dtype(self) -> torch.dtype:
        """The float type of the rows' values (and of the answers an in-process backend rounds to)."""
        import torch  # (not at import: the command line reads this module before it knows it needs torch)

        return {Wire.F16: torch.float16, Wire.BF16: torch.bfloat16}.get(self, torch.float32)


class Verify(Enum):
    """How the nodes' answers are checked (`--verify`)."""

    PROJECT = "project"  # every answer checked by random projections; one that fails recomputed exactly
    SAMPLE = "sample"  # --audit's share of decode answers; every prompt answer on one row per expert
    TWINS = "pair"  # every call also sent to a second holder, the two answers compared
    ALL = "all"  # every answer recomputed here, whole


@dataclass(frozen=True)
class EngineConfig:
    """Everything `open_engine` needs besides the model's path; the defaults are `swarm run`'s."""

    local: bool = False  # the experts computed in this process, not on nodes
    device: str | None = None  # torch device of the dense path (None: cuda if present)
    numerics: Numerics = Numerics.NATIVE  # also what nodes are asked to compute in
    wire: Wire = Wire.F32
    memory_budget: int | None = None  # bytes of repacked expert copies in process (None: the default)
    progress: bool = False  # progress bars on stderr (only when it is a terminal) while loading
    mtp_head: bool = False  # the model's MTP head too (a file without one is a GGUFError)
    mmproj: str | Path | None = None  # the vision tower to read pictures with
    image_tokens: tuple[int | None, int | None] = (None, None)  # least / most rows a picture (None: the file's)
    # finding the nodes
    peers: tuple[str, ...] = ()
    mdns: bool = True
    mdns_interfaces: Sequence[str] | None = None
    listen: str | None = None  # "host:port" where nodes that dial out join (swarm node --join); None: none
    wait: float = 3.0  # seconds to wait for nodes to cover every expert
    key: SwarmKey | None = None
    same_class_only: bool = False  # --numerics-class same: nodes of another numerics class passed over
    # calling them
    timeout: float = 30.0  # seconds before a node call fails over
    call_bytes: int = CALL_BYTES
    degraded: bool = False  # an expert with no live holder is left out of the sum (hivemind's k_min)
    # checking their answers
    # share of decode answers recomputed here, exactly (None: the --verify setting's own, 0.05 for sample and
    # none for project; 0: trust every answer, unless --verify is pair or all)
    audit_rate: float | None = None
    # the audits' draws and the projections' r from this seed (tests only: a node that knew it would know r);
    # None: the operating system's randomness
    audit_seed: int | None = None
    verify: Verify = Verify.PROJECT

    @property
    def sampled_rate(self) -> float:
        """The share of decode answers audited exactly, beside what --verify checks."""
        if self.audit_rate is not None:
            return self.audit_rate
        return DEFAULT_AUDIT_RATE if self.verify is Verify.SAMPLE else 0.0

    @property
    def checks_answers(self) -> bool:
        """Whether the nodes' answers are checked at all: `--audit 0` trusts them under sample and project
        (twins and all check every one whatever the rate)."""
        return self.audit_rate != 0 or self.verify in (Verify.TWINS, Verify.ALL)
