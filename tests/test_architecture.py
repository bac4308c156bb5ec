"""The floors of docs/ARCHITECTURE.md hold: every import points down, the coordinator reaches into node only
through its client side, model files stay free of transport, and no source file grows past a reader's page count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first: a part may import its own floor and the ones below it, never one above.
FLOORS = ("proto", "sharding", "compute", "node", "coordinator")
# What the coordinator may take from node: the client side of the wire (and the join link's, both ends').
NODE_CLIENT_SIDE = frozenset({"client", "auth", "discovery", "errors", "invite", "link", "link_files"})
# The one `swarm` command registers the node's subcommands (`swarm node`, `swarm keygen`, `swarm fetch`).
CLI_REGISTRY = ("coordinator/cli/__init__.py", "swarm.node.cli")
TRANSPORT = frozenset({"grpc", "zeroconf"})
MAX_LINES = 450
# A node never loads torch: below the coordinator, only these rooms (the coordinator's dense kernels, its
# torch dequantizer, exact experts on a GPU) import it when loaded, and nothing else loads them at import.
TORCH_ROOMS = frozenset({"compute/dense.py", "compute/deltanet.py", "compute/dequant.py", "compute/device_experts.py"})
TORCH_MODULES = frozenset("swarm." + r.removesuffix(".py").replace("/", ".") for r in TORCH_ROOMS)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (at any depth: function-level imports count), with its line."""
    found = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            found += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            found.append((n.lineno, n.module))
            # `from swarm.node import client` names a module, not an attribute
            if n.module in {f"swarm.{f}" for f in FLOORS}:
                found += [(n.lineno, f"{n.module}.{a.name}") for a in n.names]
    return found


def loaded_at_import(path: Path) -> list[tuple[int, str]]:
    """The modules a file imports when it is loaded: its top-level imports, not those inside functions or under
    `if TYPE_CHECKING:`."""
    found = []
    for n in ast.parse(path.read_text(), str(path)).body:
        if isinstance(n, ast.Import):
            found += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            found += [(n.lineno, n.module)] + [(n.lineno, f"{n.module}.{a.name}") for a in n.names]
    return found


