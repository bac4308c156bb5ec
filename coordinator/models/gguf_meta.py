"""Reading hyper-parameters from GGUF metadata: every arch's Config.from_metadata builds its config with
these, keys from gguf.Keys; a missing or mistyped key is a GGUFError naming it (the loader adds the file).
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from swarm.sharding.gguf_io import GGUFError


def meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """meta[key]; a missing key with no default is a GGUFError naming it (the loader adds the file)."""
    if key in meta:
        return meta[key]
    if default is None:
        raise GGUFError(f"has no metadata key {key}, which this architecture needs; convert the model again")
    return default


def meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta_value(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"metadata key {key} is {value!r}, expected an integer")
    return value


def meta_float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    value = meta_value(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GGUFError(f"metadata key {key} is {value!r}, expected a number")
    return float(value)


def n_vocab_of(meta: dict[str, Any], arch: str) -> int:
    """Vocabulary size: `<arch>.vocab_size` when present, else the length of the token list."""
    key = Keys.LLM.VOCAB_SIZE.format(arch=arch)
    if key in meta:
        return meta_int(meta, key)
    tokens = meta.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"has neither {key} nor {Keys.Tokenizer.LIST}: the vocabulary size is unknown")
    return len(tokens)


def n_main_layers(meta: dict[str, Any], arch: str) -> int:
    """Blocks of the main pass: block_count less the trailing MTP blocks (`nextn_predict_layers`)."""
    n_block = meta_int(meta, Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_mtp = meta_int(meta, Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0)
    if not 0 <= n_mtp < n_block:
        raise GGUFError(f"has {n_mtp} MTP blocks (nextn_predict_layers) but only {n_block} blocks in all")
    return n_block - n_mtp
