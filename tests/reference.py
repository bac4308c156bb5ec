"""Comparing our logits with the fixtures' independent references (transformers, llama.cpp).

The tolerance is the one tests/fixtures/README.md derives from the two engines' own floor: max
|logit diff| <= 2e-3 and mean KL <= 1e-8, KL computed in float64 (in float32 the rounding of the
log-softmax alone reaches ~1e-8 on these logits).
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ABS = 2e-3
MAX_MEAN_KL = 1e-8


def as_f64(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def mean_kl(ref: np.ndarray | torch.Tensor, ours: np.ndarray | torch.Tensor) -> float:
    """Mean over rows of KL(p_ref || p_ours), natural log, in float64. Both [T, V]."""
    lp, lq = log_softmax(as_f64(ref)), log_softmax(as_f64(ours))
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


def assert_logits_close(
    ours: np.ndarray | torch.Tensor,
    ref: np.ndarray | torch.Tensor,
    what: str,
    max_abs: float = MAX_ABS,
    max_mean_kl: float = MAX_MEAN_KL,
) -> None:
    a, b = as_f64(ours), as_f64(ref)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs reference {b.shape}"
    diff = float(np.abs(a - b).max())
    kl = mean_kl(b, a)
    assert diff <= max_abs, f"{what}: max |logit diff| {diff:.3g} > {max_abs:g} (mean KL {kl:.3g})"
    assert kl <= max_mean_kl, f"{what}: mean KL {kl:.3g} > {max_mean_kl:g} (max |diff| {diff:.3g})"
