"""Where a node's slabs come from: a shard directory (`swarm shard` output) or a whole GGUF.

From a shard directory each slab file is checked against the manifest's SHA-256 before it is served; a
bad one is refused by name and the rest serve. A whole GGUF is served straight from its memory map (a
convenience for trying a node without sharding first).

Model fingerprint: a shard directory's is the manifest's. A whole GGUF would need every byte hashed to
get that same value, so a node started on one reports the SHA-256 of the GGUF's header bytes (all
metadata and tensor infos) instead, the value a manifest records as `source.header_sha256`. Either way the
node also reports that source header hash, so a coordinator started on the other form of the same model
recognises it (see swarm.sharding.identity).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import expert_tensors, open_gguf
from swarm.sharding.identity import ModelIdentity, gguf_header_fingerprint
from swarm.sharding.slabs import ExpertSlab, SlabKey, slabs_from_gguf

log = logging.getLogger(__name__)


@dataclass
class LoadedSlabs:
    slabs: dict[SlabKey, ExpertSlab]
    fingerprint: str
    problems: list[str] = field(default_factory=list)
    source: str = ""
    source_sha256: str = ""  # the source GGUF's header hash (for a whole GGUF: the fingerprint itself)

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.fingerprint, self.source_sha256)


def wanted_slabs(
    layers: Iterable[int] | None,
    experts: Iterable[int] | None,
    slabs: Iterable[SlabKey],
    all_layers: list[int],
    n_expert: int,
) -> set[SlabKey]:
    """The slabs a node is asked for: `slabs` plus layers x experts (either None: all); everything when
    nothing at all is asked for."""
    want: set[SlabKey] = set(slabs)
    if layers is not None or experts is not None or not want:
        ls = list(layers) if layers is not None else all_layers
        es = list(experts) if experts is not None else list(range(n_expert))
        want |= {(layer, e) for layer in ls for e in es}
    return want


def load_from_gguf(
    path: Path, layers: Iterable[int] | None, experts: Iterable[int] | None, slab_keys: Iterable[SlabKey]
) -> LoadedSlabs:
    reader = open_gguf(path)
    ets = expert_tensors(reader, path)
    if not ets:
        raise UserError(
            f"{path}: has no stacked expert tensors (*_exps); it is not a mixture-of-experts model"
        )
    all_layers = sorted({et.layer for et in ets})
    n_expert = max(et.n_expert for et in ets)
    want = wanted_slabs(layers, experts, slab_keys, all_layers, n_expert)
    got = slabs_from_gguf(path, {k[0] for k in want}, {k[1] for k in want})
    slabs = {k: v for k, v in got.items() if k in want}
    problems = []
    for layer, e in sorted(want - set(slabs)):
        if layer not in all_layers:
            problems.append(f"layer {layer} expert {e}: the model has no experts in layer {layer}")
        else:
            problems.append(f"layer {layer} expert {e}: the model has only {n_expert} experts per layer")
    header = gguf_header_fingerprint(path)
    return LoadedSlabs(slabs, header, problems, str(path), header)


def load_from_shard(
    directory: Path,
    layers: Iterable[int] | None,
    experts: Iterable[int] | None,
    slab_keys: Iterable[SlabKey],
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    map_only: bool = False,
) -> LoadedSlabs:
    from swarm.sharding.slabs import read_manifest, slabs_from_shard

    manifest = read_manifest(directory)
    slab_keys = set(slab_keys)
    allow_open_files(len(manifest.moe_layers) * manifest.n_expert)  # at most every slab of the model
    slabs: dict[SlabKey, ExpertSlab] = {}
    problems: list[str] = []
    if layers is not None or experts is not None or not slab_keys:
        got, bad = slabs_from_shard(directory, layers, experts, verify, progress, map_only)
        slabs.update(got)
        problems += bad
    by_layer: dict[int, list[int]] = {}
    for layer, e in sorted(slab_keys - set(slabs)):
        by_layer.setdefault(layer, []).append(e)
    for layer, es in by_layer.items():
        got, bad = slabs_from_shard(directory, [layer], es, verify, map_only=map_only)
        slabs.update(got)
        problems += bad
    return LoadedSlabs(slabs, manifest.fingerprint, problems, str(directory), manifest.source.header_sha256)


# Descriptors beside the slab files: sockets, the dense file, libraries, pipes.
OTHER_FILES = 1024


def allow_open_files(n: int) -> None:
    """Let this process open `n` more files than OTHER_FILES: its soft limit raised up to its hard limit
    where it is lower. Each memory-mapped slab file keeps a descriptor (Python's mmap holds one per map), a
    node with 64 experts of each of 40 layers holds 2,560 of them, and many systems start a process with a
    soft limit of 1,024 (its hard limit much higher). A hard limit too low is said when a file cannot be
    opened (sharding.gguf_io.too_many_open_files)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + OTHER_FILES
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new <= soft:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        log.debug("open files allowed: %d (was %d)", new, soft)
    except (ValueError, OSError) as e:  # macOS caps it below an infinite hard limit (kern.maxfilesperproc)
        log.debug("open files limit stays %d: %s", soft, e)


def load_slabs(
    source: str | Path,
    layers: Iterable[int] | None = None,
    experts: Iterable[int] | None = None,
    slab_keys: Iterable[SlabKey] = (),
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    map_only: bool = False,
) -> LoadedSlabs:
    """The requested slabs: layers x experts (either None = all) plus individual (layer, expert) keys.

    With no selection at all, every slab of the model. Requested slabs that cannot be served are listed in
    `problems` (one line each) and left out. `progress(done, total)` follows the layers x experts slabs of
    a shard directory (checked one by one); a whole GGUF is only mapped, which is quick. `map_only` (without
    `verify`): a shard directory's slab files are mapped, nothing of them read, for a caller that hashes
    each before its first use (swarm.node.first_use).
    """
    path = Path(source)
    if path.is_dir():
        return load_from_shard(path, layers, experts, slab_keys, verify, progress, map_only)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory; give a shard directory or a .gguf model")
    return load_from_gguf(path, layers, experts, slab_keys)


@contextlib.contextmanager
def slab_progress(desc: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (only when it is a terminal) fed with (done, total) slab counts."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="slab", file=sys.stderr, disable=None if enabled else True, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()
