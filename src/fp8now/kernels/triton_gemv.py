"""FP8 GEMV for a few tokens (M <= 4): CUDA-core products, no tensor cores, no K split, no reduction tail.

At M = 1 a layer call only has to stream its FP8 weight once. The split-K decode kernel
(`triton_decode`) feeds a 16-row MMA tile with one real row and adds its K splits through a workspace,
a ticket and a re-read: a serial tail on every call. This kernel gives each program BLOCK_N whole
weight rows over all of K (contiguous loads per row), multiplies them by each activation row in
float32 (FP8 x FP8 products are exact in float32), one [BLOCK_N, BLOCK_K] accumulator per row, and
sums once at the end, so nothing is written but the output. The activation comes pre-quantized (from
the Triton quantizer, launched with `early_launch` so that this kernel, a programmatic dependent
launch, starts while it runs; or from the kernel in front of the layer, `fp8now.layers.producers`), or in
bf16 and quantized here (QUANT_X; `plan.Table.quant_inside`): every program first reads its rows over
all of K for their per-token amax (from L2: a decode row is 8-28 KB), then quantizes each K chunk as it
multiplies it, into the bytes of `triton_quant` (per 1x128 group no first pass: each chunk holds whole
groups). The plan (`plan.Table.gemv`) uses the GEMV where it measured faster (BENCHMARKS.md). Measured
and not planned: 2 and 4 rows (the accumulators per row cost registers, so fewer weight bytes are in
flight); reading the first weight chunk before the programmatic-dependent wait.

Numerics (SPEC §4): float32 products and sums.
- tensor / channel: y[m, n] = (sum_k x_q[m, k] w_q[n, k]) * s_x[m] * s_w[n].
- block: y[m, n] = sum_k w_q[n, k] * (x_q[m, k] * (s_x[m, g] * s_w[n/128, g])) with g = k / 128: the
  scale of each K-block is applied to its activation values before their products, not to their partial
  sum (the same float32 operations in another order: rounding-level differences, far inside
  SPEC's rel_diff < 1e-4; it keeps the inner loop elementwise).
No host synchronization: captures in CUDA graphs, runs under torch.compile.
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from . import triton_jit as tj
from .plan import GEMV_MAX_M, rows_bucket
from .triton_jit import abs_bits, as_f32, to_fp8
from .triton_quant import pow2
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
AMAX_K = 4096   # at most this many elements per load of the per-token amax pass (QUANT_X)
W_KINDS = ("tensor", "channel", "block")


@triton.jit
def _wrapped_row(r, M):
    """Row r of the activation as an int64 tensor, wrapped onto a real row past M (never stored); a
    tensor even when r and M are both constants (torch.compile may pass M = 1 as one)."""
    return tl.full((), r, tl.int64) % M


@triton.jit
def _row_scale(x_ptr, r, M, K, stride_xm, FMAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK_K: tl.constexpr):
    """The per-token scale of bf16 activation row r, read over all of K: max(amax / FMAX, FLOOR) (SPEC §4)."""
    row = x_ptr + _wrapped_row(r, M) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    bits = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        bits = tl.maximum(bits, abs_bits(tl.load(row + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)))
    return tl.maximum(tl.math.div_rn(as_f32(tl.max(bits, axis=0)), FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _x_row(x_ptr, xs_ptr, sw_tile, w_ptr, r, M, K, k0, kk, k_ok, s_tok, stride_xm, stride_xsm, stride_xsk, stride_wsk,
           ACT_GROUP: tl.constexpr, QUANT_X: tl.constexpr, FMAX: tl.constexpr, GROUP_FLOOR: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """[BLOCK_K] float32 FP8 values of activation row r (past M: a real row, never stored) at K offsets kk;
    for block each times its group's s_x[r, g] * s_w[tile, g]. QUANT_X: x is bf16/fp16/fp32 and quantized
    here as the Triton quantizers do (per token by `s_tok`; per 1x128 group: BLOCK_K holds whole groups)."""
    rr = _wrapped_row(r, M)
    xk = tl.load(x_ptr + rr * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
    if QUANT_X and ACT_GROUP:
        xg = tl.reshape(xk, (BLOCK_K // 128, 128))
        sg = tl.math.div_rn(tl.maximum(as_f32(tl.max(abs_bits(xg), axis=1)), GROUP_FLOOR,
                                       propagate_nan=tl.PropagateNan.ALL), FMAX)                   # [G]
        qg = to_fp8(tl.math.div_rn(xg, sg[:, None]), w_ptr, FMAX).to(tl.float32)
        gk = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        swg = tl.load(sw_tile + gk * stride_wsk, mask=gk * 128 < K, other=0.0)
        xk = tl.reshape(qg * (sg * swg)[:, None], (BLOCK_K,))
    elif QUANT_X:
        xk = to_fp8(tl.math.div_rn(xk, s_tok), w_ptr, FMAX).to(tl.float32)
    elif ACT_GROUP:
        gk = kk // 128
        xk *= (tl.load(xs_ptr + rr * stride_xsm + gk * stride_xsk, mask=k_ok, other=0.0)
               * tl.load(sw_tile + gk * stride_wsk, mask=k_ok, other=0.0))
    return xk


@triton.jit
def _scale_of_row(x_ptr, xs_ptr, r, M, K, stride_xm, stride_xsm, ACT_GROUP: tl.constexpr, QUANT_X: tl.constexpr,
                  FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr, BLOCK_K: tl.constexpr):
    """s_x of row r for token scales: computed here (QUANT_X) or read; 1 for groups (applied per K-block)."""
    if ACT_GROUP:
        s = tl.full((), 1.0, tl.float32)
    elif QUANT_X:
        s = _row_scale(x_ptr, r, M, K, stride_xm, FMAX, TOKEN_FLOOR, BLOCK_K)
    else:
        s = tl.load(xs_ptr + _wrapped_row(r, M) * stride_xsm)
    return s


@triton.jit
def _store_row(acc, r, M, s_x, ws_ptr, b_ptr, y_ptr, rn, offs_n, N, stride_wsn, stride_ym,
               ACT_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[r, n] = sum_k acc[n, k] (times s_x[r] * s_w[n] unless block) + bias[n], for r < M."""
    y = tl.sum(acc, axis=1)
    if not ACT_GROUP:
        y = y * (s_x * tl.load(ws_ptr + rn * stride_wsn))
    if HAS_BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)
    tl.store(y_ptr + r * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty),
             mask=(offs_n < N) & (offs_n * 0 + r < M))


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xsm, stride_xsk,
                 stride_ym, stride_wn, stride_wsn, stride_wsk, ACT_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 QUANT_X: tl.constexpr, FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr, GROUP_FLOOR: tl.constexpr,
                 AMAX_K: tl.constexpr):
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
    # token scales: each row's, read, or (QUANT_X) from its amax over all of K (the rows sit in L2), read
    # AMAX_K elements at a time (a 4096-wide row in one load: one L2 round trip before the weight stream)
    rows = (x_ptr, xs_ptr)
    row_args = (M, K, stride_xm, stride_xsm)   # (constexprs are passed one by one: a tuple drops them)
    s0 = _scale_of_row(*rows, 0, *row_args, ACT_GROUP, QUANT_X, FMAX, TOKEN_FLOOR, AMAX_K)
    s1 = s0
    s2 = s0
    s3 = s0
    if ROWS >= 2:
        s1 = _scale_of_row(*rows, 1, *row_args, ACT_GROUP, QUANT_X, FMAX, TOKEN_FLOOR, AMAX_K)
    if ROWS == 4:
        s2 = _scale_of_row(*rows, 2, *row_args, ACT_GROUP, QUANT_X, FMAX, TOKEN_FLOOR, AMAX_K)
        s3 = _scale_of_row(*rows, 3, *row_args, ACT_GROUP, QUANT_X, FMAX, TOKEN_FLOOR, AMAX_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        wf = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)      # [BN, BK]
        args = (x_ptr, xs_ptr, sw_tile, w_ptr)
        strides = (stride_xm, stride_xsm, stride_xsk, stride_wsk)
        acc0 += wf * _x_row(*args, 0, M, K, k0, kk, k_ok, s0, *strides, ACT_GROUP, QUANT_X, FMAX, GROUP_FLOOR,
                            BLOCK_K)[None, :]
        if ROWS >= 2:
            acc1 += wf * _x_row(*args, 1, M, K, k0, kk, k_ok, s1, *strides, ACT_GROUP, QUANT_X, FMAX, GROUP_FLOOR,
                                BLOCK_K)[None, :]
        if ROWS == 4:
            acc2 += wf * _x_row(*args, 2, M, K, k0, kk, k_ok, s2, *strides, ACT_GROUP, QUANT_X, FMAX, GROUP_FLOOR,
                                BLOCK_K)[None, :]
            acc3 += wf * _x_row(*args, 3, M, K, k0, kk, k_ok, s3, *strides, ACT_GROUP, QUANT_X, FMAX, GROUP_FLOOR,
                                BLOCK_K)[None, :]
    out = (ws_ptr, b_ptr, y_ptr, rn, offs_n, N, stride_wsn, stride_ym)
    _store_row(acc0, 0, M, s0, *out, ACT_GROUP, HAS_BIAS)
    if ROWS >= 2:
        _store_row(acc1, 1, M, s1, *out, ACT_GROUP, HAS_BIAS)
    if ROWS == 4:
        _store_row(acc2, 2, M, s2, *out, ACT_GROUP, HAS_BIAS)
        _store_row(acc3, 3, M, s3, *out, ACT_GROUP, HAS_BIAS)


