"""`swarm serve`: the OpenAI-compatible server (coordinator/serve/api.py) over the scheduler."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from swarm.coordinator.cli.flags import add_draft_args, add_picture_args, add_swarm_args, drafter_from_args
from swarm.node.auth import is_loopback_host
from swarm.sharding.errors import UserError

T = TypeVar("T")

log = logging.getLogger(__name__)

# Of the memory available when the server starts, what the slots' states may take (the rest: activations,
# the tokenizer, the HTTP side, whatever else runs).
STATE_SHARE = 0.8
COVERAGE_CACHE_SECONDS = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server for many users at once",
        description=(
            "Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), "
            "streaming as server-sent events, plus /health and /metrics (Prometheus). Up to --parallel "
            "conversations decode together: every step carries one token of each, so each MoE layer makes one "
            "call per node for all of them, and new prompts are read in chunks between steps. Every request "
            "gets exactly the tokens it would get alone. A conversation sent again continues from the state "
            "its slot holds instead of reading the history again."
        ),
    )
    p.add_argument("model", metavar="DIR_OR_GGUF", help="shard directory or .gguf model")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one)")
    g.add_argument(
        "--parallel", type=int, default=4, help="conversations decoded together (slots, default 4)"
    )
    g.add_argument(
        "--ctx-size",
        type=int,
        default=4096,
        help="most tokens one conversation holds, prompt + answer (default 4096)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (default: $SWARM_API_KEY; none: no check)",
    )
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot before 429s")
    g.add_argument(
        "--groups",
        default="auto",
        metavar="auto|N",
        help="split each pass's conversations into N groups in flight at once (one waits for its layer's "
        "answers while another computes); auto (default): measured, by the share of a pass spent waiting "
        "on the nodes (slow links: several; fast links and --local: one)",
    )
    g.add_argument(
        "--model-id", default=None, help="the model's id in the API (default: the file or directory name)"
    )
    g.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="add how often the router picked each (layer, expert) to this JSON file at exit (`swarm plan --stats`)",
    )
    g.add_argument(
        "--ready-file", type=Path, default=None, help="write JSON (url, port, ...) here once serving"
    )
    g.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this server is gone (for servers that tools start)",
    )
    add_draft_args(p)
    add_swarm_args(p)
    add_picture_args(p, serve=True)
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch pictures that chat requests give as http(s) URLs (default: only data: URLs, the picture "
        "itself in the request)",
    )
    p.add_argument(
        "--reasoning-format",
        choices=("auto", "deepseek", "none"),
        default="auto",
        help="where a chat answer's thinking (<think>...</think>) goes: auto and deepseek (default auto): apart, "
        "in the message's reasoning_content; none: left in content as the model wrote it. A request's "
        "'reasoning_format' overrides it",
    )
    p.set_defaults(func=cmd_serve)


def model_id_of(path: str) -> str:
    name = Path(path.rstrip("/")).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def available_memory(device: Any) -> int | None:
    """Bytes free for new tensors on the device (CUDA: its free memory; CPU: MemAvailable), or None."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _watch_parent(parent: int) -> None:
    """The launcher is gone: shut down as on SIGTERM (gracefully)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def _off_main_thread(work: Callable[[], T]) -> T:
    """work() on a thread of its own that then ends. The model's steps run on the scheduler's thread; a thread
    that has run parallel work keeps an OpenMP team while it lives, and with two teams on the machine's cores
    libgomp stops spinning at barriers, which slows every step (bench/serve; docs/BENCHMARKS.md); a thread that
    ends gives its team back. A daemon thread, so that Ctrl-C during a long load ends the process."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    t = threading.Thread(target=run, name="swarm-serve-load", daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return done[0]


