"""Nodes emulated for benches that measure the coordinator's side alone: every layer's answers arrive one round
trip after the call and cost this machine nothing, as nodes with cores of their own behind an ideal link would
give them. The answers are zeros, so the text is not the model's own (the same zeros every run, so a run's
greedy continuation is what drafts known to be right repeat)."""

from __future__ import annotations

import time

import torch

from swarm.coordinator.experts.turns import away


class _Answered:
    """A wait on emulated nodes: the answers (zeros) arrive one round trip after the call."""

    in_flight = True
    dropped = None

    def __init__(self, backend: Emulated, due: float, shape: tuple[int, int, int]) -> None:
        self.backend, self.due, self.shape = backend, due, shape

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        with away():  # as the swarm backend's wait does (coordinator.turns)
            left = self.due - time.monotonic()
            if left > 0:
                time.sleep(left)
        self.backend.wait_seconds += time.perf_counter() - t0
        return torch.zeros(self.shape)


class Emulated:
    """Nodes with cores of their own: every layer's answers come one round trip after the call and cost this
    machine nothing. They are zeros, so the text is not the model's: this measures the coordinator's side."""

    def __init__(self, rtt_ms: float) -> None:
        self.rtt, self.wait_seconds = rtt_ms / 1000.0, 0.0

    def stack(self, layer: int, ids: torch.Tensor) -> None:
        return None

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> _Answered:
        return _Answered(self, time.monotonic() + self.rtt, (int(ids.shape[0]), int(ids.shape[1]), int(x.shape[1])))


def emulate(engine: object, rtt_ms: float) -> Emulated:
    """Put emulated nodes at rtt_ms under an in-process engine's model (its experts' backend)."""
    backend = Emulated(rtt_ms)
    engine.model.set_experts(backend)  # type: ignore[attr-defined]
    engine.experts = backend  # type: ignore[attr-defined]
    return backend
