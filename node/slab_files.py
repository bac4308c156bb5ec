"""A serving node's slab files: the manifest they verify against, the files it gives out (swarm.node.files),
their check before first use (swarm.node.first_use) and the watch over them (swarm.node.selfcheck), kept in
step with its store: a slab whose file fails is served and given out no more, and is taken back once its
file matches again."""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from swarm.node.first_use import FirstUse
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
        assert entry is not None  # the store holds only slabs of this manifest
        files.add_slab(layer, expert, entry.size)
    return files


class _Keeper:
    """What a node does when a slab's file fails its check or matches again: its store and the files it
    gives out follow, and `changed` tells the loop that announces the node."""

    def __init__(self, directory: Path, store: Any, files: Any, changed: threading.Event) -> None:
        self.directory, self.store, self.files, self.changed = directory, store, files, changed

    def failed(self, entry: SlabEntry, why: str) -> None:
        self.store.remove((entry.layer, entry.expert))
        self.files.remove_slab(entry.layer, entry.expert)
        log.error(
            "slab %d:%d failed its check and is no longer served or announced: %s. Restore the file from a "
            "good copy (this node serves the slab again once it matches the manifest), or fetch it again: "
            "restart this node with --fetch, which fetches from the swarm every slab whose file does not "
            "match",
            entry.layer, entry.expert, why,
        )  # fmt: skip
        self.changed.set()

    def restored(self, entry: SlabEntry) -> None:
        from swarm.sharding.slabs import read_slab_file

        self.store.add((entry.layer, entry.expert), read_slab_file(self.directory / entry.path))
        self.files.add_slab(entry.layer, entry.expert, entry.size)
        log.warning(
            "slab %d:%d: %s matches the manifest again; serving it again",
            entry.layer, entry.expert, self.directory / entry.path,
        )  # fmt: skip
        self.changed.set()


def start_self_check(
    args: argparse.Namespace,
    store: Any,
    files: Any,
    manifest: Manifest | None,
    checked_from: int | None,
    changed: threading.Event,
) -> SlabSelfCheck | None:
    """The watch over the slab files the node serves (swarm.node.selfcheck), started; None when --recheck 0,
    or when there is nothing to check against (a whole GGUF, --no-verify). A slab whose file fails is taken
    out of the store and of the files given out, and `changed` says so to the loop that announces the node.
    `checked_from`: when every held slab was hashed (the watch starts from there); None: none was yet, and
    each is watched once it verifies before its first use (start_first_use)."""
    from swarm.node.selfcheck import SlabSelfCheck

    if manifest is None or not args.recheck:
        return None
    keeper = _Keeper(Path(args.source), store, files, changed)
    check = SlabSelfCheck(keeper.directory, args.recheck, keeper.failed, keeper.restored)
    if checked_from is not None:
        for layer, expert in store.held():
            entry = manifest.slab(layer, expert)
            assert entry is not None  # the store holds only slabs that verified against this manifest
            check.watch(entry, checked_from)
    return check.start()


def start_first_use(
    args: argparse.Namespace,
    store: Any,
    files: Any,
    manifest: Manifest | None,
    check: SlabSelfCheck | None,
    changed: threading.Event,
    unverified: bool,
) -> FirstUse:
    """The start-up pass over the node's slabs (swarm.node.first_use), started: with `unverified` (the slabs
    of a shard directory, mapped and not read yet), each is hashed against `manifest` before its first use;
    a slab that fails is dropped as the self-check drops one and watched for its repair, one that passes is
    handed to the self-check."""
    from swarm.node.first_use import FirstUse

    entries = []
    if unverified and manifest is not None:
        entries = [e for e in (manifest.slab(la, ex) for la, ex in store.held()) if e is not None]
    keeper = _Keeper(Path(args.source), store, files, changed)

    def failed(entry: SlabEntry, why: str, since: int) -> None:
        keeper.failed(entry, why)
        if check is not None:
            check.watch(entry, since, failed=True)

    def verified(entry: SlabEntry, since: int) -> None:
        if check is not None:
            check.watch(entry, since)

    return FirstUse(store, args.source, entries, failed, verified).start()
