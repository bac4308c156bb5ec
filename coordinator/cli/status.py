"""`swarm status`: which nodes are out there, what they hold, what they have done, and whether a model is
covered.

    swarm status                    every node mDNS finds (any model), one line each
    swarm status q36.swarm          the nodes of that model, and whether every expert has a holder
    swarm status q36.swarm --json   the same for scripts: nodes, their load and answers, the coverage map
                                    (coordinator/serve/swarm_view.py: the structure `swarm serve`'s /swarm.json has)

Nodes are found as a coordinator finds them (mDNS, and --peer for those it does not reach) and asked for
their Info and Stats over gRPC. With a model, the exit status says whether a coordinator could start on
it now: 0 when every expert has a holder, 1 when some have none (they are named).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from swarm.compute.numclass import numerics_class, same_class
from swarm.coordinator.cli.flags import add_discovery_args
from swarm.coordinator.serve import swarm_view
from swarm.node.auth import swarm_key
from swarm.sharding.errors import UserError
from swarm.sharding.identity import first_mtp_layer, model_identity
from swarm.sharding.ranges import format_ranges


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="the nodes of a swarm: what each holds and has done, and whether a model is covered",
        description=(
            "Lists the swarm nodes found by mDNS (and given with --peer): address, model, held slabs, device, "
            "memory budget, calls served, cache hit rate. Given a model (GGUF or shard directory), lists only "
            "its nodes and says whether every expert has a holder and how many replicas each has; where its "
            "expert slabs are here too, each node is probed (known rows through a few of its slabs, checked "
            "against the model's own) and a node whose answers differ is reported BANNED and not counted."
        ),
    )
    p.add_argument("model", nargs="?", default=None, help="a GGUF or `swarm shard` directory (optional)")
    p.add_argument("--no-probe", action="store_true", help="do not probe the nodes' answers")
    p.add_argument("--json", action="store_true", help="the nodes and the coverage map as JSON (for scripts)")
    p.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="ask a running `swarm serve` at URL (its /swarm.json) for the nodes it uses instead, nodes that "
        "joined it with `swarm node --join` included (no one else can reach those)",
    )
    add_discovery_args(p, 2.0, "seconds to listen for nodes")
    p.set_defaults(func=cmd_status)


def _from_server(url: str, as_json: bool) -> int:
    """The server's own view of its swarm; 0 when every expert has a live holder, 1 when not."""
    import urllib.error
    import urllib.request

    where = url.rstrip("/") + "/swarm.json"
    try:
        with urllib.request.urlopen(where, timeout=10) as answer:
            report = json.load(answer)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UserError(f"no swarm map at {where} ({e}); is `swarm serve` running there?") from None
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        _print_nodes(report["nodes"])
        print("\ncoverage (slabs with 0 / 1 / 2+ live holders):")
        for line in _coverage_lines(report["coverage"]):
            print(f"  {line}")
    return 1 if any(row["none"] for row in report["coverage"]) else 0


def cmd_status(args: argparse.Namespace) -> int:
    from swarm.coordinator.experts.remote.placement import describe_missing
    from swarm.node.client import NodeCallError, NodeClient
    from swarm.node.discovery import browse

    if args.server:
        return _from_server(args.server, args.json)
    identity, needed = model_identity(args.model) if args.model else (None, [])
    key = swarm_key(args, "status")
    addresses: list[str] = list(dict.fromkeys(args.peer))
    found: dict[str, bool] = {}  # address -> serves TLS, as its mDNS record says
    if not args.no_mdns:
        with browse(interfaces=args.mdns_interface, identity=identity, key=key) as browser:
            browser.wait_for(lambda _nodes: False, args.wait)  # listen the whole time: count every answer
            found = {n.address: n.tls for n in browser.nodes()}
            addresses += [a for a in found if a not in addresses]
    if not addresses:
        where = "given with --peer" if args.no_mdns else f"found by mDNS in {args.wait:g} s"
        raise UserError(
            f"no swarm nodes {where}" + (f" for {args.model}" if args.model else "")
            + "; start one with `swarm node MODEL --experts 0-7`, or give --peer host:port"
            + ("" if key else " (nodes started with a swarm key show only with that --key-file)")
        )  # fmt: skip

    auditor = _auditor(args.model) if args.model and not args.no_probe else None
    holders: Counter[tuple[int, int]] = Counter()
    nodes: list[dict[str, Any]] = []
    every_stats = []
    layer_bytes = swarm_view.layer_slab_bytes(args.model) if args.model else None
    for address in addresses:
        client = NodeClient(address, key=key, tls=found.get(address))
        try:
            info = client.info(timeout=5.0)
            stats = client.stats(timeout=5.0)
            if identity is not None and identity.match(info.identity) is None:
                continue  # a static peer of another model
            checked = _probe(auditor, client, info)
        except NodeCallError as e:
            nodes.append(swarm_view.node_record(address, None, None, answering=False, error=e.code.name))
            continue
        finally:
            client.close()
        if not checked.startswith("BANNED"):
            holders.update(info.held)
        every_stats.append(stats)
        why = checked.split(": ", 1)[1] if checked.startswith("BANNED") else None
        nodes.append(swarm_view.node_record(
            address, info, stats, answers=checked.split(":")[0], banned_because=why, layer_bytes=layer_bytes
        ))  # fmt: skip
    report = swarm_view.snapshot(
        args.model, nodes, needed, holders, swarm_view.routing_from_nodes(every_stats)
    )
    coverage = report["coverage"]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_nodes(nodes)
    if identity is None:
        return 0
    missing: dict[int, list[int]] = {}
    for layer, expert in needed:
        if not holders[(layer, expert)]:
            missing.setdefault(layer, []).append(expert)
    first_mtp = first_mtp_layer(args.model)  # its layers only runs with MTP drafts (--mtp) need
    drafts_only = {layer: es for layer, es in missing.items() if first_mtp is not None and layer >= first_mtp}
    missing = {layer: es for layer, es in missing.items() if layer not in drafts_only}
    if args.json:
        return 1 if missing else 0
    print("\ncoverage (slabs with 0 / 1 / 2+ live holders):")
    for line in _coverage_lines(coverage):
        print(f"  {line}")
    if missing:
        print(f"\nnot covered: {describe_missing(missing, args.model)}")
        return 1
    used = [k for k in needed if k[0] not in drafts_only]
    replicas = Counter(holders[k] for k in used)
    spread = ", ".join(f"{n} with {k} holder{'s' if k > 1 else ''}" for k, n in sorted(replicas.items()))
    what = "every expert a run without --mtp uses" if drafts_only else "every expert"
    print(f"\n{what} of {args.model} has a holder: {len(used)} slabs, {spread}")
    if drafts_only:
        print(f"for --mtp (the MTP block's layer, which only drafts use): {describe_missing(drafts_only, args.model)}")
    return 0


