"""`swarm`: one command, a subcommand per job. Each part registers its own subcommands.

This package holds the coordinator's verbs (run, logits, perplexity, demo, status, serve); the node's and the
shard's live with their parts (swarm.node.cli, swarm.sharding.cli). The engine they drive is the rest of
swarm.coordinator: engine and loader, models, decode, drafts, checks, experts, text, vision, serve.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from swarm.sharding.errors import UserError

# Each module defines `register(subparsers)`, adding the subcommands listed beside it, whose
# `func(args) -> int` runs the job. Registration must stay cheap: heavy imports (torch, grpc) happen inside
# the handlers. A command line naming one of them imports only its module: a node on a phone starts serving
# sooner without the coordinator's command modules loaded first.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "swarm.sharding.cli": ("shard", "inspect", "plan"),
    "swarm.sharding.synth_cli": ("synth",),
    "swarm.node.cli": ("keygen", "node"),
    "swarm.coordinator.cli.commands": ("run", "logits", "perplexity", "demo"),
    "swarm.coordinator.cli.status": ("status",),
    "swarm.coordinator.cli.serve": ("serve",),
    "swarm.coordinator.cli.invite": ("invite",),
}


# What the `coordinator` extra adds to a node's install (pyproject.toml): a command that needs one of them
# on an install without it says how to get it.
COORDINATOR_PACKAGES = frozenset({"torch", "tokenizers", "jinja2", "starlette", "uvicorn"})


def _modules_for(argv: Sequence[str] | None) -> list[str]:
    """The command modules to register for this command line: the one whose command it names, else all (for
    --help, and for the error that names every command)."""
    words = [a for a in argv or () if not a.startswith("-")]
    if argv is not None and words:
        for module, commands in COMMAND_MODULES.items():
            if words[0] in commands:
                return [module]
    return list(COMMAND_MODULES)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `swarm` parser; given the command line, with only the subcommand it names (every one without)."""
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Run mixture-of-experts language models on a swarm of ordinary devices.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _modules_for(argv):
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of the output went away (`swarm inspect ... | head`): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] not in COORDINATOR_PACKAGES:
            raise
        print(
            f"swarm {args.command}: error: this command runs the coordinator, which needs {e.name.split('.')[0]}; "
            "this install is a node's (no torch): install the coordinator's packages with "
            "pip install 'swarm-moe[coordinator]'",
            file=sys.stderr,
        )
        return 2
