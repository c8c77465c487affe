"""The Triton FP8 MoE path: routed slots sorted by expert (`moe_align`), a grouped FP8 GEMM for `w13`, the
gated activation fused with its quantization (`triton_moe_act`), a grouped FP8 GEMM for `w2`, and the
weighted combine in a fixed per-token order (SPEC §8); or, for few routed slots, the two launches of
`triton_moe_direct` (the plan's `kernel`).

Launches only, no host sync: sizes come from T, k and E, never from the routing, so the whole forward
captures in a CUDA graph. Blocks of experts that received no tokens exit at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..config import Scheme
from .moe_align import Routing, align, align_chunked, align_triton
from .plan import MoePath
from .triton_jit import FP8_DTYPE, SCALE_BLOCK, cdiv, grouped_pid
from .triton_jit import available as gemm_available
from .triton_moe_act import gated_quant, round_as
from .triton_moe_direct import direct_forward
from .triton_quant import available as quant_available, quantize_act_group, quantize_act_token
from .triton_support import require_triton, tl, triton

# act_fn classes the fused activation computes (the families' experts use SiLU; GPT-OSS its own gate).
SILU_CLASSES = ("SiLU", "SiLUActivation")
# MoePath.align -> the alignment that implements it (the same result from each)
ALIGNS = {"torch": align, "triton": align_triton, "triton-chunked": align_chunked}


class ExpertWeights(NamedTuple):
    """A layer's stacked FP8 experts (SPEC §3), in the padded storage layout of `Fp8Experts`."""

    w13: torch.Tensor                # [E, 2Ip, Hp] fp8
    w13_scale: torch.Tensor          # [E] / [E, 2Ip, 1] / [E, 2Ip/128, Hp/128] float32
    w2: torch.Tensor                 # [E, Hp, Ip] fp8
    w2_scale: torch.Tensor           # [E] / [E, Hp, 1] / [E, Hp/128, Ip/128] float32
    w13_bias: torch.Tensor | None    # [E, 2Ip]
    w2_bias: torch.Tensor | None     # [E, Hp]


class Gate(NamedTuple):
    """The fused activation: "silu" (silu(gate) * up) or "clamped_swiglu" with its alpha and limit."""

    kind: str
    alpha: float = 1.702
    limit: float = 7.0


def gate_of(gate: str, act_fn: nn.Module | None, alpha: float, limit: float) -> Gate | str:
    """The `Gate` of an experts module's activation, or why the fused kernel cannot compute it."""
    if gate == "clamped_swiglu":
        return Gate("clamped_swiglu", alpha, limit)
    if gate == "glu" and type(act_fn).__name__ in SILU_CLASSES:
        return Gate("silu")
    return (f"the fused activation computes silu(gate) * up and GPT-OSS's clamped SwiGLU, not "
            f"{gate} with {type(act_fn).__name__}")


def available(device: torch.device, gate: str, act_fn: nn.Module | None, hp: int, ip: int) -> str | None:
    """None if the Triton MoE path runs experts `[Hp, Ip]` with this activation on `device`, else why not."""
    for why in (quant_available(device), gemm_available(device)):
        if why is not None:
            return why
    g = gate_of(gate, act_fn, 0.0, 0.0)
    if isinstance(g, str):
        return g
    if hp % 16 or ip % 16:
        return f"FP8 GEMMs need H and I divisible by 16 (H={hp}, I={ip})"
    return None