def cmd_serve(args: argparse.Namespace) -> int:
    from swarm.compute.openmp import set_wait_policy

    set_wait_policy(experts_remote=not args.local)  # before torch loads: it is read once, then
    import uvicorn

    from swarm.coordinator.cli.flags import open_from_args
    from swarm.coordinator.serve.api import ServeConfig, build_app
    from swarm.coordinator.serve.metrics import ServeMetrics
    from swarm.coordinator.serve.scheduler import Scheduler

    _check_args(args)
    api_key = args.api_key or os.environ.get("SWARM_API_KEY") or None
    sock = _listen(args.host, args.port)  # first: a port in use is found before minutes of loading
    parent = os.getppid() if args.exit_with_parent else None
    engine = _off_main_thread(lambda: open_from_args(args))
    stats_of = None
    scheduler = None
    try:
        checker = engine.checker
        per_slot = _slot_memory(engine, args.parallel, args.ctx_size)
        admit_check = _coverage_check(engine, args.model)
        drafter, mtp_drafter = drafter_from_args(args, engine)
        scheduler = Scheduler(
            engine.model, engine.device, checker, args.parallel, args.ctx_size, args.max_queue, admit_check,
            drafter=drafter, mtp_drafter=mtp_drafter, groups=_grouping(engine, args.groups),
        )  # fmt: skip
        scheduler.start(_warm_up(engine, args.parallel))
        if args.stats:  # after the warm-up, which would count as routing
            from swarm.coordinator.experts.backend import RoutingStats

            stats_of = RoutingStats(engine.experts)
            engine.model.set_experts(stats_of)
            if engine.mtp_head is not None:
                engine.mtp_head.set_experts(stats_of)
        config = ServeConfig(
            model_id=args.model_id or model_id_of(args.model), api_key=api_key, ctx_size=args.ctx_size,
            allow_image_urls=args.allow_image_urls, reasoning_format=args.reasoning_format,
            invite=_invite(args, engine),
        )  # fmt: skip
        metrics = ServeMetrics(engine.experts, scheduler)
        app = build_app(engine, scheduler, config, metrics)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM (in-flight requests get up to 10 s), then raises the
        # signal again under the handler that was there before: a SIGTERM handler that returns lets the
        # cleanup below run (slots, node channels, --stats) instead of the default's instant death.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        _announce(args, sock, config.model_id, per_slot, api_key)
        if parent is not None:
            threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", timeout_graceful_shutdown=10, lifespan="off", access_log=False
            )
        )
        server.run(sockets=[sock])
    finally:
        if scheduler is not None:
            scheduler.stop()
        sock.close()
        if stats_of is not None:
            stats_of.save(args.stats, engine.fingerprint)
        engine.close()
    print("swarm serve: stopped", file=sys.stderr)
    return 0


def _invite(args: argparse.Namespace, engine: Any) -> str | None:
    """The invite the map page shows (`swarm invite`'s, for this server's --listen), None when it takes no
    joining nodes."""
    key = getattr(engine.experts, "key", None)
    if not getattr(args, "listen", None) or key is None:
        return None
    from swarm.node.invite import listen_addresses, make_invite
    from swarm.sharding.identity import identity_of

    return make_invite(key, identity_of(args.model), listen_addresses(args.listen)).text()


def _check_args(args: argparse.Namespace) -> None:
    from swarm.coordinator.serve.slots import CHECKPOINT_BEFORE_END

    if args.parallel < 1:
        raise UserError("--parallel must be at least 1")
    if args.ctx_size < 2 * CHECKPOINT_BEFORE_END:
        raise UserError(f"--ctx-size must be at least {2 * CHECKPOINT_BEFORE_END} tokens")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: give 0-65535")
    if args.max_queue < 0:
        raise UserError("--max-queue must be 0 or more")
    _fixed_groups(args.groups)
    if args.draft_max < 0:
        raise UserError("--draft-max must be 0 or more")


def _fixed_groups(text: str) -> int:
    """--groups as a number of groups, 0 for auto."""
    from swarm.coordinator.decode.passes import MAX_GROUPS

    if text == "auto":
        return 0
    n = int(text) if text.isdigit() else 0
    if not 1 <= n <= MAX_GROUPS:
        raise UserError(f"--groups {text!r}: give auto or a number of groups from 1 to {MAX_GROUPS}")
    return n