def gemv_config(rows: int, w_kind: str, n: int) -> dict:
    """The launch config GEMV_CONFIGS gives `rows` activation rows (1, 2 or 4) of a `w_kind` weight with N = n."""
    return tj.pick(GEMV_CONFIGS[rows, "group" if w_kind == "block" else "token"], n)


def gemv(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_kind: str,
         bias: torch.Tensor | None = None, *, x_scale: torch.Tensor | None, out_dtype: torch.dtype | None = None,
         config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ dequant(W).T (+ bias) for M <= MAX_M tokens, in `out_dtype`.

    `x` is the pre-quantized FP8 rows with their `x_scale`, or (x_scale None) bf16/fp16/fp32 rows that
    the kernel quantizes itself into the bytes of the Triton quantizers (no quantizer launch).
    w_kind "tensor" (w_s 0-d / [1]) or "channel" (w_s [N, 1]) with per-token scales `x_scale` [M, 1]
    (or one per-tensor value); w_kind "block" (w_s [ceil(N/128), K/128], K % 128 == 0) with the
    1x128-group scales `x_scale` [M, K/128] (any strides). `out_dtype`: default x's dtype, bf16 for FP8
    rows. `config` (BLOCK_N, BLOCK_K, num_warps) overrides the config GEMV_CONFIGS picks for this ROWS,
    scale kind and N. `pdl` (sm_90; ignored elsewhere and under torch.compile): launch as a programmatic
    dependent of the previous kernel (pair it with the quantizer's `early_launch=True`).
    """
    require_triton()
    if w_kind not in W_KINDS:
        raise ValueError(f"w_kind must be one of {W_KINDS}, got {w_kind!r}")
    if w_q.dim() != 2 or w_q.dtype != tj.FP8_DTYPE or w_q.stride(1) != 1:
        raise ValueError(f"w_q must be a 2-D {tj.FP8_DTYPE} tensor, contiguous along K; got {w_q.dtype} "
                         f"{tuple(w_q.shape)} strides {w_q.stride()}")
    N, K = w_q.shape
    quant_x = x_scale is None
    if quant_x:
        x2 = tj.flatten_act(x, K)
    elif x.dtype != tj.FP8_DTYPE or x.shape[-1] != K:
        raise ValueError(f"x with x_scale must be the pre-quantized [M, {K}] {tj.FP8_DTYPE} rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    else:
        x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv takes 1 to {MAX_M} rows, got M={M}")
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    rows = rows_bucket(M)
    cfg = dict(gemv_config(rows, w_kind, N), **(config or {}))
    if cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1) or cfg["BLOCK_N"] > 128:
        raise ValueError(f"BLOCK_N (<= 128) and BLOCK_K must be powers of two, got {cfg}")
    sxm = sxk = 0
    if w_kind == "block":
        if K % tj.SCALE_BLOCK:
            raise ValueError(f"block gemv needs K divisible by {tj.SCALE_BLOCK}, got K={K}")
        if quant_x and cfg["BLOCK_K"] % tj.SCALE_BLOCK:
            raise ValueError(f"a block gemv quantizing its input needs BLOCK_K a multiple of 128, got {cfg}")
        tj.check_block_scale(w_s, N, K, "w_s", w_q.device, tj.SCALE_BLOCK)
        if not quant_x:
            tj.check_block_scale(x_scale, M, K, "x_scale", x2.device, 1)
            sxm, sxk = x_scale.stride(0), x_scale.stride(1)
        swn, swk = w_s.stride(0), w_s.stride(1)
    else:
        swn, swk = tj.vector_scale(w_s, N, "w_s", w_q.device), 0
        sxm = 0 if quant_x else tj.vector_scale(x_scale, M, "x_scale", x2.device)
    bias = tj.check_bias(bias, N, w_q.device)
    out_dtype = out_dtype or (x2.dtype if quant_x else torch.bfloat16)
    tj.check_out_dtype(out_dtype)
    y = torch.empty((M, N), dtype=out_dtype, device=w_q.device)
    if N == 0:
        return y
    launch = {"launch_pdl": True} if pdl and sm90(w_q.device) and not torch.compiler.is_compiling() else {}
    _gemv_kernel[(tj.cdiv(N, cfg["BLOCK_N"]),)](
        x2, w_s if quant_x else x_scale, w_q, w_s, bias if bias is not None else w_s, y, M, N, K, x2.stride(0),
        sxm, sxk, y.stride(0), w_q.stride(0), swn, swk, ACT_GROUP=w_kind == "block", HAS_BIAS=bias is not None,
        ROWS=rows, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PDL=bool(launch), QUANT_X=quant_x,
        FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR, AMAX_K=min(pow2(K), AMAX_K),
        num_warps=cfg["num_warps"], **launch)
    return y
