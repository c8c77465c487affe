"""Block-scaled FP8 GEMM: 1x128 activation groups x 128x128 weight tiles, the scale product applied per
K-block in float32 (SPEC §4). Decode-sized M splits K (`triton_splitk`); `batch_invariant=True` uses one
fixed configuration for every M and never splits K (SPEC §8). Wrapper: check -> allocate -> launch."""

import torch

from .triton_jit import (SCALE_BLOCK, cdiv, check_bias, check_block_scale, check_fp8_operands, check_out_dtype,
                         grouped_pid, merge_config, pick, store_tile, tile_offsets)
from .triton_splitk import reduce_splits, split_plan, store_partial
from .triton_support import require_triton, tl, triton

# M bucket -> config, tuned on the H200 (BENCHMARKS.md): 16-row tiles and split-K (auto) for decode-sized
# M, 128x128 tiles with 8 warps and 4 stages for prefill. BLOCK_K is the scale group (128).
BLOCK_TABLE = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=0)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4, SPLIT_K=0)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=1)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_K=1)),
)
# One configuration for every M (SPEC §8): 64-row tiles keep wgmma usable, 64 columns keep enough
# programs for decode-sized batches, and K is never split.
INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4,
                         SPLIT_K=1)


@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                       M, N, K, K_SPLIT,
                       stride_xm, stride_xk, stride_xsm, stride_xsk,
                       stride_wn, stride_wk, stride_wsn, stride_wsk,
                       stride_ym, stride_yn,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    offs_m, offs_n, offs_k, rm, rn = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_begin + offs_k[None, :]) * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + (k_begin + offs_k[:, None]) * stride_wk + rn[None, :] * stride_wn  # [BK, BN]
    xs_ptrs = xs_ptr + rm * stride_xsm
    if 128 % BLOCK_N == 0:  # the tile lies in one weight-scale row: one scalar per K-block
        ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    else:                   # wider tiles: one scale per column (n // 128)
        ws_ptrs = ws_ptr + (rn // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_left = k_end - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(xs_ptrs + (k0 // 128) * stride_xsk)
        sb = tl.load(ws_ptrs + (k0 // 128) * stride_wsk)
        # fresh fp32 block product, promoted into the accumulator with this K-block's scales
        if 128 % BLOCK_N == 0:
            acc += tl.dot(a, b) * (sa * sb)[:, None]
        else:
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if PARTIAL:  # split-K: this split's scaled partial sum
        store_partial(y_ptr, acc, offs_m, offs_n, M, N)
    else:
        store_tile(y_ptr, acc, b_ptr, rn, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS)


def block_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
               config: dict | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """y [M, N] = sum_kb (x_q[:, kb] @ w_q[:, kb].T) * x_s[:, kb] * w_s[n // 128, kb] (+ bias).

    x_q [M, K] fp8, x_s [M, ceil(K/128)] float32 (any strides, e.g. column-major), w_q [N, K] fp8,
    w_s [ceil(N/128), ceil(K/128)] float32. `config` (BLOCK_M, BLOCK_N, GROUP_M, num_warps,
    num_stages, SPLIT_K; BLOCK_K must stay 128) overrides the M-bucket table; `batch_invariant` uses
    one fixed configuration instead of the table (a given `config` still wins).
    """
    require_triton()
    M, N, K = check_fp8_operands(x_q, w_q)
    check_block_scale(x_s, M, K, "x_s", x_q.device, 1)
    check_block_scale(w_s, N, K, "w_s", x_q.device, SCALE_BLOCK)
    bias = check_bias(bias, N, x_q.device)
    check_out_dtype(out_dtype)
    base = INVARIANT_CONFIG if batch_invariant else pick(BLOCK_TABLE, M)
    cfg = merge_config(base, config, block_k=SCALE_BLOCK)
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    k_split, splits, out = split_plan(cfg, M, N, K, y)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), splits)
    # Without bias, b_ptr gets a read-only stand-in (never y: no argument aliases the written output).
    _block_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out,
        M, N, K, k_split,
        x_q.stride(0), x_q.stride(1), x_s.stride(0), x_s.stride(1),
        w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1),
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        reduce_splits(out, w_s, 0, w_s, 0, bias, y, scaled=False)
    return y
