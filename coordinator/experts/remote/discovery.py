"""Finding the swarm's nodes at start: static peers asked one by one, then mDNS until every needed slab has a
holder; the nodes of another model (or, with --numerics-class same, of another numerics class) passed over."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from swarm.compute.numclass import numerics_class, same_class
from swarm.coordinator.checks.audit import Auditor
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.coordinator.experts.remote.joins import JoinListener, Sources
from swarm.coordinator.experts.remote.placement import Placement, describe_missing
from swarm.node.auth import SwarmKey
from swarm.node.client import NodeCallError, NodeClient, ask_peer
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.sharding.errors import UserError
from swarm.sharding.identity import Match, ModelIdentity
from swarm.sharding.slabs import SlabKey

if TYPE_CHECKING:
    from swarm.node.discovery import DiscoveredNode, NodeBrowser

log = logging.getLogger(__name__)


@dataclass
class _Found:
    """The nodes taken so far, and those passed over (what the error says when too few are left)."""

    identity: ModelIdentity
    key: SwarmKey | None
    same_class_only: bool
    placement: Placement = field(default_factory=Placement)
    clients: dict[str, NodeClient] = field(default_factory=dict)
    by_header: list[str] = field(default_factory=list)  # nodes taken on the source GGUF's header hash alone
    strangers: list[str] = field(default_factory=list)  # peers of another model, passed over
    classes: dict[str, str] = field(default_factory=dict)  # address -> numerics class, of every node taken
    own_class: str = field(default_factory=numerics_class)
    other_class: set[str] = field(default_factory=set)  # passed over for --numerics-class same
    other_protocol: set[str] = field(default_factory=set)  # passed over: another swarm version

    def class_ok(self, address: str, cls: str) -> bool:
        if not self.same_class_only or same_class(cls, self.own_class):
            return True
        if address not in self.other_class:
            self.other_class.add(address)
            log.warning(
                "passing over node %s: its numerics class is %s, this coordinator's %s "
                "(--numerics-class same takes only bit-exact nodes)", address, cls or "not said", self.own_class,
            )  # fmt: skip
        return False

    def speaks_ours(self, address: str, version: int) -> bool:
        """Whether a node speaks this coordinator's protocol (a node refuses every call of another)."""
        if version == PROTOCOL_VERSION:
            return True
        if address not in self.other_protocol:
            self.other_protocol.add(address)
            log.warning(
                "passing over node %s: it speaks swarm protocol %d, this coordinator %d; run one swarm version "
                "on every device", address, version, PROTOCOL_VERSION,
            )  # fmt: skip
        return False

    def add(self, n: DiscoveredNode) -> None:
        """A node mDNS found (the browser only reports nodes that `identity` matches)."""
        if not self.speaks_ours(n.address, n.protocol_version):
            return
        if not self.class_ok(n.address, n.numerics_class):
            return
        self.classes[n.address] = n.numerics_class
        if n.address not in self.clients:
            self.clients[n.address] = NodeClient(
                n.address,
                fingerprint=n.identity.fingerprint,
                key=self.key,
                tls=n.tls,
                stream_port=n.stream_port,
                dial=n.dial,
            )
            if self.identity.match(n.identity) is Match.HEADER:
                self.by_header.append(n.address)
        self.placement.add(n.address, n.held)

    def ask(self, peer: str, wait: float) -> None:
        """A static peer: taken when it serves this model (and is of an accepted numerics class)."""
        try:
            client, info = ask_peer(peer, self.key, timeout=min(wait, 10.0) if wait > 0 else 10.0)
        except NodeCallError as e:
            raise UserError(
                f"peer {peer} does not answer ({e.code.name}); is `swarm node` running there?"
            ) from None
        match = self.identity.match(info.identity)
        if match is None:
            client.close()
            log.warning(
                "passing over peer %s: it serves another model (fingerprint %s, this swarm's is %s); "
                "start it on the same GGUF or shard directory",
                peer,
                info.fingerprint[:12],
                self.identity.fingerprint[:12],
            )
            self.strangers.append(peer)
            return
        if not self.speaks_ours(peer, info.protocol_version) or not self.class_ok(peer, info.numerics_class):
            client.close()
            return
        self.classes[peer] = info.numerics_class
        client.fingerprint = info.fingerprint  # what the node checks in every Compute call
        self.clients[peer] = client
        if match is Match.HEADER:
            self.by_header.append(peer)
        self.placement.add(peer, info.held)


