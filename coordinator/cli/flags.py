"""The flags every coordinator command shares (`swarm run`, `logits`, `perplexity`, `demo`, `serve`,
`status`): finding nodes, computing, sampling, drafts and pictures, and the engine opened from them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from swarm.coordinator.cli.terminal import status_line
from swarm.coordinator.config import EngineConfig, Verify, Wire
from swarm.node.auth import add_key_argument, swarm_key
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError


def add_discovery_args(g: Any, wait: float, wait_help: str) -> None:
    """How nodes are found: mDNS (on which interfaces, for how long), static peers, the swarm key."""
    g.add_argument(
        "--peer", action="append", default=[], metavar="HOST:PORT", help="a node to use (repeatable)"
    )
    g.add_argument("--no-mdns", action="store_true", help="do not look for nodes by mDNS; use --peer only")
    g.add_argument(
        "--mdns-interface",
        action="append",
        default=None,
        metavar="ADDR",
        help="interface address to browse mDNS on (repeatable; default all)",
    )
    g.add_argument("--wait", type=float, default=wait, help=wait_help)
    add_key_argument(g)


def add_swarm_args(p: argparse.ArgumentParser) -> None:
    """Where the experts are computed: here (--local) or on nodes found by mDNS / given as peers."""
    g = p.add_argument_group("swarm")
    g.add_argument("--local", action="store_true", help="compute the experts in this process (no nodes)")
    add_discovery_args(g, 3.0, "seconds to wait for nodes to cover every expert")
    g.add_argument(
        "--listen",
        default=None,
        metavar="HOST:PORT",
        help="take nodes that dial out to this coordinator (`swarm node --join`, from behind NAT or where "
        "multicast does not reach, e.g. 0.0.0.0:7470; `swarm invite` prints what they need), and give those "
        "that fetch (--fetch) the manifest and expert slabs of the shard directory it runs on; needs --key-file",
    )
    g.add_argument(
        "--wire",
        choices=[w.value for w in Wire],
        default="f32",
        help="precision of rows on the wire; q8: the 8-bit blocks the experts' kernels quantize them to (Q8_K, "
        "Q8_0), about 3.9x smaller than f32 with the same answers in native numerics (float32 rows where a "
        "layer's experts have no such type, or with --exact), and the float32 answers packed (~15%% smaller, "
        "every bit kept): for slow links",
    )
    g.add_argument("--timeout", type=float, default=30.0, help="seconds before a node call fails over")
    g.add_argument(
        "--audit",
        type=float,
        default=None,
        metavar="RATE",
        help="share of decode answers also recomputed here, exactly, 0-1 (default: none with --verify project, "
        "0.05 with --verify sample, where every answer of a prompt pass is checked on one row per expert "
        "whatever the rate); a node caught is banned and the work its answers touched is done again. Nodes "
        "are also probed before first use. Needs the model's expert slabs here (a GGUF, or a shard directory "
        "with its experts/); 0: trust every answer (checks off, unless --verify pair or all)",
    )
    g.add_argument(
        "--verify",
        choices=[v.value for v in Verify],
        default="project",
        help="how answers are checked: project (the default: every answer, prompt and decode, checked by "
        "random projections against vectors kept here, a few dot products a row; one that fails is "
        "recomputed exactly before a node is banned), sample (--audit's share of decode answers, every "
        "prompt answer on one row per expert, recomputed), pair (every call also sent to a second holder, of the same numerics "
        "class where one exists, and the two compared: a disagreement is decided here), all (every answer "
        "recomputed here, whole: as slow as computing the experts here). See the README's table",
    )
    g.add_argument(
        "--numerics-class",
        choices=["any", "same"],
        default="any",
        help="any (default): nodes of every numerics class (CPU kind and ggml build; `swarm status` shows "
        "each node's), another class's answers checked within the kernels' error bound; same: only nodes of "
        "this coordinator's class, every answer checked bit for bit",
    )
    g.add_argument(
        "--degraded",
        action="store_true",
        help="when no live node holds an expert, leave it out and renormalize the weights of the experts that "
        "answered (hivemind's k_min) instead of waiting for a holder: answers go on, but differ from the "
        "model's (the run's report counts the pairs left out). Off by default",
    )
    g.add_argument(
        "--device", default=None, help="torch device for the dense path (default: cuda if present)"
    )
    add_numerics_args(g)


def add_picture_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The vision tower (an mmproj GGUF) that reads pictures, and how many rows a picture becomes."""
    g = p.add_argument_group("pictures (Qwen3.5 / Qwen3.6 with their mmproj)")
    found = "with --image, " if not serve else ""
    g.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help=f"the model's vision tower (mmproj GGUF); default: {found}the one file named mmproj*.gguf in the "
        "shard directory or beside the GGUF",
    )
    if serve:
        g.add_argument(
            "--no-mmproj", action="store_true", help="read no pictures, even with an mmproj beside"
        )
    g.add_argument("--image-min-tokens", type=int, default=None, metavar="N",
                   help="fewest rows a picture becomes (default: the mmproj's, else 8)")  # fmt: skip
    g.add_argument("--image-max-tokens", type=int, default=None, metavar="N",
                   help="most rows a picture becomes (default: the mmproj's, else 4096)")  # fmt: skip


def mmproj_of(args: argparse.Namespace) -> str | None:
    """The mmproj the flags ask for (--mmproj, or the one beside the model where pictures may come), or None."""
    from pathlib import Path

    from swarm.coordinator.text.pictures import find_mmproj

    given = getattr(args, "mmproj", None)
    if given is not None:
        if not Path(given).is_file():
            raise UserError(f"--mmproj {given}: no such file")
        return str(given)
    if getattr(args, "no_mmproj", False) or not (getattr(args, "image", None) or args.command == "serve"):
        return None
    found = find_mmproj(args.model)
    if found is not None:
        status_line(f"swarm {args.command}: reading pictures with {found}")
    return str(found) if found is not None else None


