"""RMSNorm in one pass, optionally writing the FP8 bytes and scales of its output too (the input of the
q/k/v or gate/up linears after it): `x [M, K]` -> `y [M, K]` in x's dtype, and `q [M, K]` fp8 with
per-token `s [M, 1]` or per-1x128-group `s [M, ceil(K/128)]` scales.

The norm is the formula of transformers' Llama / Qwen3 RMSNorm with its rounding points:
h = x * rsqrt(mean(x²) + eps) in float32 (the mean as a product with float32 1/K, as torch's CUDA mean
takes it; each x² rounded: no fused multiply-add, except under torch.compile), rounded to x's dtype, then y = weight * h rounded
again. The sum of squares is this kernel's own (one tree over the row), so y can differ from torch's
by one rounding step in rare elements; `q`, `s` are then exactly what `triton_quant` makes of this
`y` (SPEC §4: IEEE division, clamp, round-to-nearest-even cast), so a layer reading them sees the bytes
it would have quantized itself. One program owns one row, whole, in registers (K <= MAX_K).
Wrapper: check -> allocate -> launch; no host sync (captures in CUDA graphs, runs under torch.compile).
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from .triton_jit import abs_bits, as_f32, to_fp8
from .triton_moe_act import round_as
from .triton_quant import GROUP, pow2, warps_for
from .triton_support import require_triton, tl, triton

MAX_K = 32768                      # a row held in one program's registers
QUANT_CODES = {None: 0, "token": 1, "group": 2}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def quantize_row(y, cols, mask, q_row, s_row, stride_sg, K, QUANT: tl.constexpr, FMAX: tl.constexpr,
                 TOKEN_FLOOR: tl.constexpr, GROUP_FLOOR: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store the FP8 bytes of one whole row `y` [BLOCK_K] (float32, zero past K) and its scales:
    per token (QUANT 1) or per 1x128 group (QUANT 2), as `triton_quant` computes them."""
    if QUANT == 1:
        s = tl.maximum(tl.math.div_rn(as_f32(tl.max(abs_bits(y), axis=0)), FMAX), TOKEN_FLOOR,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_row + cols, to_fp8(tl.math.div_rn(y, s), q_row, FMAX), mask=mask)
        tl.store(s_row, s)
    elif QUANT == 2:
        yg = tl.reshape(y, (BLOCK_K // 128, 128))
        sg = tl.math.div_rn(tl.maximum(as_f32(tl.max(abs_bits(yg), axis=1)), GROUP_FLOOR,
                                       propagate_nan=tl.PropagateNan.ALL), FMAX)            # [G]
        qg = to_fp8(tl.math.div_rn(yg, sg[:, None]), q_row, FMAX)
        tl.store(q_row + cols, tl.reshape(qg, (BLOCK_K,)), mask=mask)
        groups = tl.arange(0, BLOCK_K // 128)
        tl.store(s_row + groups * stride_sg, sg, mask=groups * 128 < K)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, K, inv_k, eps, stride_xm, stride_ym, stride_qm, stride_sm,
                     stride_sg, QUANT: tl.constexpr, FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr,
                     GROUP_FLOOR: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) * tl.cast(inv_k, tl.float32)      # the mean as torch's CUDA reduction takes it
    h = round_as(x * tl.math.rsqrt(var + tl.cast(eps, tl.float32)), y_ptr)     # .to(x.dtype)
    y = round_as(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * h, y_ptr)   # weight * h
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    quantize_row(y, cols, mask, q_ptr + row * stride_qm, s_ptr + row * stride_sm, stride_sg, K, QUANT, FMAX,
                 TOKEN_FLOOR, GROUP_FLOOR, BLOCK_K)


def unfit(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None if `rms_norm` takes x [..., K] with this weight, else why not."""
    k = x.shape[-1]
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"x and weight must share a dtype among {DTYPES}, got {x.dtype} and {weight.dtype}"
    if weight.shape != (k,) or weight.device != x.device:
        return f"weight must be [{k}] on {x.device}, got {tuple(weight.shape)} on {weight.device}"
    if not 1 <= k <= MAX_K:
        return f"rows of 1 to {MAX_K} elements, got {k}"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`x [M, K]` -> `(y [M, K] in x.dtype, q [M, K] fp8 | None, s | None)`: the RMSNorm, and for `act`
    "token" / "group" the FP8 bytes of y with scales [M, 1] / [M, ceil(K/128)]."""
    require_triton()
    if act not in QUANT_CODES:
        raise ValueError(f"rms_norm: act must be None, 'token' or 'group', got {act!r}")
    why = unfit(x, weight) or (None if x.dim() == 2 and x.stride(1) == 1 else "x must be [M, K], unit stride")
    if why is not None:
        raise ValueError(f"rms_norm: {why}")
    m, k = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    q = s = None
    if act is not None:
        q = torch.empty((m, k), dtype=E4M3FN.dtype, device=x.device)
        s = torch.empty((m, 1 if act == "token" else -(-k // GROUP)), dtype=torch.float32, device=x.device)
    if m == 0:
        return y, q, s
    block = max(pow2(k), GROUP)
    # x² rounded before the sum, as torch's pow: no contraction into fused multiply-adds (a compile option
    # torch.compile does not pass on to a user kernel: compiled, the sum may use them)
    rounded_squares = {} if torch.compiler.is_compiling() else {"enable_fp_fusion": False}
    _rms_norm_kernel[(m,)](x, weight, y, y if q is None else q, y if s is None else s, k, 1.0 / k, eps, x.stride(0),
                           y.stride(0), 0 if q is None else q.stride(0), 0 if s is None else s.stride(0),
                           0 if s is None else s.stride(1), QUANT=QUANT_CODES[act], FMAX=E4M3FN.fmax,
                           TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR, BLOCK_K=block,
                           num_warps=min(warps_for(block), 8), **rounded_squares)
    return y, q, s
