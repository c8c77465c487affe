"""The `cpu` backend: both FP8 operands widened to bf16 for one bf16 GEMM with float32 accumulation.

Every e4m3 value is exact in bf16, and a bf16 GEMM on CPU (oneDNN) accumulates in float32. So the
layer keeps a bf16 working copy of its dequantized weight, `bf16(q_w * s_w)`, made from the FP8 bytes
at load and again at every reload (widening FP8 on every call costs more than the GEMM itself).
Each call quantizes the activation by the SPEC rules (the values of `numerics.quantize_activation`'s
bytes, rounded in float32 arithmetic: no FP8 tensor is made), widens it the same way, `bf16(q_x * s_x)`,
and runs `F.linear`. Folding the scales into the bf16 operands rounds each element once more
(relative error <= 2^-9, independent per element), which keeps the product far inside rel_diff
< 1e-4 of the exact one, for block scales too: one GEMM per call whatever the scheme, no loop over
K-blocks.

oneDNN picks its kernel by the GEMM's shape, M included. `batch_invariant=True` therefore runs
the GEMM on chunks of exactly `INVARIANT_ROWS` rows (the last one zero-padded), so every row passes
through one kernel configuration whatever the batch holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ACT_GROUP, WEIGHT_GROUP, Scheme
from ..numerics import ACT_RULE, dequantize, scale_from_amax
from .plan import Path, Weights

INVARIANT_ROWS = 16          # GEMM rows per call in batch-invariant mode
WORK_DTYPE = torch.bfloat16  # every e4m3 value is exact in it
_CHUNK_BYTES = 16 << 20      # float32 temporary per weight chunk while widening
ACT_CHUNK = 1 << 17            # activation elements quantized at a time (float32 temporaries in cache)
_EXPONENT_BITS = 0x7F800000  # float32 exponent field
_MIN_EXPONENT = 121 << 23     # 2^-6, e4m3's smallest normal: below it the spacing stays 2^-9
_MAGIC_OFFSET = (20 << 23) | (1 << 22)  # 2^e -> 1.5 * 2^(e + 20) in float32 bits


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """Runs on CPU tensors only (GPUs have FP8 GEMMs of their own)."""
    if device.type != "cpu":
        return f"runs on CPU tensors only, not {device.type}"
    if batch_invariant and act_kind == "tensor":
        return "a per-tensor activation scale couples the rows of a batch"
    return None


def working_copy(w_q: torch.Tensor, w_scale: torch.Tensor, scheme: Scheme,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 `q_w * s_w` of an FP8 weight [N, K] (into `out` when given: a reload keeps the storage).

    Widened a chunk of rows at a time (whole 128-row tiles for block scales) so the float32
    temporaries stay near `_CHUNK_BYTES` whatever the layer's size.
    """
    n, k = w_q.shape
    if out is None:
        out = torch.empty((n, k), dtype=WORK_DTYPE, device=w_q.device)
    group = WEIGHT_GROUP[scheme]
    rows = max(_CHUNK_BYTES // (4 * max(k, 1)), 1)
    if scheme is Scheme.BLOCK:
        rows = max(rows - rows % group[0], group[0])
    for r in range(0, n, rows):
        q = w_q[r:r + rows]
        if scheme is Scheme.TENSOR:
            s = w_scale
        elif scheme is Scheme.CHANNEL:
            s = w_scale[r:r + rows]
        else:
            s = w_scale[r // group[0]: (r + q.shape[0] + group[0] - 1) // group[0]]
        out[r:r + q.shape[0]] = dequantize(q, s, group)
    return out


def widened_activation(x: torch.Tensor, act_kind: str, compiled=None) -> torch.Tensor:
    """bf16 `q_x * s_x` of x [M, K] quantized dynamically (per "token", "tensor", or 1x128 "group").

    `compiled`: the same quantizer compiled for x's dtype (`cpu_aot.Widened`), one call instead of the
    torch ops below (not under torch.compile, whose own fusion of these ops runs there). The torch ops
    work on row chunks of about `ACT_CHUNK` elements: their float32 temporaries stay in cache and are
    reused by the allocator, where whole-tensor ones cost a trip to memory (and page faults) per pass.
    """
    m, k = x.shape
    xg = _grouped(x, act_kind)                     # [M, K] or [M, G, 128]
    if compiled is not None and compiled.dtype == x.dtype and not torch.compiler.is_compiling():
        return _flat(compiled(xg), m, k)
    rule = ACT_RULE[act_kind]
    rows = max(ACT_CHUNK // max(k + (-k % 128 if act_kind == "group" else 0), 1), 1)
    if m <= rows:                                  # one chunk (decode): fewer calls
        q, s = _values(xg, rule)
        return _flat(q.mul_(s).to(WORK_DTYPE), m, k)  # the product rounded once, to bf16
    scale = None
    if rule == "tensor":                           # one scale for all rows: the amax first
        scale = scale_from_amax(torch.stack([c.abs().amax() for c in xg.split(rows)]).amax(), rule)
    out = torch.empty(xg.shape, dtype=WORK_DTYPE)
    for r in range(0, m, rows):
        q, s = _values(xg[r:r + rows], rule, scale)
        out[r:r + rows] = q.mul_(s)
    return _flat(out, m, k)


def _flat(y: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Grouped rows back to [M, K] (a view; drops a last group's padding)."""
    return y.view(m, -1)[:, :k] if y.dim() == 3 else y


def activation_values(x: torch.Tensor, act_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of `numerics.quantize_activation`'s FP8 bytes, as float32, and their scales.

    Returns q [M, K] with s [M, 1] ("token") or [] ("tensor"), or q [M, G, 128] with s [M, G, 1]
    ("group", the partial last group padded with zeros as there). Same rule, same float32 division;
    the values are rounded by `round_e4m3_` instead of a cast to FP8 and back (whose way back is a
    scalar loop on CPU), and no FP8 tensor is made. A zero may come out as +0 where the byte is -0.
    """
    return _values(_grouped(x, act_kind), ACT_RULE[act_kind])


def _grouped(x: torch.Tensor, act_kind: str) -> torch.Tensor:
    """x [M, K] as its activation groups: [M, K] per token or tensor, [M, G, 128] zero-padded per group."""
    if act_kind == "group":
        m, k = x.shape
        pad = -k % 128
        return (F.pad(x, (0, pad)) if pad else x).view(m, -1, 128)
    if act_kind not in ("token", "tensor"):
        raise ValueError(f"unknown activation kind {act_kind!r}; valid: token, tensor, group")
    return x


def _values(xg: torch.Tensor, rule: str, scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 e4m3 values and scales of grouped rows xg (the scale measured per last dim unless given)."""
    if scale is None:
        a = xg.abs()                               # exact in x's dtype, half the bytes of float32
        scale = scale_from_amax(a.amax() if rule == "tensor" else a.amax(dim=-1, keepdim=True), rule)
    q = xg.float()
    if rule == "tensor":
        q.mul_(torch.ones_like(scale) / scale)     # numerics: x * (1/s) for this rule
    else:
        q.div_(scale)
    return round_e4m3_(q), scale


def round_e4m3_(y: torch.Tensor) -> torch.Tensor:
    """Round float32 `y` [...] in place to the nearest e4m3 values (ties to even), for |y| <= 464.

    Adding `C = 1.5 * 2^(e + 20)`, e = the exponent of |y| (at least -6), leaves a float32 whose last
    bit is worth 2^(e - 3), the e4m3 spacing at |y| (2^-9 below 2^-6: the subnormal grid), so the
    addition is the rounding, to even because C / 2^(e-3) is even; subtracting C again is exact. No
    clamp to +-448 is needed after a scale from the amax: |x / s| exceeds 448 by rounding only, and
    everything up to 464 rounds to 448, as the clamp followed by the cast gives.
    """
    c = y.view(torch.int32) & _EXPONENT_BITS
    c.clamp_(min=_MIN_EXPONENT).add_(_MAGIC_OFFSET)
    magic = c.view(torch.float32)
    return y.add_(magic).sub_(magic)


def matmul(x_w: torch.Tensor, w_w: torch.Tensor, bias: torch.Tensor | None,
           batch_invariant: bool = False) -> torch.Tensor:
    """bf16 GEMM x_w [M, K] @ w_w [N, K].T (+ bias) with float32 accumulation -> bf16 [M, N].

    A bias that is not bf16 is added afterwards in float32 (rounding it to bf16 first would lose bits).
    """
    fused = bias if bias is not None and bias.dtype == WORK_DTYPE else None
    if not batch_invariant:
        y = F.linear(x_w, w_w, fused)
    else:
        m = x_w.shape[0]
        pad = -m % INVARIANT_ROWS
        if pad:
            x_w = torch.cat([x_w, x_w.new_zeros(pad, x_w.shape[1])])
        y = torch.cat([F.linear(part, w_w, fused) for part in x_w.split(INVARIANT_ROWS)])[:m]
    if bias is not None and fused is None:
        y = y.float() + bias.float()
    return y


def widened_product(x_q: torch.Tensor, x_scale: torch.Tensor, act_kind: str, work: torch.Tensor) -> torch.Tensor:
    """float32 [M, N]: FP8 activations already quantized (`x_q`, `x_scale` of `act_kind`), widened as
    `widened_activation` rounds them, times the bf16 working copy `work [N, K]`, summed in float32 (a
    tensor-parallel partial product, summed over ranks before any rounding)."""
    x_w = dequantize(x_q, x_scale, ACT_GROUP[act_kind]).to(work.dtype)
    return x_w.float() @ work.float().t()


def prepare(w_q: torch.Tensor, w_scale: torch.Tensor, scheme: Scheme,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The per-layer state this backend needs beside the FP8 bytes: the bf16 working copy [N, K]."""
    return working_copy(w_q, w_scale, scheme, out)


def linear(x: torch.Tensor, weights: Weights, path: Path, x_w: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias in x.dtype. `weights.workspace`: the layer's working
    copy from `prepare` (None: widened for this call only, which is slow). `x_w` [M, K]: x's
    `widened_activation` when already made (by the layer, or by a sibling reading the same input)."""
    work = weights.workspace
    if work is None:
        work = working_copy(weights.w_q, weights.w_scale, path.scheme)
    if x_w is None:
        x_w = widened_activation(x, path.act)
    y = matmul(x_w, work, weights.bias, path.invariant)
    return y.to(x.dtype)
