"""Triton FP8 weight quantizers (at load time), with the bytes of `numerics.quantize_weight` (SPEC §4):
tensor (an amax pass, then a quantize pass), channel (the per-token kernel of `triton_quant`), and
128x128 blocks; plus a NaN/Inf check without a host sync. Wrappers check, allocate and launch.
"""

import math

import torch

from ..config import Scheme
from ..numerics import BLOCK_AMAX_FLOOR, E4M3FN, Fp8Format
from .triton_jit import abs_bits, as_f32, cdiv, to_fp8
from .triton_quant import GROUP, launch_row, pow2, require_input, warps_for
from .triton_support import tl, triton


# ---------------------------------------------------------------------------------------------
# Per tensor ("tensor" rule): s = amax / FMAX (amax == 0 -> 1 / (FMAX * 512)), q = fp8(x * (1/s)).
# Pass 1: each program folds the amax of its rows x K-span into an int32 scratch with atomic_max
# (amax >= 0 or +NaN, whose bit patterns order like integers, NaN above inf). Pass 2 quantizes.
# Also the weight "tensor" scheme.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_xm,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(1) * (BLOCK_K * K_ITERS) + tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    for i in range(K_ITERS):
        c = cols + i * BLOCK_K
        x = tl.load(x_rows + c[None, :], mask=row_ok[:, None] & (c < K)[None, :], other=0.0)
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def _launch_amax(x2: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """Fold max |x2| (as int32 bits, NaN above inf) into the int32 scalar `amax_bits` (atomic_max)."""
    M, K = x2.shape
    if M == 0 or K == 0:
        return
    # ~64K elements per program: one atomic per 128 KiB of bf16
    bk = min(pow2(K), 1024)
    bm = min(pow2(M), max(1, 8192 // bk))
    k_iters = max(1, min(cdiv(K, bk), 65536 // (bm * bk)))
    _amax_kernel[(cdiv(M, bm), cdiv(K, bk * k_iters))](
        x2, amax_bits, M, K, x2.stride(0),
        BLOCK_M=bm, BLOCK_K=bk, K_ITERS=k_iters, num_warps=warps_for(bm * bk))


@triton.jit
def _tensor_quant_kernel(x_ptr, q_ptr, amax_ptr, s_ptr, M, K, stride_xm, stride_qm,
                         FMAX: tl.constexpr, FLOOR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    amax = as_f32(tl.load(amax_ptr))
    s = tl.where(amax == 0.0, FLOOR, tl.math.div_rn(amax, FMAX))
    inv = tl.math.div_rn(1.0, s)
    tl.store(s_ptr, s, mask=(pid_m == 0) & (pid_k == 0))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) * inv
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], to_fp8(y, q_ptr, FMAX), mask=mask)


def _launch_tensor(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, amax_bits: torch.Tensor,
                   fmt: Fp8Format) -> None:
    """Per-tensor quantization of x2 [M, K] into q and the 0-d `s`; `amax_bits` is a zeroed int32."""
    M, K = x2.shape
    if M == 0 or K == 0:
        s.fill_(fmt.min_scale)  # amax of nothing is 0: the zero guard applies
        return
    _launch_amax(x2, amax_bits)
    bk = min(pow2(K), 2048)  # 8K-element tiles
    bm = min(pow2(M), max(1, 8192 // bk))
    _tensor_quant_kernel[(cdiv(M, bm), cdiv(K, bk))](
        x2, q, amax_bits, s, M, K, x2.stride(0), q.stride(0),
        FMAX=fmt.fmax, FLOOR=fmt.min_scale, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps_for(bm * bk))


# ---------------------------------------------------------------------------------------------
# Weight blocks ("block" rule): per 128x128 tile a = max(amax, 1e-4), s = a / FMAX,
# q = fp8(clamp(w * (1/s))). One program per tile; edge tiles are masked (padding is zero).
# ---------------------------------------------------------------------------------------------
@triton.jit
def _block_quant_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, stride_sn,
                        FMAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    rows64 = rows.to(tl.int64)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax = as_f32(tl.max(tl.max(abs_bits(w), axis=1), axis=0))
    s = tl.math.div_rn(tl.maximum(amax, FLOOR, propagate_nan=tl.PropagateNan.ALL), FMAX)
    inv = tl.math.div_rn(1.0, s)
    tl.store(q_ptr + rows64[:, None] * stride_qn + cols[None, :], to_fp8(w * inv, q_ptr, FMAX),
             mask=mask)
    tl.store(s_ptr + pid_n * stride_sn + pid_k, s)


def _launch_block(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fmt: Fp8Format) -> None:
    N, K = w.shape
    if N == 0 or K == 0:
        return
    _block_quant_kernel[(cdiv(N, GROUP), cdiv(K, GROUP))](
        w, q, s, N, K, w.stride(0), q.stride(0), s.stride(0),
        FMAX=fmt.fmax, FLOOR=BLOCK_AMAX_FLOOR, BLOCK=GROUP, num_warps=8)


def scale_shape(scheme: Scheme, e: int, n: int, k: int) -> tuple[int, ...]:
    """The float32 scales of `e` stacked `[n, k]` weights: tensor `[e]`, channel `[e, n, 1]`, block
    `[e, ceil(n/128), ceil(k/128)]`."""
    return {Scheme.TENSOR: (e,), Scheme.CHANNEL: (e, n, 1),
            Scheme.BLOCK: (e, cdiv(n, GROUP), cdiv(k, GROUP))}[scheme]


def quantize_weight(w: torch.Tensor, scheme: Scheme | str, fmt: Fp8Format = E4M3FN,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight `[N, K]` or stacked experts `[E, N, K]` with the bytes of
    `numerics.quantize_weight`: scale tensor `[]` (`[E]`), channel `[N, 1]` (`[E, N, 1]`),
    block `[ceil(N/128), ceil(K/128)]` (`[E, ...]`).

    `out`: (FP8 bytes, float32 scales) to write instead of new tensors, each contiguous with as many elements
    as the results (e.g. a layer's own storage, written in place); they are returned as given.
    Stacked experts take one launch for all of them (channel; block where N is a multiple of 128).
    NaN/Inf are not checked here (that would need a sync): call `weight_all_finite` first.
    """
    scheme = Scheme.parse(scheme)
    require_input(w, (2, 3), "quantize_weight")
    if w.stride(-1) != 1 and w.shape[-1] > 1:
        w = w.contiguous()
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    E, N, K = w3.shape
    dev = w.device
    shape = scale_shape(scheme, E, N, K)
    if out is None:
        q_out = torch.empty(w.shape, dtype=fmt.dtype, device=dev)
        s_out = torch.empty(shape[w.dim() == 2:], dtype=torch.float32, device=dev)
    else:
        q_out, s_out = out
        if (q_out.dtype != fmt.dtype or s_out.dtype != torch.float32 or q_out.numel() != w.numel()
                or s_out.numel() != math.prod(shape) or not (q_out.is_contiguous() and s_out.is_contiguous())
                or q_out.device != dev or s_out.device != dev):
            raise ValueError(f"quantize_weight: out= must be contiguous {fmt.dtype} of {tuple(w.shape)} and float32 "
                             f"of {shape} on {dev}; got {q_out.dtype} {tuple(q_out.shape)}, {s_out.dtype} "
                             f"{tuple(s_out.shape)}")
    q = q_out.view(E, N, K)
    s = s_out.view(shape)
    if scheme is Scheme.TENSOR:
        amax_bits = torch.zeros((E,), dtype=torch.int32, device=dev)
        for e in range(E):
            _launch_tensor(w3[e], q[e], s[e], amax_bits[e], fmt)
    elif scheme is Scheme.CHANNEL:   # rows of all experts alike: one launch
        launch_row(w3.reshape(E * N, K), q.view(E * N, K), s.view(E * N), fmt)
    elif N % GROUP == 0:   # no 128-row tile crosses two experts: one launch
        _launch_block(w3.reshape(E * N, K), q.view(E * N, K), s.view(E * (N // GROUP), -1), fmt)
    else:
        for e in range(E):
            _launch_block(w3[e], q[e], s[e], fmt)
    return q_out, s_out


def weight_all_finite(w: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on w's device: True when `w` ([N, K] or [E, N, K]) holds no NaN/Inf.

    One amax pass over the bits (|x| >= 0x7F800000 is inf or NaN), without a host sync; the caller
    reads the flag (one sync) at load time.
    """
    require_input(w, (1, 2, 3), "weight_all_finite")
    if w.stride(-1) != 1 and w.shape[-1] > 1:
        w = w.contiguous()
    w3 = w.reshape(1, 1, -1) if w.dim() == 1 else (w if w.dim() == 3 else w.unsqueeze(0))
    amax_bits = torch.zeros((), dtype=torch.int32, device=w.device)
    for e in range(w3.shape[0]):
        _launch_amax(w3[e], amax_bits)
    return amax_bits < 0x7F800000
