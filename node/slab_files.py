"""A serving node's slab files: the manifest they verified against, the files it gives out (swarm.node.files)
and its watch over them (swarm.node.selfcheck), kept in step with its store: a slab whose file fails is
served and given out no more, and is taken back once its file matches again."""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from swarm.node.selfcheck import SlabSelfCheck
    from swarm.sharding.manifest import Manifest, SlabEntry


def verified_manifest(args: argparse.Namespace) -> Manifest | None:
    """The manifest a node's slabs verified against (None for a whole GGUF or --no-verify)."""
    from swarm.sharding.manifest import read_manifest

    if not Path(args.source).is_dir() or args.no_verify:
        return None
    return read_manifest(args.source)


def shard_files(args: argparse.Namespace, store: Any, manifest: Manifest | None) -> Any:
    """The files a node on a verified shard directory gives out (None for a whole GGUF or --no-verify)."""
    from swarm.node.files import ShardFiles

    if manifest is None:
        return None
    files = ShardFiles(args.source)
    for layer, expert in store.held():
        entry = manifest.slab(layer, expert)
        assert entry is not None  # the store holds only slabs that verified against this manifest
        files.add_slab(layer, expert, entry.size)
    return files


def start_self_check(
    args: argparse.Namespace,
    store: Any,
    files: Any,
    manifest: Manifest | None,
    checked_from: int,
    changed: threading.Event,
) -> SlabSelfCheck | None:
    """The watch over the slab files the node serves (swarm.node.selfcheck), started; None when --recheck 0,
    or when there is nothing to check against (a whole GGUF, --no-verify). A slab whose file fails is taken
    out of the store and of the files given out, and `changed` says so to the loop that announces the node."""
    from swarm.node.selfcheck import SlabSelfCheck
    from swarm.sharding.slabs import read_slab_file

    if manifest is None or not args.recheck:
        return None
    directory = Path(args.source)

    def failed(entry: SlabEntry, why: str) -> None:
        store.remove((entry.layer, entry.expert))
        files.remove_slab(entry.layer, entry.expert)
        log.error(
            "slab %d:%d failed its check and is no longer served or announced: %s. Restore the file from a "
            "good copy (this node serves the slab again once it matches the manifest), or fetch it again: "
            "restart this node with --fetch, which fetches from the swarm every slab whose file does not "
            "match",
            entry.layer, entry.expert, why,
        )  # fmt: skip
        changed.set()

    def restored(entry: SlabEntry) -> None:
        store.add((entry.layer, entry.expert), read_slab_file(directory / entry.path))
        files.add_slab(entry.layer, entry.expert, entry.size)
        log.warning(
            "slab %d:%d: %s matches the manifest again; serving it again",
            entry.layer, entry.expert, directory / entry.path,
        )  # fmt: skip
        changed.set()

    check = SlabSelfCheck(directory, args.recheck, failed, restored)
    for layer, expert in store.held():
        entry = manifest.slab(layer, expert)
        assert entry is not None  # the store holds only slabs that verified against this manifest
        check.watch(entry, checked_from)
    return check.start()