def _coverage_lines(coverage: list[dict[str, int]]) -> list[str]:
    """Runs of layers with the same counts as one line: "layers 0-39: 0 / 128 / 128"."""
    lines: list[str] = []
    run: list[int] = []
    counts: tuple[int, int, int] | None = None
    for c in [*coverage, None]:
        this = (c["none"], c["one"], c["two_or_more"]) if c is not None else None
        if this != counts and run and counts is not None:
            lines.append(f"layers {format_ranges(run)}: {counts[0]} / {counts[1]} / {counts[2]}")
            run = []
        if c is not None:
            run.append(c["layer"])
            counts = this
    return lines


def _print_nodes(nodes: list[dict[str, Any]]) -> None:
    rows = []
    for n in nodes:
        if not n["answering"]:
            rows.append([n["address"], "-", f"not answering: {n['error']}", "", "", "", "", "", "", "", ""])
            continue
        if n["banned_because"]:
            print(f"{n['address']}: BANNED: {n['banned_because']}")
        if n["dropped_slabs"]:
            k = n["dropped_slabs"]
            print(
                f"{n['address']}: dropped {k} slab{'s' if k > 1 else ''} (failed their check): {n['dropped']}"
            )
        held = n["held"] if len(n["held"]) <= 40 else n["held"][:37] + "..."
        hit = n["cache_hit_rate"]
        ms = n["ms_per_call"]
        rows.append([
            n["address"], n["fingerprint"][:12], held, n["device"], _short_class(n["numerics_class"]),
            _size(n["memory_budget_bytes"]),
            f"{n['calls']:,}", f"{100 * n['load']:.0f}%", f"{ms:.1f}" if ms is not None else "-",
            f"{100 * hit:.0f}%" if hit is not None else "-", n["answers"],
        ])  # fmt: skip
    header = ["node", "model", "holds (layers:experts)", "device", "numerics", "memory", "calls", "load", "ms/call",
              "cache hits", "answers"]  # fmt: skip
    _table(header, rows)


def _auditor(model: str) -> Any:
    """The model's own slabs to probe the nodes with; None where this install has no coordinator (torch)."""
    try:
        import torch  # noqa: F401 - whether this install has the coordinator's packages
    except ImportError:
        print(
            "swarm status: the nodes' answers are not probed: that needs the coordinator's packages "
            "(pip install 'swarm-moe[coordinator]'); --no-probe says so without this note",
            file=sys.stderr,
        )
        return None
    from swarm.coordinator.checks.audit import make_auditor
    from swarm.coordinator.config import EngineConfig, Verify

    # the probe recomputes its answers exactly: no projection vectors to make (they would read every slab)
    return make_auditor(model, EngineConfig(audit_rate=1.0, verify=Verify.SAMPLE))


STATUS_PROBE_SLABS = 32  # a status check has time to look further than a coordinator's admission probe


def _probe(auditor: Any, client: Any, info: Any) -> str:
    """Known rows through a few of the node's slabs, checked against the model's own: "ok", "BANNED: why", or
    "-" when nothing here can check it (no model given, or no slabs of it here)."""
    if auditor is None:
        return "-"

    def compute(layer: int, ids: list[int], counts: list[int], rows: Any) -> Any:
        return client.compute(layer, ids, counts, rows, 30.0)

    if not any(auditor.store.holds(*k) for k in info.held):
        return "-"
    auditor.classes[info.address] = info.numerics_class  # another class is checked within the error bound
    if auditor.probe(info.address, sorted(info.held), compute, info.hidden_size, STATUS_PROBE_SLABS):
        return "ok"
    return f"BANNED: {auditor.report.banned[info.address]}"


def _short_class(cls: str) -> str:
    """A numerics class as the table shows it: the CPU kind and features, marked when it is this machine's
    (answers checked bit for bit); the ggml version is in --json."""
    if not cls:
        return "?"
    return cls.split(" / ")[0] + (" (=)" if same_class(cls, numerics_class()) else "")


def _size(n: int) -> str:
    if not n:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    sys.stdout.flush()