def add_numerics_args(g: Any) -> None:
    """How weights are multiplied (--exact) and on how many threads."""
    g.add_argument(
        "--exact",
        action="store_true",
        help="float32 math on exactly dequantized weights (the oracle that matches transformers; slower "
        "and float32-sized); default: every weight in its file type with ggml's kernels, as llama.cpp does",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads of this process, shared by torch and ggml (default: one per core)",
    )


def apply_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UserError("--threads must be at least 1")
    from swarm.compute.ggml import set_threads

    set_threads(threads)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    g.add_argument("--seed", type=int, default=None)
    add_draft_args(p)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafts (several tokens per pass; the text is the same as without)")
    g.add_argument(
        "--draft",
        choices=["ngram", "none"],
        default="ngram",
        help="ngram (default): where the last tokens occurred earlier in the conversation, the tokens that "
        "followed are checked as drafts in the next pass; none: one token a pass",
    )
    g.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="N drafts per step from the model's own MTP head (Qwen3.5/3.6, Qwen3-Next GGUFs that carry it; "
        "its experts go to the nodes like any layer's); takes the place of --draft. 0 (default): off",
    )
    g.add_argument(
        "--draft-max",
        type=int,
        default=3,
        metavar="K",
        help="most drafts a pass checks per sequence (default 3)",
    )


def drafter_from_args(args: argparse.Namespace, engine: Any = None) -> tuple[Any, Any]:
    """(the prompt-lookup drafter `--draft` / `--draft-max` ask for, the MTPDrafter `--mtp` asks for), each
    or None; MTP, where the engine has a head, in place of the lookup."""
    from swarm.coordinator.drafts.lookup import PromptLookup

    if args.draft_max < 0 or args.mtp < 0:
        raise UserError("--draft-max and --mtp must be 0 or more")
    if args.mtp and engine is not None and engine.mtp_head is not None:
        from swarm.coordinator.drafts.mtp import MTPDrafter

        return None, MTPDrafter(engine.mtp_head, args.mtp)
    if args.draft == "none" or args.draft_max == 0:
        return None, None
    return PromptLookup(args.draft_max), None


def mtp_missing(path: str) -> str | None:
    """Why the model at `path` (a GGUF or shard directory) has no MTP head swarm runs, or None if it has."""
    from gguf import Keys

    from swarm.coordinator.loader import resolve_gguf
    from swarm.sharding.gguf_io import architecture, open_gguf, read_metadata

    gguf_path = resolve_gguf(path)
    meta = read_metadata(open_gguf(gguf_path))
    arch = architecture(meta, gguf_path)
    if arch not in ("qwen35moe", "qwen3next"):
        return f"{arch} models have no MTP head that swarm runs"
    if not int(meta.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0) or 0):
        return f"the file has no MTP block ({arch}.nextn_predict_layers is 0 or missing)"
    return None


def audit_rate(rate: float) -> float:
    if not 0.0 <= rate <= 1.0:
        raise UserError(
            f"--audit {rate}: give a share between 0 (trust every node) and 1 (check every answer)"
        )
    return rate


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the flags ask for (`swarm run`, `logits`, `perplexity`, `serve`, ...)."""
    mtp = getattr(args, "mtp", 0) > 0
    if mtp and (why := mtp_missing(args.model)) is not None:
        print(f"swarm {args.command}: --mtp: {why}; decoding without MTP drafts", file=sys.stderr)
        mtp = False
    return EngineConfig(
        local=args.local,
        device=args.device,
        numerics=Numerics.of(args.exact),
        wire=Wire(args.wire),
        progress=True,
        mtp_head=mtp,
        mmproj=mmproj_of(args),
        image_tokens=(getattr(args, "image_min_tokens", None), getattr(args, "image_max_tokens", None)),
        peers=tuple(args.peer),
        mdns=not args.no_mdns,
        mdns_interfaces=args.mdns_interface,
        listen=args.listen,
        wait=args.wait,
        key=swarm_key(args, args.command),
        same_class_only=args.numerics_class == "same",
        timeout=args.timeout,
        degraded=args.degraded,
        audit_rate=None if args.audit is None else audit_rate(args.audit),
        verify=Verify(args.verify),
    )


def open_from_args(args: argparse.Namespace) -> Any:
    from swarm.compute.malloc import keep_freed_memory
    from swarm.coordinator.engine import open_engine
    from swarm.coordinator.experts.remote.dispatch import SwarmExperts

    keep_freed_memory()  # a pass finds the memory the pass before it freed (before the model allocates)
    where = "experts in this process" if args.local else "looking for nodes"
    status_line(f"swarm {args.command}: opening {args.model} ({where}) ...")
    apply_threads(args.threads)
    config = config_from_args(args)
    engine = open_engine(args.model, config)
    if isinstance(engine.experts, SwarmExperts):
        n = len(engine.experts.clients)
        nodes = "1 node holds" if n == 1 else f"{n} nodes hold"
        status_line(f"swarm {args.command}: {nodes} every expert; model on {engine.device}")
        if config.key is None:
            print(
                f"swarm {args.command}: warning: no swarm key: these are OPEN nodes (started without a key), "
                "which anyone who reaches them can use; see `swarm keygen`",
                file=sys.stderr,
            )
    from swarm.compute.heap import freeze_startup

    freeze_startup()  # the model is built: the collector need not walk it again while it serves
    return engine


def sampling_from_args(args: argparse.Namespace, stop_ids: frozenset[int]) -> Any:
    from swarm.coordinator.decode.one import SamplingParams

    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_ids=stop_ids,
    )

