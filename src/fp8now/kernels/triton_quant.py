"""Triton FP8 quantizers for activations (every forward call); the weight quantizers (`triton_wquant`) share
the per-token kernel and these helpers.

Each produces the bytes and scales of `fp8now.numerics` (SPEC §4) exactly: the true divisions
of the spec use IEEE round-to-nearest division (`tl.math.div_rn`; plain `/` in Triton is
approximate), the reciprocal rules compute `div_rn(1, s)` and multiply, and every value is clamped
to ±FMAX before the round-to-nearest-even FP8 cast. Maxima propagate NaN like torch's `amax`.

Every wrapper only checks its arguments, allocates its outputs and launches kernels: no host
synchronization, no `.item()`, no environment lookups, so the wrappers can be captured in CUDA
graphs. On a CPU, the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before
this module is imported); see `available`.

Public functions:
    quantize_act_token(x)            -> q [M, K], s [M, 1]          rule "row"
    quantize_act_group(x, col_major) -> q [M, K], s [M, ceil(K/128)] rule "group" (1x128)
    available(device)                -> None, or why these kernels cannot run on `device`
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR, Fp8Format
from .triton_jit import abs_bits, as_f32, cdiv, to_fp8
from .triton_support import TRITON_ERROR, device_reason, gdc_launch_dependents, interpreted, sm90, tl, triton

GROUP = 128         # activation group width and weight block edge (SPEC §3)
# Per token: a row of up to _ROW_MAX_SINGLE elements is held in registers whole; longer rows are
# read twice (amax, then quantize: the 2nd read hits L2) in chunks: a whole row of 14336 is a wide,
# partly masked tile with few programs per SM, and at K = 28672 narrower chunks keep too many rows in
# flight for L2 to hold both reads (H200, BENCHMARKS.md). With few rows (decode: every row its own
# program) the one-shot load of a whole row has the least latency, so rows stay whole up to
# _ROW_MAX_SINGLE_FEW_ROWS there.
_ROW_MAX_SINGLE = 8192
_ROW_MAX_SINGLE_FEW_ROWS = 16384
_FEW_ROWS = 256
_ROW_CHUNKS = ((16384, 2048, 8), (None, 4096, 8))   # (K up to, chunk width, warps), rows read twice


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def warps_for(elements: int) -> int:
    """Warps for a tile: about 16 elements (32 bytes of bf16) per thread, 1..16 warps."""
    return max(1, min(16, elements // 512))


def require_input(x: torch.Tensor, ndim: tuple[int, ...], what: str) -> None:
    if TRITON_ERROR is not None:
        raise RuntimeError(f"{what}: triton is not importable ({TRITON_ERROR})")
    if x.dim() not in ndim:
        raise ValueError(f"{what} expects a tensor with {' or '.join(map(str, ndim))} dims, "
                         f"got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{what} expects bfloat16, float16 or float32 input, got {x.dtype}")


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """[..., K] -> [M, K] with unit column stride (a view when possible, as numerics does)."""
    require_input(x, (1, 2, 3, 4, 5, 6, 7, 8), what)
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


# ---------------------------------------------------------------------------------------------
# Per token ("row" rule): s = max(amax / FMAX, 1 / (FMAX * 512)), q = fp8(clamp(x / s)).
# Also the weight "channel" scheme. One program owns BLOCK_M whole rows.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _row_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm,
                      FMAX: tl.constexpr, FLOOR: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
                      EARLY: tl.constexpr):
    if EARLY:  # let a programmatic dependent launch of the next kernel start now (sm_90+)
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    q_rows = q_ptr + rows64[:, None] * stride_qm
    if SINGLE:  # the whole row fits in one tile: read it once
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = as_f32(tl.max(abs_bits(x), axis=1))
        s = tl.maximum(tl.math.div_rn(amax, FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)
        y = tl.math.div_rn(x, s[:, None])
        tl.store(q_rows + cols[None, :], to_fp8(y, q_ptr, FMAX), mask=mask)
    else:  # long rows: amax pass, then a quantize pass that reads the row again (from L2)
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (cols[None, :] + k0 < K)
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_last")
            acc = tl.maximum(acc, abs_bits(x))
        amax = as_f32(tl.max(acc, axis=1))
        s = tl.maximum(tl.math.div_rn(amax, FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (cols[None, :] + k0 < K)
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            y = tl.math.div_rn(x, s[:, None])
            tl.store(q_rows + k0 + cols[None, :], to_fp8(y, q_ptr, FMAX), mask=mask)
    tl.store(s_ptr + rows64, s, mask=row_ok)


def _row_plan(M: int, K: int, few_rows: int = _FEW_ROWS) -> tuple[bool, int, int, int]:
    """(whole rows?, BLOCK_K, BLOCK_M, warps) of the per-token kernel for x [M, K]; under `few_rows`
    rows, rows up to _ROW_MAX_SINGLE_FEW_ROWS stay whole."""
    if K <= (_ROW_MAX_SINGLE if M >= few_rows else _ROW_MAX_SINGLE_FEW_ROWS):
        block_k = max(pow2(K), 16)
        block_m = max(1, min(2048 // block_k, pow2(M), 64))
        return True, block_k, block_m, warps_for(block_m * block_k)
    block_k, warps = next((w, nw) for k_max, w, nw in _ROW_CHUNKS if k_max is None or K <= k_max)
    return False, block_k, 1, warps


def launch_row(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fmt: Fp8Format,
               early_launch: bool = False, few_rows: int = _FEW_ROWS) -> None:
    """Per-row quantization of x2 [M, K] into q [M, K] (row stride free) and s [M] (contiguous)."""
    M, K = x2.shape
    if M == 0:
        return
    single, block_k, block_m, warps = _row_plan(M, K, few_rows)
    _row_quant_kernel[(cdiv(M, block_m),)](
        x2, q, s, M, K, x2.stride(0), q.stride(0),
        FMAX=fmt.fmax, FLOOR=fmt.min_scale, BLOCK_M=block_m, BLOCK_K=block_k, SINGLE=single,
        EARLY=early_launch and sm90(x2.device) and not torch.compiler.is_compiling(), num_warps=warps)


def quantize_act_token(x: torch.Tensor, fmt: Fp8Format = E4M3FN, *, early_launch: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: `x [..., K]` -> `(q [M, K] fp8, s [M, 1] float32)`, rule "row" (SPEC §4).

    `early_launch` (sm_90+; ignored elsewhere and under torch.compile): every program first signals
    that a kernel launched next as a programmatic dependent (`triton_decode.decode_linear(...,
    pdl=True)`) may start. torch.compile drops PDL launches, so the signal would be useless there, and
    on triton 3.6 its inline asm makes torch assume the kernel writes every input.
    """
    x2 = _rows(x, "quantize_act_token")
    M, K = x2.shape
    q = torch.empty((M, K), dtype=fmt.dtype, device=x2.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x2.device)
    launch_row(x2, q, s, fmt, early_launch)
    return q, s


