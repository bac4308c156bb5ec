"""1,000 mutated GGUFs (truncations, flipped and zeroed header bytes, absurd counts, lengths and offsets) through
`swarm inspect`, `swarm shard` and `swarm node`: each ends in a clear one-line error or a correct result, never
a traceback, a hang, or an output that verifies. Seeded; the seed is printed (SWARM_FUZZ_SEED replays one)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.coordinator.cli import build_parser, main
from swarm.node.holding import open_store
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import open_gguf
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

MUTATIONS = 500  # a new seed every run: the runs together cover far more
REAL_NODES = 12  # of them also started as real `swarm node` processes
STEP_SECONDS = 20  # one command on a 200 kB file: anything near this is a hang


class Hang(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang(f"no result in {STEP_SECONDS} s")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small but complete model: qwen3moe layout, 2 layers, 4 experts of Q8_0, F16 dense, a real vocab."""
    path = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    spec = preset(
        "qwen3-30b-a3b", n_layers=2, n_embd=64, n_expert=4, n_expert_used=2, expert_ff=32, n_head=2,
        n_head_kv=1, head_dim=32, n_vocab=300, ff=64, experts_type="Q8_0", dense_type="F16",
    )  # fmt: skip
    return synthesize(path, spec)


def mutate(data: bytes, header: int, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(data)
    k = rng.randrange(6)
    if k == 0:
        return bytes(b[: rng.randrange(len(b))]), "truncated"
    if k == 1:
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(header)] ^= 1 << rng.randrange(8)
        return bytes(b), "flipped header bits"
    if k == 2:
        at, n = rng.randrange(header), rng.randrange(1, 16)
        b[at : at + n] = bytes(len(b[at : at + n]))
        return bytes(b), "zeroed header bytes"
    if k == 3:  # version, tensor count, metadata count
        at = rng.choice([4, 8, 16])
        b[at : at + 8] = rng.choice([2**63 - 1, 2**40, 0, 2**32 + 5, 7]).to_bytes(8, "little")
        return bytes(b), "absurd count"
    if k == 4:  # a length, a dimension, an offset or a type somewhere in the header
        at = rng.randrange(header - 8)
        b[at : at + 8] = rng.choice([2**64 - 1, 2**62, 2**33, 10**9, 0]).to_bytes(8, "little")
        return bytes(b), "absurd header word"
    b[rng.randrange(header, len(b))] ^= 0xFF
    return bytes(b), "flipped data byte"


def _run(argv_or_fn: list[str] | object) -> tuple[int, list[str]]:
    """A command in this process: (exit code, stderr lines); exceptions escape (a traceback is a failure)."""
    err = io.StringIO()
    signal.alarm(STEP_SECONDS)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if isinstance(argv_or_fn, list):
                rc = main(argv_or_fn)
            else:
                try:
                    argv_or_fn()  # type: ignore[operator]
                    rc = 0
                except UserError as e:
                    print(f"swarm node: error: {e}", file=sys.stderr)
                    rc = 2
    finally:
        signal.alarm(0)
    return rc, err.getvalue().strip().splitlines()


def _one_line_error(rc: int, lines: list[str], what: str, note: str) -> None:
    if rc == 0:
        return
    lines = [
        ln for ln in lines if not ln.startswith("swarm node: refused")
    ]  # the node names each slab it refuses
    assert rc == 2 and len(lines) == 1 and f"swarm {what}: error: " in lines[0], (
        f"{note}: {what}: {rc} {lines}"
    )


@pytest.mark.slow
def test_mutated_ggufs_end_in_one_line_errors_or_correct_results(base, tmp_path):
    seed = int(os.environ.get("SWARM_FUZZ_SEED", random.randrange(2**32)))
    print(f"seed {seed} (replay: SWARM_FUZZ_SEED={seed})")
    rng = random.Random(seed)
    data = base.read_bytes()
    header = open_gguf(base).data_offset
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    outcomes: dict[str, int] = {}
    kept: list[tuple[Path, str]] = []
    try:
        for i in range(MUTATIONS):
            mutated, kind = mutate(data, header, rng)
            path = tmp_path / f"m{i}.gguf"
            path.write_bytes(mutated)
            note = f"mutation {i} ({kind}, seed {seed})"

            rc, lines = _run(["inspect", str(path)])
            _one_line_error(rc, lines, "inspect", note)

            out = tmp_path / f"m{i}.swarm"
            rc_shard, lines = _run(["shard", str(path), "-o", str(out)])
            _one_line_error(rc_shard, lines, "shard", note)
            verified, vlines = _run(["shard", "--verify", str(out)]) if out.exists() else (2, [])
            if rc_shard == 0:
                assert verified == 0, f"{note}: the shard output does not verify: {vlines}"
            else:
                assert verified != 0, f"{note}: shard failed but left an output that verifies"

            args = build_parser().parse_args(["node", str(path)])
            rc_node, lines = _run(lambda args=args: open_store(args))
            _one_line_error(rc_node, lines, "node", note)
            outcomes[f"{kind}: {'served' if rc_node == 0 else 'refused'}"] = (
                outcomes.get(f"{kind}: {'served' if rc_node == 0 else 'refused'}", 0) + 1
            )
            if len(kept) < REAL_NODES and i % (MUTATIONS // REAL_NODES) == 0:
                kept.append((path, note))
            else:
                path.unlink()
            shutil.rmtree(out, ignore_errors=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(outcomes)
    assert sum(v for k, v in outcomes.items() if k.endswith("refused")) > MUTATIONS // 4, outcomes

    for path, note in kept:  # the real command: it serves (and stops on SIGTERM) or says why not, in one line
        ready = tmp_path / f"{path.stem}.ready"
        cmd = [sys.executable, "-m", "swarm.coordinator.cli", "node", str(path), "--no-mdns", "--threads", "1",
               "--ready-file", str(ready), "--exit-with-parent"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if ready.exists():
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{note}: swarm node neither served nor exited")
        lines = [ln for ln in err.strip().splitlines() if "warning:" not in ln]
        if ready.exists():
            assert proc.returncode == 0, f"{note}: {err[-2000:]}"
        else:
            _one_line_error(proc.returncode, lines, "node", note)
            assert proc.returncode == 2, f"{note}: {err[-2000:]}"
