"""How far an honest node of another numerics class can be from the coordinator's own answer.

Within one numerics class (swarm.compute.numclass) an answer is checked for equality. A node of another class
(an ARM phone beside an x86 coordinator, or another ARM generation) multiplies the same slab bytes and the
same rows with kernels that sum in another order, so its answer differs by a few units in the last place.
Its answer is checked against a bound per output element, derived from the kernels' error model.

For an expert y = W_d · (silu(W_g x) ⊙ (W_u x)) as ggml computes it, every matrix product first rounds its
input rows to the activation type its kernel pairs with (8-bit blocks for quantized weights, F16 / BF16 for
those weights, none for F32), then sums products:
- Summation order: two orders of a sum of n products differ by at most 2·γ(n)·M, M = Σ|w||a| the
  magnitude of that element's products, γ(n) = n·u/(1-n·u), u = 2^-24 (float32's unit roundoff).
- Rounding to the activation type: both builds round the same value the same way, except where the value
  differs between them (h below) or where their block scale differs in its last bits (x86's and ARM's
  q8_0 code compute 127/amax in two ways): an element that lies that close to a rounding boundary may take
  the next step on one build, one quantum q of its block (or one F16 / BF16 unit). Which elements can do
  so is known here exactly: the coordinator computes gate, up and h with its own ggml kernels, and each
  element's distance to its boundary; only those within reach count, each with its full quantum.
- h = silu(g)·u: the gate and up differences carried through (|silu'(g)|·|u|·δg + |silu(g)|·δu), plus the
  builds' own silu (their vectorized exp approximations differ by a few ulp): 8·u·|h|.
- y: 2·γ(F)·M_d + Σ_j |W_d,ij|·q_j over the h elements within reach of a step, + 4·u·|y|, plus one unit of
  the wire type when answers travel in F16 / BF16.
The magnitudes are taken on the coordinator's float32 dequantized copy of the expert (the bytes' own
values), in float64, and an answer is accepted when |theirs - ours| <= SAFETY x bound everywhere (non-finite
values must be the same bits). Elements near no boundary are bounded by the summation orders alone, a few
ulp of their products' magnitude; that, and the rare element one quantum away, is all the leeway a liar
of another class keeps: far less than the half quantum every 8-bit node's own rounding of h already moves
each product by (bench/faults measures what a liar at the bound's edge does to the logits). A node of the
coordinator's own class gets no leeway at all; `--numerics-class same` takes only those.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from swarm.compute import dense
from swarm.compute.store import ExpertStore
from swarm.proto.numerics import Numerics

U = 2.0**-24  # float32 unit roundoff
SAFETY = 2.0  # the bound's terms are estimated on float32 dequantized weights and unquantized rows

_Q8_BLOCK_32 = frozenset(
    int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q8_1, Q.IQ4_NL, Q.MXFP4)
)  # q8_0 / q8_1 activations; every other quantized type pairs with q8_K (blocks of 256)


def _gamma(n: int, u: float = U) -> float:
    return n * u / (1.0 - n * u)


def _sums(a: torch.Tensor, w: torch.Tensor, qtype: int | None, half_sums: bool) -> torch.Tensor:
    """2·γ(n)·(|a| |w|ᵀ): how far two orders of each element's sum can be apart. n: the float additions a
    row of the kernel makes: every product for float weights; for quantized ones the integer sums inside a
    block are exact, and a block adds a few float terms (8 lanes of partial sums, generously). half_sums: a
    build that sums F16 products in F16 (ARM with FP16 vector arithmetic)."""
    cols = a.shape[1]
    kind, block = _act(qtype) if qtype is not None else ("f", 0)
    n = cols if kind != "q8" else (cols // block) * 8 + 16
    u = 2.0**-11 if half_sums and qtype == int(Q.F16) else U
    return 2 * _gamma(n, u) * (a.abs() @ w.abs().T)


def _act(qtype: int) -> tuple[str, int]:
    """The activation type a matrix of this type multiplies its rows in: ("f", 0) float32, ("f16" | "bf16", 0),
    or ("q8", block)."""
    if qtype == int(Q.F32):
        return "f", 0
    if qtype == int(Q.F16):
        return "f16", 0
    if qtype == int(Q.BF16):
        return "bf16", 0
    return "q8", 32 if qtype in _Q8_BLOCK_32 else 256


def _steps(v: torch.Tensor, delta: torch.Tensor, act: tuple[str, int]) -> torch.Tensor:
    """[N, F] the activation step of each element of v that another build may round the other way (it lies
    within delta, or within its block scale's last bits, of a rounding boundary), 0 elsewhere."""
    kind, block = act
    if kind == "f":
        return torch.zeros_like(v)
    if kind in ("f16", "bf16"):
        mant = 10 if kind == "f16" else 7
        q = torch.pow(2.0, torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - mant)
        pos = v / q
        reach = delta / q + 8 * U * pos.abs()
    else:
        n, f = v.shape
        b = block if f % block == 0 else f
        amax = v.abs().reshape(n, f // b, b).amax(dim=2, keepdim=True)
        dmax = delta.reshape(n, f // b, b).amax(dim=2, keepdim=True)
        q = (amax / 127.0).expand(n, f // b, b).reshape(n, f)
        rel = (8 * U + dmax / amax.clamp_min(1e-30)).expand(n, f // b, b).reshape(n, f)
        pos = v / q.clamp_min(1e-30)
        reach = delta / q.clamp_min(1e-30) + pos.abs() * rel
    dist = 0.5 - (pos - torch.round(pos)).abs()  # to the nearest boundary, in steps
    return torch.where(dist <= reach, q, torch.zeros_like(q))


def expert_bound(
    store: ExpertStore,
    layer: int,
    expert: int,
    rows: torch.Tensor,
    wire: torch.dtype,
    exact: bool = False,
    half_sums: bool = False,
) -> torch.Tensor:
    """The bound [N, D] (float64) on |answer - ours| for these rows through one expert, between two honest
    builds of different numerics classes (`exact`: of the exact numerics, float32 math on both; `half_sums`:
    one of them sums F16 products in F16)."""
    w = store.weights(layer, expert)
    x = rows.to(torch.float32)
    f = w.down.shape[1]
    if exact:
        gu = torch.nn.functional.linear(x, torch.as_tensor(w.gate_up)).double()
        if w.gate_up_bias is not None:
            gu = gu + torch.as_tensor(w.gate_up_bias).double()
        g, u = gu[:, :f], gu[:, f:]
        types: tuple[int | None, int | None] = (None, None)
    else:
        native = store.ffn(layer, expert, Numerics.NATIVE)  # gate and up as this build's kernels make them
        mats = [native.gate_up] if native.gate_up is not None else [native.gate, native.up]
        outs = dense.linear([m for m in mats if m is not None], x)
        gu = torch.cat(outs, dim=1).double() if len(outs) > 1 else outs[0].double()
        if native.gate_up is not None and native.gate_bias is not None:
            gu = gu + torch.as_tensor(native.gate_bias).double()
        g, u = gu[:, :f], gu[:, f:]
        if native.gate_up is None:
            g = g + (torch.as_tensor(native.gate_bias).double() if native.gate_bias is not None else 0.0)
            u = u + (torch.as_tensor(native.up_bias).double() if native.up_bias is not None else 0.0)
        types = (int(mats[0].qtype), int(native.down.qtype))
    xd = x.double()
    gate, up, down = torch.as_tensor(w.gate).double(), torch.as_tensor(w.up).double(), torch.as_tensor(w.down).double()
    in_act, down_act = (_act(t) if t is not None else ("f", 0) for t in types)
    qx = _steps(xd, torch.zeros_like(xd), in_act)  # the rows are the same bits on both builds
    dg = _sums(xd, gate, types[0], half_sums) + qx @ gate.abs().T
    du = _sums(xd, up, types[0], half_sums) + qx @ up.abs().T
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dh = (sig * (1 + g * (1 - sig))).abs() * u.abs() * dg + silu.abs() * du + 8 * U * h.abs()
    ad = down.abs()
    y = h @ down.T
    bound = _sums(h, down, types[1], half_sums) + (dh + _steps(h, dh, down_act)) @ ad.T + 4 * U * y.abs()
    if wire != torch.float32:  # the answer was rounded to the wire type on both sides: one step apart at most
        top = y.abs() + bound
        rel = 2.0**-10 if wire == torch.float16 else 2.0**-7
        bound = bound + torch.pow(2.0, torch.floor(torch.log2(top.clamp_min(1e-38)))) * rel
    return bound


def within_bound(
    store: ExpertStore,
    layer: int,
    expert_ids: list[int],
    rows: torch.Tensor,
    ours: torch.Tensor,
    theirs: torch.Tensor,
    exact: bool = False,
    half_sums: bool = False,
) -> bool:
    """Whether `theirs` is an honest answer of another numerics class: rows [N, D] (row i through
    expert_ids[i]), ours and theirs [N, D] in the wire type."""
    if ours.shape != theirs.shape:
        return False
    finite = torch.isfinite(ours)
    if not torch.equal(finite, torch.isfinite(theirs)):
        return False
    if not bool(finite.all()):  # the non-finite values must be the same ones
        if not torch.equal(ours[~finite].float().nan_to_num(1.0), theirs[~finite].float().nan_to_num(1.0)):
            return False
    diff = (theirs.double() - ours.double()).abs()
    for expert in sorted(set(expert_ids)):
        at = torch.tensor([i for i, e in enumerate(expert_ids) if e == expert])
        bound = expert_bound(
            store, layer, expert, rows.index_select(0, at).float(), ours.dtype, exact, half_sums
        )
        d = diff.index_select(0, at)
        ok = finite.index_select(0, at)
        if bool((d[ok] > SAFETY * bound[ok]).any()):
            return False
    return True