# ---------------------------------------------------------------------------------------------
# Per 1x128 group ("group" rule): s = max(amax, 1e-10) / FMAX, q = fp8(clamp(x / s)).
# A program owns a [BLOCK_M, GROUPS, 128] block; the last group of a row is zero-padded (masked).
# ---------------------------------------------------------------------------------------------
@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                        FMAX: tl.constexpr, FLOOR: tl.constexpr,
                        BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
                        EARLY: tl.constexpr):
    if EARLY:  # let a programmatic dependent launch of the next kernel start now (sm_90+)
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = groups[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]          # [G, 128]
    mask = row_ok[:, None, None] & (cols < K)[None, :, :]                      # [BM, G, 128]
    x = tl.load(x_ptr + rows64[:, None, None] * stride_xm + cols[None, :, :],
                mask=mask, other=0.0).to(tl.float32)
    amax = as_f32(tl.max(abs_bits(x), axis=2))                               # [BM, G]
    s = tl.math.div_rn(tl.maximum(amax, FLOOR, propagate_nan=tl.PropagateNan.ALL), FMAX)
    y = tl.math.div_rn(x, s[:, :, None])
    tl.store(q_ptr + rows64[:, None, None] * stride_qm + cols[None, :, :],
             to_fp8(y, q_ptr, FMAX), mask=mask)
    n_groups = (K + GROUP_K - 1) // GROUP_K
    tl.store(s_ptr + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, s,
             mask=row_ok[:, None] & (groups < n_groups)[None, :])


def quantize_act_group(x: torch.Tensor, col_major: bool = False, fmt: Fp8Format = E4M3FN, *,
                       early_launch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-1x128-group FP8: `x [..., K]` -> `(q [M, K], s [M, ceil(K/128)])`, rule "group".

    `col_major=True` returns the same scale values with strides (1, M) (storage [ceil(K/128), M],
    transposed), the layout torch's blockwise `_scaled_mm` expects. `early_launch`: as for
    `quantize_act_token`.
    """
    x2 = _rows(x, "quantize_act_group")
    M, K = x2.shape
    n_groups = cdiv(K, GROUP)
    q = torch.empty((M, K), dtype=fmt.dtype, device=x2.device)
    if col_major:
        s = torch.empty((n_groups, M), dtype=torch.float32, device=x2.device).t()
    else:
        s = torch.empty((M, n_groups), dtype=torch.float32, device=x2.device)
    if M == 0 or K == 0:
        return q, s
    block_m, groups, warps = _group_plan(M, n_groups, col_major)
    grid = (cdiv(M, block_m), cdiv(n_groups, groups))
    _group_quant_kernel[grid](
        x2, q, s, M, K, x2.stride(0), q.stride(0), s.stride(0), s.stride(1),
        FMAX=fmt.fmax, FLOOR=GROUP_AMAX_FLOOR, BLOCK_M=block_m, GROUPS=groups, GROUP_K=GROUP,
        EARLY=early_launch and sm90(x2.device) and not torch.compiler.is_compiling(), num_warps=warps)
    return q, s


def _group_plan(M: int, n_groups: int, col_major: bool) -> tuple[int, int, int]:
    """(BLOCK_M, GROUPS, warps) of the group quantizer: 16 groups of 128 per program, 2 warps (32
    elements per thread). Row-major scales: 2 rows x 8 groups; column-major: 8 rows x 2 groups, so a
    program writes 8 consecutive scales of each group column (swept on the H200; BENCHMARKS.md)."""
    want = min(2 if col_major else 8, pow2(n_groups))
    block_m = min(16 // want, pow2(M))
    groups = min(16 // block_m, pow2(n_groups))
    return block_m, groups, max(1, block_m * groups * GROUP // 1024)


def available(device: torch.device | str | None = None) -> str | None:
    """None when these kernels run on `device`; otherwise a short reason.

    Runs on CUDA GPUs of compute capability >= 8.9 (hardware FP8 conversion), and on the CPU
    only when Triton's interpreter was enabled (TRITON_INTERPRET=1) before this module was imported.
    """
    return device_reason(device, interpreted(_row_quant_kernel), TRITON_ERROR, (8, 9), "FP8 conversion")