def torch_at_import(root: Path) -> list[str]:
    bad = []
    for floor in FLOORS[:-1]:
        for path in sorted((root / floor).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in TORCH_ROOMS:
                continue
            for line, mod in loaded_at_import(path):
                if mod.split(".")[0] == "torch" or mod in TORCH_MODULES:
                    bad.append(f"{rel}:{line} imports {mod} when loaded: a node never loads torch")
    return bad


def violations(root: Path) -> list[str]:
    bad = torch_at_import(root)
    for rank, floor in enumerate(FLOORS):
        for path in sorted((root / floor).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, mod in imports_of(path):
                where = f"{rel}:{line} imports {mod}"
                parts = mod.split(".")
                if parts[0] in TRANSPORT and rel.startswith("coordinator/models/"):
                    bad.append(f"{where}: model files hold no transport")
                if parts[0] != "swarm" or len(parts) < 2 or parts[1] not in FLOORS:
                    continue
                target = FLOORS.index(parts[1])
                if target > rank:
                    bad.append(f"{where}: {floor} may not import {parts[1]} (a floor above it)")
                elif floor == "coordinator" and parts[1] == "node" and len(parts) > 2:
                    if parts[2] not in NODE_CLIENT_SIDE and (rel, mod) != CLI_REGISTRY:
                        bad.append(f"{where}: the coordinator takes only node's client side "
                                   f"({', '.join(sorted(NODE_CLIENT_SIDE))})")  # fmt: skip
    return bad


def long_files(root: Path) -> list[str]:
    out = []
    for floor in (*FLOORS, "bench", "deploy"):
        for path in sorted((root / floor).rglob("*.py")):
            if "_pb2" in path.name:
                continue  # generated
            n = path.read_text().count("\n")
            if n > MAX_LINES:
                out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_every_import_points_down_and_the_coordinator_uses_only_nodes_client_side() -> None:
    assert violations(ROOT) == []


def test_no_source_file_is_over_450_lines() -> None:
    assert long_files(ROOT) == []


@pytest.mark.parametrize(
    ("floor", "source", "complaint"),
    [
        ("node", "from swarm.coordinator import engine\n", "node may not import coordinator"),
        ("compute", "import swarm.node.server\n", "compute may not import node"),
        ("compute", "def f():\n    from swarm.coordinator.models import layers\n", "compute may not import coordinator"),
        ("sharding", "from swarm.compute import ggml\n", "sharding may not import compute"),
        ("coordinator", "from swarm.node.server import Servicer\n", "only node's client side"),
        ("coordinator", "from swarm.node import store\n", "only node's client side"),
        ("coordinator/models", "import grpc\n", "model files hold no transport"),
        ("node", "import torch\n", "a node never loads torch"),
        ("compute", "from swarm.compute.dense import linear\n", "a node never loads torch"),
    ],
)
def test_the_checker_catches_an_import_that_breaks_the_rule(
    tmp_path: Path, floor: str, source: str, complaint: str
) -> None:
    (tmp_path / floor).mkdir(parents=True)
    (tmp_path / floor / "bad.py").write_text(source)
    assert any(complaint in v for v in violations(tmp_path))
    (tmp_path / floor / "bad.py").write_text("from swarm.proto import codec\n")  # down to the lowest floor: fine
    assert violations(tmp_path) == []


def test_each_command_module_registers_the_commands_the_registry_lists() -> None:
    """`swarm CMD` imports only CMD's module (coordinator/cli COMMAND_MODULES): the list must be what each
    module registers, or a command would be missing from its own command line."""
    import argparse
    import importlib

    from swarm.coordinator.cli import COMMAND_MODULES, build_parser

    for module, commands in COMMAND_MODULES.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert tuple(sub.choices) == commands, module
        for command in commands:
            only = build_parser([command, "--help"])._subparsers._group_actions[0].choices  # type: ignore[union-attr]
            assert set(only) == set(commands), command
    everything = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(everything) == {c for cs in COMMAND_MODULES.values() for c in cs}


def test_swarm_node_loads_no_coordinator_module(tmp_path: Path) -> None:
    """A node's command line registers only the node's commands: none of the coordinator's modules is loaded
    on its way to serving (a phone's start-up time)."""
    import subprocess
    import sys

    code = (
        "import sys; from swarm.coordinator.cli import main\n"
        "try:\n    main(['node', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('swarm.coordinator.') and m != 'swarm.coordinator.cli'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


# The coordinator's rooms, lowest first (docs/ARCHITECTURE.md says what each owns): a module may import its own
# room and the rooms below it, never one above. A loose module (config.py, loader.py, engine.py) is a room of
# its own.
ROOMS = (
    "config", "checks", "experts", "models", "loader", "vision", "text", "drafts", "decode", "engine", "serve", "cli",
)  # fmt: skip


def room_of(rel: str) -> str:
    """coordinator/decode/core.py -> decode; coordinator/engine.py -> engine."""
    return Path(rel).relative_to("coordinator").parts[0].removesuffix(".py")


def coordinator_imports(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Each coordinator module's imports of other coordinator modules (every depth, TYPE_CHECKING included;
    `from swarm.coordinator.vision import native` names the module native, not the package)."""
    base = root / "coordinator"
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "coordinator/__init__.py":
            continue
        mods = []
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Import):
                mods += [(n.lineno, a.name) for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    sub = f"{n.module}.{a.name}"
                    is_module = (root / sub.replace("swarm.", "", 1).replace(".", "/")).with_suffix(".py").is_file()
                    mods.append((n.lineno, sub if is_module else n.module))
        found[rel] = sorted({(line, m) for line, m in mods if m.startswith("swarm.coordinator.")})
    return found


def room_violations(root: Path) -> list[str]:
    bad = []
    for rel, imports in coordinator_imports(root).items():
        mine = room_of(rel)
        if mine not in ROOMS:
            bad.append(f"{rel}: room {mine!r} is not in ROOMS: place it")
            continue
        for line, mod in imports:
            target = mod.split(".")[2]
            if target in ROOMS and ROOMS.index(target) > ROOMS.index(mine):
                bad.append(f"{rel}:{line} imports {mod}: {mine} may not import {target} (a room above it)")
    return bad


def module_cycles(root: Path) -> list[list[str]]:
    """Import cycles among the coordinator's modules (a module importing a package counts as importing its
    __init__); each cycle once."""
    modules = {}
    for rel in coordinator_imports(root):
        name = "swarm." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        modules[name] = rel
    graph = {
        name: {m for _, m in coordinator_imports(root)[rel] if m in modules and m != name}
        for name, rel in modules.items()
    }
    cycles, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        cycles.append(path + [start])
                elif nxt not in path and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return cycles


def test_the_coordinators_rooms_import_downwards_only() -> None:
    assert room_violations(ROOT) == []


def test_no_import_cycle_in_the_coordinator() -> None:
    assert module_cycles(ROOT) == []


def test_the_room_and_cycle_checks_catch_what_breaks_them(tmp_path: Path) -> None:
    (tmp_path / "coordinator" / "experts").mkdir(parents=True)
    (tmp_path / "coordinator" / "decode").mkdir(parents=True)
    (tmp_path / "coordinator" / "experts" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swarm.coordinator.decode.b import B\n"
    )
    (tmp_path / "coordinator" / "decode" / "b.py").write_text("from swarm.coordinator.experts.a import A\n")
    assert any("experts may not import decode" in v for v in room_violations(tmp_path))
    assert module_cycles(tmp_path) == [
        ["swarm.coordinator.decode.b", "swarm.coordinator.experts.a", "swarm.coordinator.decode.b"]
    ]
    (tmp_path / "coordinator" / "lobby.py").write_text("")
    assert any("room 'lobby' is not in ROOMS" in v for v in room_violations(tmp_path))
