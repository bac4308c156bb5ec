"""Shared test helpers: where the reference fixtures live, a model's swarm of local node processes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def flip_bytes(path: Path, start: int, end: int | None = None, every: int = 97, mask: int = 0x5A) -> None:
    """XOR `mask` into one byte in `every` of [start + 7, end) of a file, in place (a running node may have
    it mapped); the same call again puts the file back as it was."""
    end = Path(path).stat().st_size if end is None else end
    with open(path, "r+b") as f:
        for at in range(start + 7, end, every):
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ mask]))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@contextmanager
def node_swarm(model: Path, tmp: Path, ranges: Sequence[str]) -> Iterator[tuple[Path, list[str]]]:
    """The model sharded into tmp and a node process per expert range (`--experts RANGE`); (the shard
    directory, the `--peer ADDRESS` flags that name the nodes). The nodes stop on the way out."""
    from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
    from swarm.sharding.shard import shard_model

    shard = tmp / "m.swarm"
    shard_model(model, shard)
    nodes = start_nodes([(shard, ["--experts", r]) for r in ranges], tmp / "nodes")
    try:
        yield shard, [a for n in nodes for a in ("--peer", n.address)]
    finally:
        stop_nodes(nodes)
