"""Row-scaled FP8 GEMM: per-token x per-channel (or single) scales applied once after the float32 dot
over K (SPEC §4). Its launch configs are the block GEMM's; decode-sized M splits K (`triton_splitk`);
`batch_invariant=True` uses one fixed configuration for every M. Wrapper: check -> allocate -> launch."""

import torch

from .triton_block import BLOCK_TABLE, INVARIANT_CONFIG
from .triton_jit import (cdiv, check_bias, check_fp8_operands, check_out_dtype, grouped_pid, merge_config,
                         pick, store_tile, tile_offsets, vector_scale)
from .triton_splitk import reduce_splits, split_plan, store_partial
from .triton_support import require_triton, tl, triton

@triton.jit(do_not_specialize=["M"])
def _rowwise_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, one,
                         M, N, K, K_SPLIT,
                         stride_xm, stride_xk, stride_xs, stride_wn, stride_wk, stride_ws,
                         stride_ym, stride_yn,
                         HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         FAST_ACCUM: tl.constexpr):
    pid_m, pid_n = grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    offs_m, offs_n, offs_k, rm, rn = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_begin + offs_k[None, :]) * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + (k_begin + offs_k[:, None]) * stride_wk + rn[None, :] * stride_wn  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_left = k_end - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if FAST_ACCUM:  # all of K in the MMA's own accumulator (on sm_90 Triton's fp8 dot default never
            # promotes it: max_num_imprecise_acc = 2**30): Hopper's fast accumulation
            acc = tl.dot(a, b, acc)
        else:
            # Each K-block's product is promoted into a full float32 accumulator: Hopper's FP8 MMA keeps
            # fewer bits while it accumulates, and `acc += dot` would be folded into the MMA's own
            # accumulator. Multiplying by the run-time 1.0 `one` keeps the two apart.
            acc += tl.dot(a, b) * tl.cast(one, tl.float32)  # (torch.compile passes the float as fp64)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if PARTIAL:  # split-K: the unscaled partial sum (the reduction applies the row scales)
        store_partial(y_ptr, acc, offs_m, offs_n, M, N)
    else:
        sa = tl.load(xs_ptr + rm * stride_xs)
        sb = tl.load(ws_ptr + rn * stride_ws)
        acc = acc * (sa[:, None] * sb[None, :])
        store_tile(y_ptr, acc, b_ptr, rn, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS)


def rowwise_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                 batch_invariant: bool = False, config: dict | None = None,
                 fast_accum: bool = False) -> torch.Tensor:
    """y [M, N] = (x_q @ w_q.T) * x_s[m] * w_s[n] (+ bias), the dot over all of K in float32.

    x_s: per-token [M, 1] (or [M]) or a single scale (0-d / [1]); w_s: per-channel [N, 1] (or [N])
    or 0-d / [1]. `batch_invariant` uses one fixed configuration for every M; `config` (BLOCK_M,
    BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K) overrides. `fast_accum`: each K split
    accumulates in the tensor cores' own accumulator (Fp8Config.fast_accum) instead of float32 per K-block.
    """
    require_triton()
    M, N, K = check_fp8_operands(x_q, w_q)
    sx = vector_scale(x_s, M, "x_s", x_q.device)
    sw = vector_scale(w_s, N, "w_s", x_q.device)
    bias = check_bias(bias, N, x_q.device)
    check_out_dtype(out_dtype)
    base = INVARIANT_CONFIG if batch_invariant else pick(BLOCK_TABLE, M)
    cfg = merge_config(base, config)
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    k_split, splits, out = split_plan(cfg, M, N, K, y)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), splits)
    _rowwise_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out, 1.0,
        M, N, K, k_split,
        x_q.stride(0), x_q.stride(1), sx, w_q.stride(0), w_q.stride(1), sw,
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], FAST_ACCUM=fast_accum,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        reduce_splits(out, x_s, sx, w_s, sw, bias, y, scaled=True)
    return y
