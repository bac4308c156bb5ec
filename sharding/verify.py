"""`swarm shard --verify`: every way a shard directory differs from its manifest, and from its source model."""

from __future__ import annotations

import hashlib
from pathlib import Path

from swarm.sharding.ggufwrite import alignment_of, pad
from swarm.sharding.manifest import Manifest, read_manifest
from swarm.sharding.pump import Pump
from swarm.sharding.slabs import check_slab_file, hash_file_range
from swarm.sharding.source import dense_header, load_source, model_fingerprint, pump_slab, slab_header


def verify_shard(directory: str | Path, model: str | Path | None = None) -> list[str]:
    """Every mismatch between a shard directory and its manifest (and the source model, if given)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems: list[str] = []
    dense = directory / manifest.dense.path
    try:
        if dense.stat().st_size != manifest.dense.size:
            problems.append(
                f"{manifest.dense.path}: size {dense.stat().st_size}, manifest says {manifest.dense.size}"
            )
        elif hash_file_range(dense) != manifest.dense.sha256:
            problems.append(f"{manifest.dense.path}: differs from the manifest (SHA-256 mismatch)")
    except FileNotFoundError:
        problems.append(f"{manifest.dense.path}: missing")
    for entry in manifest.slabs:
        bad = check_slab_file(directory, entry)
        if bad is not None:
            problems.append(bad)
    if model is not None:
        problems += _verify_against_source(manifest, Path(model))
    return problems


def _verify_against_source(manifest: Manifest, model: Path) -> list[str]:
    """Re-derive every hash from the source (one read of it) and name each manifest entry that differs."""
    src = load_source(model)
    header_sha = hash_file_range(src.path, 0, src.data_start)
    if header_sha != manifest.source.header_sha256 or src.size != manifest.source.size:
        return [f"{model}: is not the model this directory was cut from (its header or size differ)"]
    problems: list[str] = []
    by_key = {(s.layer, s.expert): s for s in manifest.slabs}
    align = alignment_of(src.reader)
    pump = Pump(src.path)
    try:
        head = dense_header(src)
        file_h, data_h = hashlib.sha256(), hashlib.sha256()
        pump.hash_bytes([file_h], head)
        for spec, off in zip(src.dense, src.dense_offsets, strict=True):
            pump.copy(off, spec.n_bytes, None, [file_h, data_h])
            pump.hash_bytes([file_h], b"\0" * (pad(spec.n_bytes, align) - spec.n_bytes))
        slab_sha: dict[tuple[int, int], str] = {}
        for layer in src.moe_layers:
            for expert in range(src.n_expert):
                hs = [hashlib.sha256()]
                pump_slab(src, pump, layer, expert, None, hs)
                pump.drain()
                slab_sha[(layer, expert)] = hs[0].hexdigest()
                entry = by_key.get((layer, expert))
                if entry is None:
                    continue
                if entry.sha256 != slab_sha[(layer, expert)]:
                    problems.append(f"{entry.path}: the manifest's data hash differs from the source's bytes")
                want_head = hashlib.sha256(slab_header(src, layer, expert, manifest.fingerprint)).hexdigest()
                if entry.header_sha256 != want_head:
                    problems.append(
                        f"{entry.path}: the manifest's header hash differs from what the source gives"
                    )
        pump.drain()
    finally:
        pump.close()
    if file_h.hexdigest() != manifest.dense.sha256:
        problems.append(f"{manifest.dense.path}: the manifest's hash differs from what the source gives")
    fp = model_fingerprint(header_sha, data_h.hexdigest(), slab_sha)
    if fp != manifest.fingerprint:
        problems.append(
            f"fingerprint: the source gives {fp[:16]}..., the manifest says {manifest.fingerprint[:16]}..."
        )
    return problems
