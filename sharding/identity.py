"""Which model a coordinator or a node runs, whether it was started on the GGUF or on its shard directory.

A side is known by two hashes (`ModelIdentity`):

- `fingerprint`: what it reports and what a node checks in every Compute call. A shard directory's is the
  manifest fingerprint (SHA-256 over every byte of the model); a whole GGUF's is the SHA-256 of its header
  bytes (metadata and tensor infos), since the full fingerprint would need every weight read.
- `source_sha256`: the SHA-256 of the source GGUF's header bytes. A shard directory has it from its manifest
  (`source.header_sha256`); for a whole GGUF it equals the fingerprint. Empty when unknown (a node of an
  older swarm, or a bare fingerprint given by hand).

Two sides run the same model when their fingerprints are equal (`Match.FINGERPRINT`), or when one of them
was started on the GGUF and the other's source header hash is that GGUF's (`Match.HEADER`). The header
match is the weaker one: two files with identical headers but other weights (two quantizations with the
same types and metadata, a fine-tune that kept them) would match too. Two shard directories are never
matched by header: their full fingerprints are known, and when they differ, so do the weights.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from gguf import Keys

from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import expert_tensors, open_gguf, read_metadata
from swarm.sharding.manifest import DENSE_NAME, read_manifest
from swarm.sharding.slabs import SlabKey, hash_file_range


def gguf_header_fingerprint(path: str | Path) -> str:
    """SHA-256 of a GGUF's bytes before its tensor data: identifies the model without reading the weights."""
    reader = open_gguf(path)
    return hash_file_range(path, 0, int(reader.data_offset))


class Match(enum.Enum):
    FINGERPRINT = "fingerprint"  # the same fingerprint: every byte when both are shard directories
    HEADER = "header"  # one side is the GGUF, the other its shard directory (or both the GGUF): header only


@dataclass(frozen=True)
class ModelIdentity:
    fingerprint: str
    source_sha256: str = ""

    @property
    def is_gguf(self) -> bool:
        """Started on a whole GGUF: the fingerprint is only the header hash."""
        return bool(self.source_sha256) and self.fingerprint == self.source_sha256

    def match(self, other: ModelIdentity) -> Match | None:
        """How `other` is this same model, or None when it is another one."""
        if not other.fingerprint:
            return None
        header_only = self.is_gguf or other.is_gguf
        if other.fingerprint == self.fingerprint:
            return Match.HEADER if header_only else Match.FINGERPRINT
        if header_only and self.source_sha256 and self.source_sha256 == other.source_sha256:
            return Match.HEADER
        return None


def identity_of(path: str | Path) -> ModelIdentity:
    """The identity of a shard directory (manifest fingerprint + source header hash) or of a GGUF."""
    path = Path(path)
    if path.is_dir():
        manifest = read_manifest(path)
        return ModelIdentity(manifest.fingerprint, manifest.source.header_sha256)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory; give a .gguf model or a `swarm shard` directory")
    header = gguf_header_fingerprint(path)
    return ModelIdentity(header, header)


def model_identity(path: str | Path) -> tuple[ModelIdentity, list[SlabKey]]:
    """(what the model is known by: the nodes of it are those it matches, every (layer, expert) slab it needs).

    A shard directory is known by its manifest fingerprint and its source GGUF's header hash, a GGUF by its
    header hash, so nodes started on either form of the model serve a coordinator started on either."""
    path = Path(path)
    identity = identity_of(path)
    if path.is_dir():
        manifest = read_manifest(path)
        needed = [(layer, e) for layer in manifest.moe_layers for e in range(manifest.n_expert)]
        return identity, needed
    reader = open_gguf(path)
    needed = sorted({(et.layer, e) for et in expert_tensors(reader, path) for e in range(et.n_expert)})
    return identity, needed


def first_mtp_layer(path: str | Path) -> int | None:
    """The first MTP block's layer of the model at `path` (a GGUF or a shard directory: blk.L after the L main
    blocks), or None when it has none: the layers from it on run only with MTP drafts (--mtp)."""
    path = Path(path)
    meta = read_metadata(open_gguf(path / DENSE_NAME if path.is_dir() else path))
    arch = meta.get(Keys.General.ARCHITECTURE)
    blocks = meta.get(Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_mtp = meta.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0)
    if not isinstance(blocks, int) or not isinstance(n_mtp, int) or not 0 < n_mtp < blocks:
        return None
    return blocks - n_mtp
