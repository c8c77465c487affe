"""Split-K for decode-sized M: how many programs share an output tile along K, and the reduction kernel.

With few output tiles a GEMM splits K over SPLIT_K programs per tile: each writes its float32 partial
sum to a workspace [SPLITS, M, N], and `reduce_splits` adds the partials in a fixed order, applies the
row scales and the bias, and casts (deterministic; no atomics). Decode GEMMs are memory-bound and need
many loads in flight, hence about four programs per SM.
"""

import torch

from .triton_jit import cdiv
from .triton_support import memo, tl, triton

SPLIT_MIN_K = 512   # every split covers at least this much of K
INTERPRETER_SMS = 4  # the interpreter: small but > 1, so tests exercise the split path


@memo(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(tiles: int, k: int, sms: int) -> int:
    """Splits per tile when the config leaves it to the shape: enough for about four programs per SM
    when the tiles alone are fewer, each split at least SPLIT_MIN_K long."""
    return max(1, min(cdiv(4 * sms, tiles), k // SPLIT_MIN_K))


def split_k(cfg: dict, m: int, n: int, k: int, device: torch.device) -> int:
    """Programs per output tile along K: the config's SPLIT_K, or (0 = auto) `auto_splits`."""
    split = cfg.get("SPLIT_K", 0)
    if split:
        return split
    return auto_splits(cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), k, sm_count(device))


def k_per_split(k: int, split: int, block_k: int) -> int:
    """K elements per split, a multiple of BLOCK_K (so split edges fall on 128-wide scale groups)."""
    return cdiv(cdiv(k, split), block_k) * block_k


def split_sizes(cfg: dict, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(K per split, number of splits) of a launch."""
    k_split = k_per_split(k, split_k(cfg, m, n, k, device), cfg["BLOCK_K"])
    return k_split, cdiv(k, k_split)


def split_workspace(splits: int, y: torch.Tensor) -> torch.Tensor:
    """Where the GEMM kernel writes: `y` itself for one split, else a float32 workspace
    [splits, M, N] of partial sums."""
    return y if splits == 1 else torch.empty((splits, *y.shape), dtype=torch.float32, device=y.device)


def split_plan(cfg: dict, m: int, n: int, k: int, y: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(K per split, number of splits, where the GEMM kernel writes; see `split_workspace`)."""
    k_split, splits = split_sizes(cfg, m, n, k, y.device)
    return k_split, splits, split_workspace(splits, y)


@triton.jit
def store_partial(p_ptr, acc, offs_m, offs_n, M, N):
    """This program's float32 partial sum into slice program_id(1) of the workspace [SPLITS, M, N]."""
    p_ptrs = (p_ptr + tl.program_id(1).to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N
              + offs_n.to(tl.int64)[None, :])
    tl.store(p_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def split_reduce_kernel(p_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, stride_xs, stride_ws,
                        stride_ym, stride_yn, SPLITS: tl.constexpr, SCALED: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = (sum of the SPLITS partials [SPLITS, M, N], in order) * x_s[m] * w_s[n] + bias, cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + i * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if SCALED:
        acc = acc * (tl.load(xs_ptr + m * stride_xs, mask=mask, other=0.0)
                     * tl.load(ws_ptr + n * stride_ws, mask=mask, other=0.0))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def reduce_splits(part: torch.Tensor, x_s, sx: int, w_s, sw: int, bias, y: torch.Tensor,
                  scaled: bool) -> None:
    """y [M, N] from the partials part [SPLITS, M, N] (times x_s[m] * w_s[n] if `scaled`, + bias)."""
    splits, m, n = part.shape
    block = 1024
    split_reduce_kernel[(cdiv(m * n, block),)](
        part, x_s, w_s, bias if bias is not None else part, y, m, n, sx, sw, y.stride(0), y.stride(1),
        SPLITS=splits, SCALED=scaled, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
