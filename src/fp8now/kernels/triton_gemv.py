"""FP8 GEMV for a few tokens (M <= 4): CUDA-core products, no tensor cores, no K split, no reduction tail.

At M = 1 a layer call only has to stream its FP8 weight once. The split-K decode kernel
(`triton_decode`) feeds a 16-row MMA tile with one real row and adds its K splits through a workspace,
a ticket and a re-read: a serial tail on every call. This kernel gives each program BLOCK_N whole
weight rows over all of K (contiguous loads per row), multiplies them by each activation row in
float32 (FP8 x FP8 products are exact in float32), one [BLOCK_N, BLOCK_K] accumulator per row, and
sums once at the end, so nothing is written but the output. The activation comes pre-quantized from
the Triton quantizer, launched with `early_launch` so that this kernel (a programmatic dependent
launch) starts while it runs. The plan (`plan.Table.gemv`) uses it where it measured faster
(BENCHMARKS.md). Measured and not planned: 2 and 4 rows (the accumulators per row cost registers, so
fewer weight bytes are in flight); reading the first weight chunk before the programmatic-dependent
wait; quantizing inside this kernel (every program quantized the whole row again).

Numerics (SPEC §4): float32 products and sums.
- tensor / channel: y[m, n] = (sum_k x_q[m, k] w_q[n, k]) * s_x[m] * s_w[n].
- block: y[m, n] = sum_k w_q[n, k] * (x_q[m, k] * (s_x[m, g] * s_w[n/128, g])) with g = k / 128: the
  scale of each K-block is applied to its activation values before their products, not to their partial
  sum (the same float32 operations in another order: rounding-level differences, far inside
  SPEC's rel_diff < 1e-4; it keeps the inner loop elementwise).
No host synchronization: captures in CUDA graphs, runs under torch.compile.
"""

import torch

from . import triton_jit as tj
from .plan import GEMV_MAX_M, rows_bucket
from .triton_support import gdc_wait, require_triton, sm90, tl, triton

# Launch configs by (ROWS, activation scales: "token" for tensor / channel, "group" for block), then by
# N: (largest N, config) rows, the last a catch-all (triton_jit.pick); M = 1 from a sweep on the H200
# (BENCHMARKS.md). More rows hold ROWS x BLOCK_N x BLOCK_K float32 products per program, so BLOCK_K
# shrinks with ROWS.
_C = dict(num_warps=4)
GEMV_CONFIGS = {
    (1, "token"): [(4096, dict(BLOCK_N=4, BLOCK_K=1024, **_C)), (None, dict(BLOCK_N=8, BLOCK_K=512, **_C))],
    (1, "group"): [(4096, dict(BLOCK_N=8, BLOCK_K=1024, **_C)), (6144, dict(BLOCK_N=8, BLOCK_K=512, **_C)),
                   (8192, dict(BLOCK_N=16, BLOCK_K=512, **_C)), (None, dict(BLOCK_N=8, BLOCK_K=512, **_C))],
    (2, "token"): [(None, dict(BLOCK_N=4, BLOCK_K=1024, **_C))],
    (2, "group"): [(None, dict(BLOCK_N=4, BLOCK_K=1024, **_C))],
    (4, "token"): [(None, dict(BLOCK_N=4, BLOCK_K=512, **_C))],
    (4, "group"): [(None, dict(BLOCK_N=4, BLOCK_K=512, **_C))],
}
MAX_M = GEMV_MAX_M
W_KINDS = ("tensor", "channel", "block")


@triton.jit
def _wrapped_row(r, M):
    """Row r of the activation as an int64 tensor, wrapped onto a real row past M (never stored); a
    tensor even when r and M are both constants (torch.compile may pass M = 1 as one)."""
    return tl.full((), r, tl.int64) % M


