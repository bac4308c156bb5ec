"""Timing our engine's first prefill and decode as `swarm run` reports them, with where each decode step's
time goes: proxies around the expert backends add up dispatch (start) and blocked wait, the nodes' own Stats
give their compute."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from _models import prompt_tokens

from swarm.compute import ffn
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.engine import Engine
from swarm.coordinator.experts.backend import PendingExperts
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.node.client import NodeClient


@dataclass
class Run:
    """One timed pass of one configuration."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)  # per decode step, seconds


class _TimedWait:
    # Not passed through from the wrapped pending: under this proxy the shared expert takes every thread and
    # no pair counts as dropped.
    in_flight = False
    dropped: torch.Tensor | None = None

    def __init__(self, owner: TimedBackend, inner: PendingExperts) -> None:
        self.owner, self.inner = owner, inner

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.inner.wait()
        finally:
            self.owner.wait_s += time.perf_counter() - t0


class TimedBackend:
    """Passes start/wait through to a backend, adding up the time spent in each.

    For the in-process backend `start` is the whole expert computation; for the swarm it is pack + encode +
    send, and `wait` is the time blocked on replies (plus decoding them and unpacking).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.start_s = 0.0
        self.wait_s = 0.0
        self.starts = 0

    def stack(self, layer: int, ids: torch.Tensor) -> None:
        return None  # every layer goes through start() and wait(), which this proxy times

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        t0 = time.perf_counter()
        try:
            return _TimedWait(self, self.inner.start(layer, x, ids))
        finally:
            self.start_s += time.perf_counter() - t0
            self.starts += 1


class TimedInProcess:
    """The in-process counterpart of TimedBackend, which would hide the experts from the MoE block's one-graph
    path (it takes only this process's own experts): times ffn.moe_layer (a whole MoE layer: experts,
    shared expert, sum) and the backend's own start (the exact numerics, which go op by op) in place."""

    def __init__(self, experts: Any) -> None:
        self.start_s = 0.0
        self.wait_s = 0.0
        self.starts = 0
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrap(ffn, "moe_layer")
        self._wrap(experts, "start")

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.start_s += time.perf_counter() - t0
                self.starts += 1

        self._restore.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def close(self) -> None:
        for owner, name, old in reversed(self._restore):
            if old is None:
                delattr(owner, name)  # an instance's own attribute: the class's method shows again
            else:
                setattr(owner, name, old)


def node_busy(clients: Sequence[NodeClient]) -> list[tuple[float, int]]:
    out = []
    for c in clients:
        s = c.stats()
        out.append((s.busy_seconds, s.calls))
    return out


def timed_pass(
    engine: Engine,
    ids: list[int],
    n_decode: int,
    backend: TimedBackend | TimedInProcess,
    clients: Sequence[NodeClient] = (),
) -> Run:
    """Prefill `ids`, then greedy-decode n_decode tokens as `swarm run` does (generate(), with the engine's
    answer checker: its audits and settling are part of the time); bookkeeping snapshots are taken outside
    the timed regions."""
    stats = GenerationStats(prompt_tokens=len(ids))
    swarm = engine.experts if isinstance(engine.experts, SwarmExperts) else None
    params = SamplingParams(max_tokens=n_decode)  # greedy, no stop tokens: always n_decode tokens
    tokens = generate(engine.model, ids, params, engine.device, stats, checker=engine.checker)
    first = [next(tokens)]  # the prompt's pass (settled: the first token is what a user waits for)

    s0, w0, n0 = backend.start_s, backend.wait_s, backend.starts
    sw0 = swarm.wait_seconds if swarm else 0.0
    b0 = node_busy(clients)
    t0 = time.perf_counter()
    rest = list(tokens)
    stats.decode_seconds = time.perf_counter() - t0
    b1 = node_busy(clients)
    tokens = first + rest
    stats.generated_tokens = len(tokens)

    steps = max(1, n_decode - 1)
    bd = {
        "step": stats.decode_seconds / steps,
        "start": (backend.start_s - s0) / steps,
        "wait": (backend.wait_s - w0) / steps,
        "moe_calls": (backend.starts - n0) / steps,
    }
    bd["dense"] = bd["step"] - bd["start"] - bd["wait"]
    if swarm is not None:
        bd["swarm_wait"] = (swarm.wait_seconds - sw0) / steps
    if clients:
        busy = [(b[0] - a[0]) / steps for a, b in zip(b0, b1, strict=True)]
        calls = [(b[1] - a[1]) / steps for a, b in zip(b0, b1, strict=True)]
        bd["node_busy_sum"] = sum(busy)
        bd["node_busy_max"] = max(busy)
        bd["node_calls"] = sum(calls)
    return Run(stats.prefill_tps, stats.decode_tps, tokens, bd)


def run_engine(engine: Engine, n_prompt: int, n_decode: int, clients: Sequence[NodeClient] = ()) -> Run:
    """The first prefill and decode of a freshly opened engine: what `swarm run` reports."""
    ids = prompt_tokens(engine, n_prompt)
    if isinstance(engine.experts, SwarmExperts):
        backend = TimedBackend(engine.experts)
        engine.model.set_experts(backend)
        return timed_pass(engine, ids, n_decode, backend, clients)
    local = TimedInProcess(engine.experts)
    try:
        return timed_pass(engine, ids, n_decode, local, clients)
    finally:
        local.close()