def _browse(
    found: _Found,
    needed: Sequence[SlabKey],
    mdns: bool,
    interfaces: Sequence[str] | None,
    joins: JoinListener | None,
    wait: float,
) -> NodeBrowser | Sources | None:
    """mDNS (and nodes that join) until every needed slab has a holder or `wait` s pass; the sources go on
    after connect."""
    from swarm.node.discovery import MDNS_SETTLE_SECONDS, browse

    browser = browse(interfaces=interfaces, identity=found.identity, key=found.key) if mdns else None
    sources = Sources(browser, joins)
    if joins is not None:
        log.info("swarm: waiting up to %g s for nodes (joining on port %d)", wait, joins.port)
    waiter = browser if joins is None and browser is not None else sources  # (a browser wakes on news)
    if waiter.wait_for(lambda nodes: _take(found, nodes, needed), wait) is not None and browser is not None:
        # Other nodes answer the same query (the replicas a failover will need): take them too.
        time.sleep(min(MDNS_SETTLE_SECONDS, wait))
    for n in sources.nodes():
        found.add(n)
    return browser if joins is None else sources


def _take(found: _Found, nodes: list[DiscoveredNode], needed: Sequence[SlabKey]) -> bool:
    """The nodes taken; whether every needed slab has a holder now."""
    for n in nodes:
        found.add(n)
    return not found.placement.missing(needed)


def _give_up(
    found: _Found,
    missing: dict[int, list[int]],
    browser: NodeBrowser | Sources | None,
    mdns: bool,
    source: str,
) -> NoReturn:
    """Close what was opened and say which nodes to start."""
    if browser is not None:
        browser.close()
    for c in found.clients.values():
        c.close()
    if not found.clients:
        hint = "" if mdns else " (mDNS is off: give --peer host:port)"
        if found.strangers:
            hint += f" (passed over {', '.join(found.strangers)}: another model)"
        if found.other_class:
            hint += f" (passed over {', '.join(sorted(found.other_class))}: another numerics class, --numerics-class same)"
        if found.other_protocol:
            hint += f" (passed over {', '.join(sorted(found.other_protocol))}: another swarm version)"
        raise UserError(
            f"no swarm nodes found for this model{hint}. Start one with `swarm node {source} --experts 0-7` "
            "on this or another machine, or run with --local to compute the experts here"
        )
    raise UserError(describe_missing(missing, source))


# Builds the auditor once the nodes are found: from their numerics classes (the map the backend keeps
# current) and the ban to apply (the placement's); None where answers are not checked.
MakeChecker = Callable[[dict[str, str], Callable[[str], None]], Auditor | None]


def connect(
    needed: Sequence[SlabKey],
    identity: ModelIdentity | str,
    source: str,
    config: EngineConfig,
    make_checker: MakeChecker | None = None,
) -> SwarmExperts:
    """The swarm backend, complete: nodes found (`config.peers` asked one by one, then mDNS until every
    needed slab has a holder or `config.wait` s pass), with `config.listen` nodes that join too (swarm node
    --join: coordinator/experts/remote/joins.py), and their answers checked by what `make_checker` builds.

    A node is taken when `identity` matches its own (the same model, started on the GGUF or on its shard
    directory: see swarm.sharding.identity; a bare fingerprint string matches exactly that fingerprint). Each
    node's calls then carry the fingerprint that node itself reports, which it checks on every call.
    `config.same_class_only` (--numerics-class same): nodes of another numerics class than this process's
    ggml build (swarm.compute.numclass) are passed over, so that every answer is checked bit for bit.
    """
    if isinstance(identity, str):
        identity = ModelIdentity(identity)
    found = _Found(identity, config.key, config.same_class_only)
    joins = JoinListener(config.listen, config.key, identity, files=source) if config.listen else None
    try:
        for peer in config.peers:
            found.ask(peer, config.wait)
    except BaseException:
        if joins is not None:
            joins.close()
        raise
    browser: NodeBrowser | Sources | None = Sources(joins) if joins is not None else None
    if (config.mdns or joins is not None) and found.placement.missing(needed):
        browser = _browse(found, needed, config.mdns, config.mdns_interfaces, joins, config.wait)
    missing = found.placement.missing(needed)
    if missing:
        _give_up(found, missing, browser, config.mdns, source)
    if found.by_header:
        log.info(
            "swarm: %d of %d nodes recognised by the source GGUF's header hash only, not the fingerprint over "
            "every weight (a file with the same header but other weights would pass too): %s",
            len(found.by_header),
            len(found.clients),
            ", ".join(sorted(found.by_header)),
        )
    log.info("swarm: %d nodes cover %d slabs", len(found.clients), len(needed))
    auditor = make_checker(found.classes, found.placement.ban) if make_checker is not None else None
    return SwarmExperts(
        found.clients, found.placement, source, config, needed, browser, found.classes, auditor
    )
