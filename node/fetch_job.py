"""What a fetch is to do in its directory, sorted out before any slab is fetched: the directory held for
this node, the model chosen among the sources', the manifest in place (fetched first, whole, checked, written
atomically), and the requested slabs sorted into those already here, those to fetch, and problems."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.node.errors import NodeCallError
from swarm.node.fetch_sources import Sources, parse_manifest, read_whole
from swarm.sharding.errors import UserError
from swarm.sharding.manifest import (
    MANIFEST_NAME,
    Manifest,
    SlabEntry,
    atomic_write_bytes,
    read_manifest,
)
from swarm.sharding.ranges import format_slabs
from swarm.sharding.slabs import SlabKey, check_slab_file

log = logging.getLogger(__name__)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the directory for one fetching node (a second one would write the same partial files)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"{directory}: another `swarm node --fetch` is fetching into it") from None
        yield
    finally:
        os.close(fd)


def local_manifest(directory: Path) -> Manifest | None:
    """The manifest already in `directory` (an earlier fetch, or a copy); None for an empty directory."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory}: not a directory; --fetch fills a directory (give an empty one)")
    if (directory / MANIFEST_NAME).exists():
        return read_manifest(directory)
    # a manifest.json.tmp-PID is what an interrupted atomic write of the manifest leaves: not the user's
    if directory.exists() and any(
        not p.name.startswith(MANIFEST_NAME + ".tmp-") for p in directory.iterdir()
    ):
        raise UserError(
            f"{directory}: is not empty and holds no {MANIFEST_NAME}; give --fetch an empty directory "
            "(or the one an earlier --fetch filled)"
        )
    return None


def choose_model(sources: Sources, have: Manifest | None, fingerprint: str | None) -> str:
    """The fingerprint to fetch: the directory's model, else the one asked for (a prefix will do), else the
    only model the sources serve; a UserError when that is not clear or nobody serves it (with none found,
    a directory's own model stands: what it still lacks is refused later, slab by slab)."""
    found = sources.all()
    served = sorted({s.fingerprint for s in found})
    where = ", ".join(
        f"{fp[:12]} at {next(s.address for s in found if s.fingerprint == fp)}" for fp in served
    )
    if not found and have is not None and not fingerprint:
        sources.fingerprint = have.fingerprint  # nothing may be left to fetch: the job decides
        return have.fingerprint
    if not found:
        raise UserError(
            "no source found to fetch from: start `swarm node` on a shard directory (any node that holds the "
            "slabs) and give it with --peer HOST:PORT, or let mDNS find it (same swarm key, same network)"
        )
    if have is not None:
        if fingerprint and not have.fingerprint.startswith(fingerprint):
            raise UserError(
                f"the directory holds model {have.fingerprint[:12]}, not {fingerprint[:12]}; give --fetch an "
                "empty directory for another model"
            )
        want = have.fingerprint
    elif fingerprint:
        matches = [fp for fp in served if fp.startswith(fingerprint)]
        if len(matches) != 1:
            raise UserError(f"no single source model matches {fingerprint[:12]} (sources serve {where})")
        want = matches[0]
    elif len(served) > 1:
        raise UserError(
            f"the sources serve {len(served)} models ({where}); say which with --fingerprint or a --plan of it"
        )
    else:
        want = served[0]
    if want not in served:
        what = "the directory's model" if have is not None else "model"
        raise UserError(f"no source serves {what} {want[:12]} (sources serve {where})")
    sources.fingerprint = want
    return want


def ensure_manifest(directory: Path, sources: Sources, have: Manifest | None) -> Manifest:
    """The directory's manifest, fetched first (whole, checked, written atomically) when it has none."""
    if have is not None:
        return have
    candidates = sorted(sources.all(), key=lambda s: -len(s.held))  # a full shard directory's first
    errors = []
    for s in candidates:
        try:
            data = s.manifest if s.manifest is not None else read_whole(sources.client(s), MANIFEST_NAME)
            manifest = parse_manifest(data, s.address)
        except (NodeCallError, ValueError, UserError) as e:
            errors.append(f"{s.address}: {e}")
            continue
        if manifest.fingerprint != sources.fingerprint:
            errors.append(f"{s.address}: its manifest is of model {manifest.fingerprint[:12]}")
            continue
        atomic_write_bytes(directory / MANIFEST_NAME, data)
        log.info("fetched %s (%d bytes) from %s", MANIFEST_NAME, len(data), s.address)
        return manifest
    raise UserError(f"could not fetch {MANIFEST_NAME} from any source: {'; '.join(errors)}")


@dataclass
class FetchJob:
    """What a fetch is to do in its directory: slabs here and verified, slab files to fetch, and requested
    slabs the model (or the manifest) does not have."""

    present: list[SlabEntry]
    to_fetch: list[SlabEntry]
    problems: list[str] = field(default_factory=list)


def plan_fetch(directory: Path, manifest: Manifest, wanted: Iterable[SlabKey]) -> FetchJob:
    """Sort the requested slabs into those already here (their file verifies), those to fetch, and problems."""
    job = FetchJob([], [])
    moe = set(manifest.moe_layers)
    for layer, expert in sorted(set(wanted)):
        if layer not in moe:
            job.problems.append(f"layer {layer} expert {expert}: the model has no experts in layer {layer}")
        elif expert >= manifest.n_expert:
            job.problems.append(
                f"layer {layer} expert {expert}: the model has only {manifest.n_expert} experts per layer"
            )
        elif (entry := manifest.slab(layer, expert)) is None:
            job.problems.append(
                f"layer {layer} expert {expert}: not in the manifest the sources gave (their shard directory "
                "was cut with --layers/--experts)"
            )
        elif (directory / entry.path).exists() and check_slab_file(directory, entry) is None:
            job.present.append(entry)
        else:
            job.to_fetch.append(entry)
    return job


def missing_holders(sources: Sources, entries: Iterable[SlabEntry]) -> list[SlabKey]:
    return [(e.layer, e.expert) for e in entries if not sources.holders((e.layer, e.expert))]


def wait_for_holders(sources: Sources, entries: Sequence[SlabEntry], wait: float) -> None:
    """Return once every slab to fetch has a holder among the sources; a UserError naming those without one
    after `wait` s."""
    sources.wait_for(lambda _: not missing_holders(sources, entries), wait)
    missing = missing_holders(sources, entries)
    if missing:
        raise UserError(
            f"no source holds {len(missing)} of the slabs to fetch ({format_slabs(missing)}); start a node that "
            "holds them (or give it with --peer), or ask for fewer slabs"
        )
