"""SiLU(gate) * up in one pass, writing either the product `h [M, I]` in the activation dtype (for a
down_proj that is not FP8) or only its FP8 bytes `q [M, I]` with per-token `s [M, 1]` or per-1x128-group
`s [M, ceil(I/128)]` scales (the input of an FP8 down_proj, which then needs no quantizer).

The product has transformers' rounding points (`act_fn(gate) * up` on bf16/fp16 tensors: SiLU in
float32 rounded to the dtype, the product rounded again), and q, s are exactly what `triton_quant`
makes of that h (SPEC §4), so down_proj reads the bytes it would have quantized itself. SiLU's exp is
Triton's, so h can differ from torch's SiLU by one rounding step in rare elements. Per token the row
amax comes first: at decode sizes (up to _SINGLE_ROWS rows) a row of up to _SINGLE_MAX elements is held whole;
otherwise a row is computed twice in _CHUNK-column steps (amax pass, then quantize pass; its inputs are read
again from L2), which on an H100 ran 1.4-1.5x faster than whole rows at 2048 and 16384 rows of Llama's and
Qwen3's widths (eight warps at low register counts keep several rows in flight per SM, where a whole 14336-wide
row held one 16-warp program per SM; `git show b6768f4:benchmarks/probe_silu.py`, BENCHMARKS.md "Whole model").
Wrapper: check -> allocate -> launch; no host sync.
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from .triton_jit import abs_bits, as_f32, cdiv, to_fp8
from .triton_moe_act import round_as
from .triton_norm import DTYPES, quantize_row
from .triton_quant import GROUP, pow2, warps_for
from .triton_support import require_triton, tl, triton

_SINGLE_MAX = 16384     # per token: whole rows up to this many elements, else two passes in chunks
_SINGLE_ROWS = 128      # per token: whole rows only up to this many rows (decode); more rows take the two passes
_CHUNK = 2048           # columns per step of the two-pass rows, and per program of the bf16 / group kernel


@triton.jit
def _silu_mul(g_row, u_row, cols, mask, like_ptr):
    """SiLU(gate) * up at `cols` of one row, rounded as torch rounds them (float32 values)."""
    g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_row + cols, mask=mask, other=0.0).to(tl.float32)
    return round_as(round_as(tl.math.div_rn(g, 1.0 + tl.exp(-g)), like_ptr) * u, like_ptr)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, I, stride_gm, stride_um, stride_hm, stride_qm, stride_sm,
                     QUANT: tl.constexpr, FMAX: tl.constexpr, GROUP_FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, BLOCK columns): h (QUANT 0) or its FP8 bytes and 1x128-group scales (QUANT 2)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    h = _silu_mul(g_ptr + row * stride_gm, u_ptr + row * stride_um, cols, mask, g_ptr)
    if QUANT == 0:
        tl.store(h_ptr + row * stride_hm + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        q_row = q_ptr + row * stride_qm + tl.program_id(1) * BLOCK
        s_row = s_ptr + row * stride_sm + tl.program_id(1) * (BLOCK // 128)
        quantize_row(h, tl.arange(0, BLOCK), mask, q_row, s_row, 1, I - tl.program_id(1) * BLOCK, QUANT, FMAX,
                     1.0, GROUP_FLOOR, BLOCK)


@triton.jit
def _silu_mul_token_kernel(g_ptr, u_ptr, q_ptr, s_ptr, I, stride_gm, stride_um, stride_qm,
                           FMAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """One row per program: whole (SINGLE), or an amax pass and a pass that recomputes and quantizes."""
    row = tl.program_id(0).to(tl.int64)
    g_row, u_row, q_row = g_ptr + row * stride_gm, u_ptr + row * stride_um, q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        h = _silu_mul(g_row, u_row, cols, cols < I, g_ptr)
        quantize_row(h, cols, cols < I, q_row, s_ptr + row, 1, I, 1, FMAX, FLOOR, 1.0, BLOCK)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for c0 in range(0, I, BLOCK):
            acc = tl.maximum(acc, abs_bits(_silu_mul(g_row, u_row, c0 + cols, c0 + cols < I, g_ptr)))
        s = tl.maximum(tl.math.div_rn(as_f32(tl.max(acc, axis=0)), FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)
        for c0 in range(0, I, BLOCK):
            h = _silu_mul(g_row, u_row, c0 + cols, c0 + cols < I, g_ptr)
            tl.store(q_row + c0 + cols, to_fp8(tl.math.div_rn(h, s), q_row, FMAX), mask=c0 + cols < I)
        tl.store(s_ptr + row, s)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, act: str | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`gate, up [M, I]` -> `h [M, I]` in their dtype (act None), or `(q [M, I] fp8, s [M, 1] | [M, I/128])`
    for act "token" / "group"."""
    require_triton()
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype or gate.dtype not in DTYPES:
        raise ValueError(f"silu_mul: gate and up must be [M, I] of one dtype among {DTYPES}, got "
                         f"{gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}")
    if gate.stride(1) != 1 or up.stride(1) != 1 or gate.device != up.device:
        raise ValueError("silu_mul: gate and up must have unit column stride, on one device")
    if act not in (None, "token", "group"):
        raise ValueError(f"silu_mul: act must be None, 'token' or 'group', got {act!r}")
    m, i = gate.shape
    if act is None:
        h = torch.empty((m, i), dtype=gate.dtype, device=gate.device)
        if m and i:
            block = min(pow2(i), _CHUNK)
            _silu_mul_kernel[(m, cdiv(i, block))](gate, up, h, h, h, i, gate.stride(0), up.stride(0), h.stride(0),
                                                  0, 0, QUANT=0, FMAX=E4M3FN.fmax, GROUP_FLOOR=GROUP_AMAX_FLOOR,
                                                  BLOCK=block, num_warps=warps_for(block))
        return h
    q = torch.empty((m, i), dtype=E4M3FN.dtype, device=gate.device)
    s = torch.empty((m, 1 if act == "token" else cdiv(i, GROUP)), dtype=torch.float32, device=gate.device)
    if m == 0 or i == 0:
        return q, s
    if act == "group":
        block = max(min(pow2(i), _CHUNK), GROUP)
        _silu_mul_kernel[(m, cdiv(i, block))](gate, up, q, q, s, i, gate.stride(0), up.stride(0), 0, q.stride(0),
                                              s.stride(0), QUANT=2, FMAX=E4M3FN.fmax, GROUP_FLOOR=GROUP_AMAX_FLOOR,
                                              BLOCK=block, num_warps=warps_for(block))
    else:
        single = i <= _SINGLE_MAX and m <= _SINGLE_ROWS
        block = pow2(i) if single else min(pow2(i), _CHUNK)
        _silu_mul_token_kernel[(m,)](gate, up, q, s, i, gate.stride(0), up.stride(0), q.stride(0),
                                     FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale, BLOCK=block, SINGLE=single,
                                     num_warps=warps_for(block) if single else max(1, min(8, block // 256)))
    return q, s
