"""The experts' gated activation fused with the FP8 quantization of its output: `h [S, 2Ip]` (gate
columns, then up columns) -> `q [S, Ip]` fp8 with per-row (token) or per-1x128-group scales.

The activation rounds to the activation dtype wherever `moe.Fp8Experts._gated` does (each torch op on a
bf16/fp16 tensor rounds its result), so the quantizer sees the values the reference path quantizes; the
quantization then follows SPEC §4 exactly (IEEE division, clamp, round-to-nearest-even cast).
Wrapper: check -> allocate -> launch; no host sync.
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from .triton_jit import abs_bits, as_f32, cdiv, to_fp8
from .triton_quant import GROUP, pow2
from .triton_support import require_triton, tl, triton

# Gate kinds of the kernel: act(gate) * up with SiLU, and GPT-OSS's clamped SwiGLU.
GATE_CODES = {"silu": 0, "clamped_swiglu": 1}
_TOKEN_CHUNK = 2048   # columns per step of the per-token kernel (two passes over a row)
_GROUPS = 8           # 1x128 groups per program of the per-group kernel


@triton.jit
def round_as(v, like_ptr):
    """float32 `v` rounded to nearest even in the element type of `like_ptr` (the activation dtype), back
    in float32. bf16 by integer arithmetic on the bits: the same result as the GPU's cast, and also
    under Triton's interpreter, whose float32 -> bf16 cast truncates."""
    if like_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def gated_values(g, u, alpha, limit, like_ptr, GATE: tl.constexpr):
    """The gated activation of float32 gate and up values (already in like_ptr's dtype), with the
    reference's rounding points (each op rounds to like_ptr's element type)."""
    if GATE == 0:   # silu(gate) * up
        a = round_as(tl.math.div_rn(g, 1.0 + tl.exp(-g)), like_ptr)
        return round_as(a * u, like_ptr)
    else:           # (clamp(up, ±limit) + 1) * (g * sigmoid(alpha * g)), g = min(gate, limit)
        alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)   # compile passes fp64
        g = round_as(tl.minimum(g, limit), like_ptr)
        u = round_as(tl.clamp(u, -limit, limit), like_ptr)
        ga = round_as(g * alpha, like_ptr)
        sig = round_as(tl.math.div_rn(1.0, 1.0 + tl.exp(-ga)), like_ptr)
        glu = round_as(g * sig, like_ptr)
        return round_as(round_as(u + 1.0, like_ptr) * glu, like_ptr)


@triton.jit
def _gated(h_row, cols, mask, I, alpha, limit, GATE: tl.constexpr):
    """The gated activation of columns `cols` of one row of h."""
    g = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    return gated_values(g, u, alpha, limit, h_row, GATE)


@triton.jit
def _gated_token_kernel(h_ptr, q_ptr, s_ptr, I, stride_hm, stride_qm, alpha, limit,
                        GATE: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: the activation's amax pass, then a pass that recomputes and quantizes it."""
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * stride_hm
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, I, BLOCK):
        a = _gated(h_row, c0 + cols, c0 + cols < I, I, alpha, limit, GATE)
        acc = tl.maximum(acc, abs_bits(a))
    amax = as_f32(tl.max(acc, axis=0))
    s = tl.maximum(tl.math.div_rn(amax, FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)
    for c0 in range(0, I, BLOCK):
        mask = c0 + cols < I
        a = _gated(h_row, c0 + cols, mask, I, alpha, limit, GATE)
        tl.store(q_ptr + row * stride_qm + c0 + cols, to_fp8(tl.math.div_rn(a, s), q_ptr, FMAX), mask=mask)
    tl.store(s_ptr + row, s)


@triton.jit
def _gated_group_kernel(h_ptr, q_ptr, s_ptr, I, stride_hm, stride_qm, stride_sm, alpha, limit,
                        GATE: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr,
                        GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
    """Program (row, GROUPS groups of 128 columns): activation, per-group scale, quantized store."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]          # [G, 128]
    mask = cols < I
    a = _gated(h_ptr + row * stride_hm, cols, mask, I, alpha, limit, GATE)
    amax = as_f32(tl.max(abs_bits(a), axis=1))                                  # [G]
    s = tl.math.div_rn(tl.maximum(amax, FLOOR, propagate_nan=tl.PropagateNan.ALL), FMAX)
    tl.store(q_ptr + row * stride_qm + cols, to_fp8(tl.math.div_rn(a, s[:, None]), q_ptr, FMAX), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups, s, mask=groups * GROUP_K < I)


def gated_quant(h: torch.Tensor, gate: str, act: str, alpha: float = 1.702, limit: float = 7.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`h [S, 2Ip]` -> `(q [S, Ip] fp8, s [S, 1] (act "token") or [S, Ip/128] (act "group") float32)`."""
    require_triton()
    if gate not in GATE_CODES:
        raise ValueError(f"gated_quant: unknown gate {gate!r}; valid: {', '.join(GATE_CODES)}")
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"gated_quant expects a row-major h [S, 2I], got shape {tuple(h.shape)}")
    s_rows, i = h.shape[0], h.shape[1] // 2
    if act == "group" and i % GROUP:
        raise ValueError(f"gated_quant: 1x128 groups need I divisible by 128 (I={i}; the block scheme pads it)")
    q = torch.empty((s_rows, i), dtype=E4M3FN.dtype, device=h.device)
    s = torch.empty((s_rows, 1 if act == "token" else i // GROUP), dtype=torch.float32, device=h.device)
    if s_rows == 0 or i == 0:
        return q, s
    common = dict(GATE=GATE_CODES[gate], FMAX=E4M3FN.fmax)
    if act == "token":
        block = min(pow2(i), _TOKEN_CHUNK)
        _gated_token_kernel[(s_rows,)](h, q, s, i, h.stride(0), q.stride(0), alpha, limit,
                                       FLOOR=E4M3FN.min_scale, BLOCK=block, num_warps=max(1, min(8, block // 256)),
                                       **common)
    elif act == "group":
        groups = min(_GROUPS, pow2(i // GROUP))
        _gated_group_kernel[(s_rows, cdiv(i // GROUP, groups))](
            h, q, s, i, h.stride(0), q.stride(0), s.stride(0), alpha, limit,
            FLOOR=GROUP_AMAX_FLOOR, GROUPS=groups, GROUP_K=GROUP, num_warps=max(1, groups // 2), **common)
    else:
        raise ValueError(f"gated_quant: act must be 'token' or 'group', got {act!r}")
    return q, s
