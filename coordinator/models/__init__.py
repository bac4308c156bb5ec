"""The architectures the coordinator can run, by GGUF `general.architecture`.

Each arch module defines `Config` (a frozen dataclass with `from_metadata(meta)`) and
`Model(cfg, experts)` (a base.DecoderModel). The loader picks the module from ARCHS. An arch whose
tensor layout varies between files in ways the metadata does not say also defines
`refine_config(cfg, tensor_names) -> cfg`.
"""

from __future__ import annotations

from types import ModuleType

from swarm.coordinator.models import qwen2moe, qwen3moe, qwen3next, qwen35moe
from swarm.sharding.errors import UserError

ARCHS: dict[str, ModuleType] = {
    qwen2moe.ARCH: qwen2moe,
    qwen3moe.ARCH: qwen3moe,
    qwen35moe.ARCH: qwen35moe,
    qwen3next.ARCH: qwen3next,
}


def get_arch(name: str) -> ModuleType:
    """The module of architecture `name`; an unknown one is a UserError listing the supported ones."""
    try:
        return ARCHS[name]
    except KeyError:
        raise UserError(
            f"architecture {name!r} is not supported; swarm runs {', '.join(sorted(ARCHS))}"
        ) from None