@triton.jit
def _x_row(x_ptr, xs_ptr, sw_tile, r, M, kk, k_ok, stride_xm, stride_xsm, stride_xsk, stride_wsk,
           ACT_GROUP: tl.constexpr):
    """[BLOCK_K] float32 values of activation row r (past M: a real row, never stored) at K offsets kk;
    for block each times its group's s_x[r, g] * s_w[tile, g]."""
    rr = _wrapped_row(r, M)
    xk = tl.load(x_ptr + rr * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
    if ACT_GROUP:
        gk = kk // 128
        xk *= (tl.load(xs_ptr + rr * stride_xsm + gk * stride_xsk, mask=k_ok, other=0.0)
               * tl.load(sw_tile + gk * stride_wsk, mask=k_ok, other=0.0))
    return xk


@triton.jit
def _store_row(acc, r, M, xs_ptr, ws_ptr, b_ptr, y_ptr, rn, offs_n, N, stride_xsm, stride_wsn, stride_ym,
               ACT_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[r, n] = sum_k acc[n, k] (times s_x[r] * s_w[n] unless block) + bias[n], for r < M."""
    y = tl.sum(acc, axis=1)
    if not ACT_GROUP:
        y = y * (tl.load(xs_ptr + _wrapped_row(r, M) * stride_xsm) * tl.load(ws_ptr + rn * stride_wsn))
    if HAS_BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)
    tl.store(y_ptr + r * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty),
             mask=(offs_n < N) & (offs_n * 0 + r < M))


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xsm, stride_xsk,
                 stride_ym, stride_wn, stride_wsn, stride_wsk, ACT_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # one [BLOCK_N, BLOCK_K] float32 accumulator per activation row (ROWS <= 4), each reduced once at the end
    tl.static_assert(ROWS == 1 or ROWS == 2 or ROWS == 4)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)          # rows past N wrap onto real ones (the store masks them)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None] * stride_wn                                                   # [BN, 1]
    # block: every weight row of this program lies in one 128-row weight tile (BLOCK_N divides 128)
    sw_tile = ws_ptr + ((tl.program_id(0) * BLOCK_N) // 128).to(tl.int64) * stride_wsn
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PDL:  # launched early (programmatic dependent launch): wait for the quantizer's writes
        gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        wf = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)      # [BN, BK]
        args = (x_ptr, xs_ptr, sw_tile)
        strides = (stride_xm, stride_xsm, stride_xsk, stride_wsk)
        acc0 += wf * _x_row(*args, 0, M, kk, k_ok, *strides, ACT_GROUP)[None, :]
        if ROWS >= 2:
            acc1 += wf * _x_row(*args, 1, M, kk, k_ok, *strides, ACT_GROUP)[None, :]
        if ROWS == 4:
            acc2 += wf * _x_row(*args, 2, M, kk, k_ok, *strides, ACT_GROUP)[None, :]
            acc3 += wf * _x_row(*args, 3, M, kk, k_ok, *strides, ACT_GROUP)[None, :]
    out = (xs_ptr, ws_ptr, b_ptr, y_ptr, rn, offs_n, N, stride_xsm, stride_wsn, stride_ym, ACT_GROUP, HAS_BIAS)
    _store_row(acc0, 0, M, *out)
    if ROWS >= 2:
        _store_row(acc1, 1, M, *out)
    if ROWS == 4:
        _store_row(acc2, 2, M, *out)
        _store_row(acc3, 3, M, *out)


def gemv(x_q: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_kind: str,
         bias: torch.Tensor | None = None, *, x_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
         config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """y [M, N] = dequant(x_q [M, K]) @ dequant(W).T (+ bias) for M <= MAX_M tokens, in `out_dtype`.

    w_kind "tensor" (w_s 0-d / [1]) or "channel" (w_s [N, 1]) with per-token scales `x_scale` [M, 1]
    (or one per-tensor value); w_kind "block" (w_s [ceil(N/128), K/128], K % 128 == 0) with the
    1x128-group scales `x_scale` [M, K/128] (any strides). `config` (BLOCK_N, BLOCK_K, num_warps)
    overrides the config GEMV_CONFIGS picks for this ROWS, scale kind and N. `pdl` (sm_90; ignored elsewhere and under torch.compile):
    launch as a programmatic dependent of the previous kernel (pair it with the quantizer's
    `early_launch=True`).
    """
    require_triton()
    if w_kind not in W_KINDS:
        raise ValueError(f"w_kind must be one of {W_KINDS}, got {w_kind!r}")
    if w_q.dim() != 2 or w_q.dtype != tj.FP8_DTYPE or w_q.stride(1) != 1:
        raise ValueError(f"w_q must be a 2-D {tj.FP8_DTYPE} tensor, contiguous along K; got {w_q.dtype} "
                         f"{tuple(w_q.shape)} strides {w_q.stride()}")
    N, K = w_q.shape
    if x_q.dtype != tj.FP8_DTYPE or x_q.shape[-1] != K:
        raise ValueError(f"x_q must be the pre-quantized [M, {K}] {tj.FP8_DTYPE} rows, got {x_q.dtype} "
                         f"{tuple(x_q.shape)}")
    x2 = x_q.reshape(-1, K)
    M = x2.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv takes 1 to {MAX_M} rows, got M={M}")
    if x2.device != w_q.device:
        raise ValueError(f"x_q on {x2.device} but w_q on {w_q.device}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    rows = rows_bucket(M)
    cfg = dict(tj.pick(GEMV_CONFIGS[rows, "group" if w_kind == "block" else "token"], N), **(config or {}))
    if cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1) or cfg["BLOCK_N"] > 128:
        raise ValueError(f"BLOCK_N (<= 128) and BLOCK_K must be powers of two, got {cfg}")
    sxm = sxk = 0
    if w_kind == "block":
        if K % tj.SCALE_BLOCK:
            raise ValueError(f"block gemv needs K divisible by {tj.SCALE_BLOCK}, got K={K}")
        tj.check_block_scale(w_s, N, K, "w_s", w_q.device, tj.SCALE_BLOCK)
        tj.check_block_scale(x_scale, M, K, "x_scale", x2.device, 1)
        swn, swk, sxm, sxk = w_s.stride(0), w_s.stride(1), x_scale.stride(0), x_scale.stride(1)
    else:
        swn, swk = tj.vector_scale(w_s, N, "w_s", w_q.device), 0
        sxm = tj.vector_scale(x_scale, M, "x_scale", x2.device)
    bias = tj.check_bias(bias, N, w_q.device)
    tj.check_out_dtype(out_dtype)
    y = torch.empty((M, N), dtype=out_dtype, device=w_q.device)
    if N == 0:
        return y
    launch = {"launch_pdl": True} if pdl and sm90(w_q.device) and not torch.compiler.is_compiling() else {}
    _gemv_kernel[(tj.cdiv(N, cfg["BLOCK_N"]),)](
        x2, x_scale, w_q, w_s, bias if bias is not None else w_s, y, M, N, K, x2.stride(0), sxm, sxk,
        y.stride(0), w_q.stride(0), swn, swk, ACT_GROUP=w_kind == "block", HAS_BIAS=bias is not None,
        ROWS=rows, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PDL=bool(launch), num_warps=cfg["num_warps"],
        **launch)
    return y