@triton.jit
def _moe_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, slots_ptr, block_expert_ptr, one,
                     M, N, K, ROW_DIV,
                     stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wk,
                     stride_wse, stride_wsn, stride_wsk, stride_be, stride_ym,
                     GROUP_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, FAST_ACCUM: tl.constexpr = False):
    """Program (M-block, N-tile): rows gathered through the sorted slots, one expert's weight. M: the
    M-blocks' rows (blocks x BLOCK_M); GROUP_M M-blocks walk every N tile before the next GROUP_M start."""
    pid_m, pid_n = grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        e64 = e.to(tl.int64)
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot >= 0
        row = tl.where(valid, slot // ROW_DIV, 0).to(tl.int64)          # A row: token (w13) or slot (w2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = (offs_n % N).to(tl.int64)                                   # wraps onto valid columns
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]                          # [BM, BK]
        w_ptrs = w_ptr + e64 * stride_we + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn  # [BK, BN]
        ws_ptrs = ws_ptr + e64 * stride_wse + (rn // 128 if GROUP_SCALES else rn) * stride_wsn    # [BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            # each K block's product is promoted into a float32 accumulator of its own (not folded
            # into the MMA's accumulator, which keeps fewer bits for FP8 on Hopper)
            if GROUP_SCALES:
                sa = tl.load(as_ptr + row * stride_asm + (k0 // 128) * stride_ask)
                sb = tl.load(ws_ptrs + (k0 // 128) * stride_wsk)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            elif FAST_ACCUM:   # Fp8Config(fast_accum=True): all of K in the MMA's own accumulator
                acc = tl.dot(a, b, acc)
            else:
                acc += tl.dot(a, b) * tl.cast(one, tl.float32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if not GROUP_SCALES:
            acc = acc * (tl.load(as_ptr + row * stride_asm)[:, None] * tl.load(ws_ptrs)[None, :])
        if HAS_BIAS:
            acc += tl.load(b_ptr + e64 * stride_be + rn).to(tl.float32)[None, :]
        y_ptrs = y_ptr + slot.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, round_as(acc, y_ptr).to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])


def group_m(path: MoePath, k: int) -> int:
    """M-blocks per group of the grouped GEMM's launch order: as many as keep `path.a_reuse_bytes` of FP8
    A rows (BLOCK_M x K bytes each; a power of two, >= 1); 0 bytes: every M-block (one N tile after another)."""
    if not path.a_reuse_bytes:
        return 1 << 16    # more M-blocks than a launch has (and GROUP_M x N tiles stays an int32): M-blocks fastest
    fit = max(1, path.a_reuse_bytes // (path.block_m * k))
    return 1 << (fit.bit_length() - 1)


def moe_gemm(a_q: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             bias: torch.Tensor | None, routing: Routing, slots: int, row_div: int, out_dtype: torch.dtype,
             path: MoePath) -> torch.Tensor:
    """y [S, N]: row `slot` = quantized A row `slot // row_div` (a_q [R, K]) times expert e's w [E, N, K]
    (scales applied in the kernel), + bias [E, N]; slots nobody routed stay unwritten."""
    require_triton()
    if a_q.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or a_q.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("moe_gemm expects row-major float8_e4m3fn a_q [R, K] and w [E, N, K]")
    n, k = w.shape[1], w.shape[2]
    if a_q.shape[1] != k:
        raise ValueError(f"moe_gemm: K mismatch, a_q {tuple(a_q.shape)} vs w {tuple(w.shape)}")
    group = path.scheme is Scheme.BLOCK
    y = torch.empty((slots, n), dtype=out_dtype, device=a_q.device)
    blocks = routing.block_expert.numel()
    if blocks == 0 or n == 0:
        return y
    if group:
        ws_strides = w_s.stride()
    elif w_s.dim() == 1:     # tensor: one scale per expert, the same for every column
        ws_strides = (w_s.stride(0), 0, 0)
    else:                    # channel: [E, N, 1]
        ws_strides = (w_s.stride(0), w_s.stride(1), 0)
    _moe_gemm_kernel[(blocks * cdiv(n, path.block_n),)](
        a_q, a_s, w, w_s, bias if bias is not None else w_s, y, routing.slots, routing.block_expert, 1.0,
        blocks * path.block_m, n, k, row_div,
        a_q.stride(0), a_s.stride(0), a_s.stride(1) if group else 0, w.stride(0), w.stride(1), w.stride(2),
        *ws_strides, bias.stride(0) if bias is not None else 0, y.stride(0),
        GROUP_SCALES=group, HAS_BIAS=bias is not None,
        BLOCK_M=path.block_m, BLOCK_N=path.block_n, BLOCK_K=SCALE_BLOCK, GROUP_M=group_m(path, k),
        FAST_ACCUM=path.fast_accum and not group,
        num_warps=path.num_warps, num_stages=path.num_stages)
    return y


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_ym, stride_wt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[t * k + j] in float32, j ascending: one fixed order per token whatever
    the batch (the compiler may fuse a product and its sum into one FMA; torch.compile drops the
    launch option that would stop it, and the order, not the FMA, is what invariance needs)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * stride_wt + j).to(tl.float32)
        p = tl.load(y_ptr + (t * TOP_K + j) * stride_ym + cols, mask=mask, other=0.0).to(tl.float32) * w
        acc = p if j == 0 else acc + p
    tl.store(out_ptr + t * stride_ot + cols, round_as(acc, out_ptr).to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, top_k_weights: torch.Tensor, h: int, out_dtype: torch.dtype) -> torch.Tensor:
    """`y [T*k, Hp]` (row t*k + j: token t's j-th expert) weighted by `top_k_weights [T, k]` -> `[T, h]`."""
    t, k = top_k_weights.shape
    w = top_k_weights if top_k_weights.stride(1) == 1 else top_k_weights.contiguous()
    out = torch.empty((t, h), dtype=out_dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    block = min(1024, max(16, 1 << (h - 1).bit_length()))
    _combine_kernel[(t, cdiv(h, block))](y, w, out, h, y.stride(0), w.stride(0), out.stride(0),
                                         TOP_K=k, BLOCK_H=block, num_warps=4)
    return out


def experts_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    weights: ExpertWeights, gate: Gate, path: MoePath, counters: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`x [T, H]` routed by `top_k_index [T, k]` with `top_k_weights [T, k]` -> `[T, H]` in x.dtype;
    `counters`: the direct kernels' (`triton_moe_direct.direct_counters`; None: zeros per call)."""
    if path.kernel == "direct":
        return direct_forward(x, top_k_index, top_k_weights, *weights, gate, path, counters)
    t, k = top_k_index.shape
    e, hp, ip = weights.w2.shape
    h = x.shape[1]
    if t == 0:
        return x.new_zeros((0, h))
    xp = x if h == hp else nn.functional.pad(x, (0, hp - h))
    x_q, x_s = (quantize_act_group if path.act == "group" else quantize_act_token)(xp)   # once per token
    routing = ALIGNS[path.align](top_k_index, e, path.block_m)
    hid = moe_gemm(x_q, x_s, weights.w13, weights.w13_scale, weights.w13_bias, routing, t * k, k, x.dtype, path)
    a_q, a_s = gated_quant(hid, gate.kind, path.act, gate.alpha, gate.limit)
    y = moe_gemm(a_q, a_s, weights.w2, weights.w2_scale, weights.w2_bias, routing, t * k, 1, x.dtype, path)
    return combine(y, top_k_weights, h, x.dtype)   # a fixed order per token: batch-invariant

