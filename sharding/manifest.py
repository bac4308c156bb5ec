"""The shard directory format: `manifest.json`, `dense.gguf`, `experts/<layer>/<expert>.gguf`.

A shard directory is what `swarm shard` writes and what nodes and the coordinator read:

    DIR/manifest.json                 this file's `Manifest`
    DIR/dense.gguf                    every non-expert tensor and every metadata key of the source
    DIR/experts/<layer>/<expert>.gguf one mini-GGUF per (layer, expert): that expert's slabs, bytes as in the source

A slab file holds the layer's expert tensors in source order, named as in the source
(`blk.7.ffn_up_exps.weight`, now 2-D; biases 1-D), same quant type, bytes identical to the source range,
with metadata general.architecture, swarm.format_version, swarm.layer, swarm.expert, swarm.fingerprint.

Hashes. `dense.sha256` is the SHA-256 of the whole dense.gguf. A slab file is checked in two parts, because
its header carries the model fingerprint, which is only known once every byte of the model has been read
(hashing while copying, one pass): `header_sha256` covers bytes [0, data_offset) and `sha256` covers
[data_offset, size), the tensors' bytes (each padded to the file's alignment with zeros). Together they
cover every byte of the file.

Fingerprint: SHA-256("swarm-fingerprint-v1\\0" ‖ H(source bytes before its tensor data: metadata and
tensor infos) ‖ H(every non-expert tensor's source bytes, in file order) ‖ the data hash of every slab
in (layer, expert) order), H = SHA-256 digest. So it changes when any byte of the model changes (padding
between tensors aside), and every cut of one model, whole or partial, carries the same fingerprint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarm.sharding.errors import UserError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.gguf"
EXPERTS_DIR = "experts"

# Metadata keys of a slab mini-GGUF (besides general.architecture).
KEY_LAYER = "swarm.layer"
KEY_EXPERT = "swarm.expert"
KEY_FINGERPRINT = "swarm.fingerprint"
KEY_FORMAT = "swarm.format_version"


def slab_relpath(layer: int, expert: int) -> str:
    """Where slab (layer, expert) lives inside a shard directory, relative to it (always '/')."""
    return f"{EXPERTS_DIR}/{layer}/{expert}.gguf"


@dataclass(frozen=True)
class ExpertTensorInfo:
    """One stacked expert tensor of the source: expert e is bytes [source_offset + e*slab_bytes, +slab_bytes)."""

    name: str  # blk.7.ffn_up_exps.weight
    layer: int
    kind: str  # ffn_up_exps, ffn_gate_up_exps, ffn_up_exps.bias (the keys of a slab dict)
    qtype: str  # GGMLQuantizationType name: Q4_K, F32, ...
    shape: tuple[int, ...]  # torch order, whole stacked tensor: [E, F, D]
    slab_bytes: int
    source_offset: int  # absolute offset of expert 0 in the source file


@dataclass(frozen=True)
class FileEntry:
    """dense.gguf: path relative to the shard directory, size, SHA-256 of the whole file."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class SlabEntry:
    """One slab file. `header_sha256` covers [0, data_offset), `sha256` covers [data_offset, size)."""

    layer: int
    expert: int
    path: str
    size: int
    data_offset: int
    header_sha256: str
    sha256: str


@dataclass(frozen=True)
class SourceInfo:
    name: str  # file name of the source GGUF (no directory)
    size: int
    header_sha256: str  # SHA-256 of the source bytes before its tensor data (metadata + tensor infos)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    fingerprint: str
    arch: str
    n_layer: int  # block_count
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int  # expert feed-forward width
    moe_layers: tuple[int, ...]  # layers that have stacked expert tensors
    source: SourceInfo
    dense: FileEntry
    expert_tensors: tuple[ExpertTensorInfo, ...]
    slabs: tuple[SlabEntry, ...]  # the slabs this directory holds (a run may cut only a part)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def slab(self, layer: int, expert: int) -> SlabEntry | None:
        return self._index().get((layer, expert))

    def _index(self) -> dict[tuple[int, int], SlabEntry]:
        idx = self.__dict__.get("_slab_index")
        if idx is None:
            idx = {(s.layer, s.expert): s for s in self.slabs}
            object.__setattr__(self, "_slab_index", idx)  # a cache on a frozen dataclass
        return idx

    def tensors_of_layer(self, layer: int) -> list[ExpertTensorInfo]:
        """The layer's expert tensors in source order: the order of tensors in each slab file."""
        return [t for t in self.expert_tensors if t.layer == layer]

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return json.dumps(d, indent=1) + "\n"


def manifest_from_dict(d: dict[str, Any], where: str = "manifest") -> Manifest:
    """Build a Manifest from parsed JSON; a missing or mistyped field is a UserError naming `where`."""
    try:
        version = int(d["format_version"])
        if version > FORMAT_VERSION:
            raise UserError(
                f"{where}: shard format version {version} is newer than this swarm understands "
                f"({FORMAT_VERSION}); upgrade swarm or re-shard the model with this version"
            )
        known = {
            "format_version",
            "fingerprint",
            "arch",
            "n_layer",
            "n_expert",
            "n_expert_used",
            "n_embd",
            "n_ff_exp",
            "moe_layers",
            "source",
            "dense",
            "expert_tensors",
            "slabs",
        }
        return Manifest(
            format_version=version,
            fingerprint=str(d["fingerprint"]),
            arch=str(d["arch"]),
            n_layer=int(d["n_layer"]),
            n_expert=int(d["n_expert"]),
            n_expert_used=int(d["n_expert_used"]),
            n_embd=int(d["n_embd"]),
            n_ff_exp=int(d["n_ff_exp"]),
            moe_layers=tuple(int(x) for x in d["moe_layers"]),
            source=SourceInfo(**d["source"]),
            dense=FileEntry(**d["dense"]),
            expert_tensors=tuple(
                ExpertTensorInfo(**{**t, "shape": tuple(int(x) for x in t["shape"])})
                for t in d["expert_tensors"]
            ),
            slabs=tuple(SlabEntry(**s) for s in d["slabs"]),
            extra={k: v for k, v in d.items() if k not in known},
        )
    except UserError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"{where}: not a valid swarm manifest ({type(e).__name__}: {e}); re-run `swarm shard` into this directory"
        ) from e


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a shard directory; a clear UserError if it is missing, damaged or too new."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise UserError(f"{directory}: not a directory; give the directory `swarm shard -o` wrote")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"{directory}: no {MANIFEST_NAME}; it is not a (finished) shard directory, run `swarm shard MODEL.gguf -o {directory}`"
        ) from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); check its permissions") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a swarm manifest (not UTF-8 text); re-run `swarm shard`") from e
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: damaged manifest ({e}); re-run `swarm shard` into this directory") from e
    if not isinstance(d, dict):
        raise UserError(f"{path}: not a swarm manifest; re-run `swarm shard` into this directory")
    return manifest_from_dict(d, str(path))


def write_manifest(directory: str | Path, manifest: Manifest) -> None:
    """Write manifest.json atomically (temp file, fsync, rename, fsync of the directory)."""
    directory = Path(directory)
    atomic_write_bytes(directory / MANIFEST_NAME, manifest.to_json().encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