def _listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None


def _slot_memory(engine: Any, parallel: int, ctx_size: int) -> int:
    """Bytes of state one slot takes; UserError where `parallel` slots would not fit in the memory there is."""
    from swarm.coordinator.serve.startup import slot_bytes

    copies = 3 + (engine.checker is not None)  # live state, two prefix checkpoints, the checker's anchor
    per_slot = slot_bytes(engine.model, ctx_size, copies)
    free = available_memory(engine.device)
    if free is not None and parallel * per_slot > STATE_SHARE * free:
        fits = int(STATE_SHARE * free // per_slot) if per_slot else parallel
        raise UserError(
            f"--parallel {parallel} at --ctx-size {ctx_size} needs {parallel} x {gib(per_slot)} "
            f"= {gib(parallel * per_slot)} for conversation state, but {gib(free)} is available on "
            f"{engine.device} (the slots may take {STATE_SHARE:.0%}): use --parallel {max(fits, 1)} or a "
            "smaller --ctx-size"
        )
    return per_slot


def _warm_up(engine: Any, parallel: int) -> Callable[[], None]:
    """What the engine thread runs before serving (see Scheduler.start)."""
    from swarm.coordinator.cli.terminal import status_line
    from swarm.coordinator.serve.startup import warm_batches, warm_prompts

    def warm() -> None:  # on the engine thread
        status_line("swarm serve: warming up (every expert once, as llama.cpp does) ...")
        engine.model.warm_up()
        if engine.mtp_head is not None:
            engine.mtp_head.warm_up()  # its layer's experts too
        status_line("swarm serve: preparing passes of several conversations at once ...")
        warm_batches(engine.model, parallel, engine.device)
        warm_prompts(engine.model, parallel, engine.device)

    return warm


def _coverage_check(engine: Any, model: str) -> Callable[[], str | None] | None:
    """Over a swarm: why no request can run now (experts without a holder), or None; looked up at most
    every COVERAGE_CACHE_SECONDS. None in process, where every expert is always there."""
    from swarm.coordinator.experts.remote.dispatch import SwarmExperts
    from swarm.coordinator.experts.remote.placement import describe_missing

    if not isinstance(engine.experts, SwarmExperts):
        return None
    experts = engine.experts
    seen: list[Any] = [0.0, None]

    def admit_check() -> str | None:
        now = time.monotonic()
        if now - seen[0] > COVERAGE_CACHE_SECONDS and not experts.degraded:
            experts.follow_mdns()
            missing = experts.placement.missing(experts.needed)
            seen[:] = [now, describe_missing(missing, model) if missing else None]
        return seen[1]

    return admit_check


def _announce(
    args: argparse.Namespace, sock: socket.socket, model_id: str, per_slot: int, api_key: str | None
) -> None:
    """The ready file (for tools that start the server) and the line that says where it serves."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if args.ready_file:
        ready = {"url": f"http://{shown}:{port}/v1", "address": f"{shown}:{port}", "host": host, "port": port,
                 "pid": os.getpid(), "model_id": model_id, "slot_bytes": per_slot}  # fmt: skip
        tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(args.ready_file)
    print(
        f"swarm serve: {model_id} on http://{shown}:{port}/v1 ({args.parallel} slots x {args.ctx_size} "
        f"tokens, {gib(per_slot)} of state each{'; API key required' if api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    if api_key is None and not is_loopback_host(args.host):
        print("swarm serve: warning: no --api-key: anyone who reaches this port can use it", file=sys.stderr)


def _grouping(engine: Any, text: str) -> Any:
    """--groups: a serve/groups.py WaitShare over the swarm backend, or None (one group: experts in process)."""
    from swarm.coordinator.experts.remote.dispatch import SwarmExperts
    from swarm.coordinator.serve.groups import WaitShare

    if not isinstance(engine.experts, SwarmExperts):
        return None
    return WaitShare(engine.experts, _fixed_groups(text))
