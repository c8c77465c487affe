"""The `triton` backend (sm_89+): Triton activation quantization in front of the fastest GEMM.

Per call, by M (the thresholds are the dispatch data, measured on the H200, BENCHMARKS.md):
- decode, M <= triton_decode.MAX_M (16), GPU time in CUDA graphs (benchmarks/bench_decode.py, H200):
  - M = 1, where GEMV_N says so (channel always; tensor up to N = 6144; block from N = 4096): the Triton
    quantizer, then `triton_gemv.gemv`, CUDA-core products with no K split and no reduction tail,
    as a programmatic dependent launch (benchmarks/probe_decode_floor.py: channel at 4096 x 4096
    9.7 against 11.5 µs for the decode kernel path below, 1.50x bf16 against 1.26x).
  - tensor / channel: the Triton per-token quantizer, then `triton_decode.decode_linear` on the FP8
    rows, a split-K GEMM that reduces its own splits (two launches; the same GPU time as quantizer +
    split-K GEMM + reduce kernel: 0.97-1.07x faster over the 42 tensor and channel rows; quantizing
    inside the kernel lost almost everywhere: every program first reads its rows over all of K).
    At M <= PDL_MAX_M the decode kernel is a programmatic dependent launch (sm_90): it starts while
    the quantizer runs (1.01-1.08x faster over the 12 measured rows at M = 1 and 4, mixed at 16).
    For N in FEW_SPLITS_N: 2 K splits (4 for a long K on few tiles, `few_splits`), 6 stages, and two
    splits added by an exchange of partial sums through atomics instead of the ticket's store, fence
    and re-read.
  - tensor, M = 1 above GEMV_N's N (TENSORWISE_M1): one row's per-token scale is a per-tensor
    scale, so the Triton quantizer, then cuBLAS tensorwise `_scaled_mm` with both scales 0-d
    (1.05-1.21x faster than the decode kernel on 6 of the 7 benchmark shapes, probe_kernels.py
    m1cublas; 57344 x 8192: 116.5 vs 139.2 µs). Rowwise cuBLAS at M = 1 (channel) is slower than the
    decode kernel on every shape (0.55-0.87x).
  - block, M = 1 and N <= FUSED_BLOCK_MAX_N: `decode_linear` quantizing the 1x128 groups itself
    (one launch; 1.03-1.12x faster than the three-launch path at N <= 8192, 0.84-0.95x at N >= 28672).
  - block, N in FEW_SPLITS_N: the Triton group quantizer, then `decode_linear` on the groups with
    twice the few-split plan's splits.
  - block otherwise: the Triton group quantizer, then the split-K Triton block GEMM (its reduce
    kernel included), which beat `decode_linear` on pre-quantized groups at large N (57344 x 8192,
    M=16: 123 vs 155 µs).
- tensor / channel, M > 16: the Triton per-token quantizer, then for M <= TRITON_MAX_M["rowwise"]
  the Triton rowwise GEMM (split-K over the SMs), for larger M cuBLAS `_scaled_mm` rowwise.
- block, M > 16: the Triton 1x128 group quantizer, then for M <= TRITON_MAX_M["block"] the Triton
  block GEMM (split-K), for larger M torch's blockwise `scaled_mm` (column-major scales) where
  `BLOCK_GEMM` says so and cuBLAS takes this K (`torch_mm.blockwise_unfit`: K divisible by 512),
  else the Triton block GEMM. cuBLAS was 1.37-1.50x faster than the Triton block GEMM (GEMM alone)
  at M = 256 to 16384 and K = 7168 to 28672.
The thresholds come from CUDA-graph timings (GPU time, no host overhead) of both paths at M = 16, 32
and 64 over the seven benchmark shapes (benchmarks/tune_decode.py): the Triton rowwise GEMM beat cuBLAS
on 20 of 21 rows; the Triton block GEMM won at M <= 32 but not reliably at 64.
- batch_invariant: Triton quantizer + Triton GEMM with one fixed configuration for every M.
- Under torch.compile, where COMPILED_QUANT says so, the per-token quantizer is `numerics`' own torch
  ops instead of the Triton kernel (same bytes: its true divisions become `numerics.exact_div32` while
  compiling): inductor fuses them into the kernel that produces the activation and quantizes an input
  shared by several layers once. The GEMMs are the same as eagerly.
All of it is launches only: no host synchronization, so it captures in CUDA graphs.
"""

from __future__ import annotations

import torch

from ..config import Scheme
from .. import numerics
from . import torch_mm, triton_decode, triton_gemm, triton_gemv, triton_quant

TRITON_MAX_M = {"rowwise": 64, "block": 32}   # at or below: the Triton GEMMs (split-K for decode)
FUSED_BLOCK_MAX_N = 8192  # block, M = 1: quantize inside the decode kernel up to this many outputs
PDL_MAX_M = 4             # tensor / channel decode: programmatic dependent launch up to this M
TENSORWISE_M1 = True      # tensor scheme, M = 1: cuBLAS tensorwise instead of the decode kernel
# The Triton quantizer, then the CUDA-core GEMV (triton_gemv), keyed by scheme, then by the GEMV's row
# bucket (triton_gemv.rows_bucket(M): 1, 2, 4): the range of N (inclusive) that takes it; a bucket
# missing: never. H200, GPU time in graphs, M = 1 (BENCHMARKS.md, "Decode at M = 1: a GEMV" and "GEMV
# launch configs by N"): channel 1.08-1.19x faster than the decode kernel path on all 8 shapes; tensor
# faster than cuBLAS tensorwise up to N = 6144 (1024 x 4096: 7.0 vs 15.5 µs), a tie at N = 8192, slower
# at N >= 28672; block, with its per-N configs, 1.02-1.14x faster than its decode paths at N = 4096 to
# 57344, a tie at 8192 x 8192, 0.96x at 8192 x 28672 and 0.94x at 1024 x 4096. M = 2 and 4 lost to
# the decode kernel on every shape but 1024 x 4096 (BENCHMARKS.md "GEMV for 2-4 rows"): no bucket.
GEMV_N = {"tensor": {1: (0, 6144)}, "channel": {1: (0, 1 << 62)}, "block": {1: (4096, 1 << 62)}}
# M <= 16 where the decode kernel runs, N in this range (inclusive): few K splits (`few_splits`) and, for
# tensor / channel, 6 stages, two splits added by an exchange (triton_decode._exchange) instead of the
# ticket; block runs the decode kernel on its pre-quantized groups with twice the splits (ticket) instead
# of the split-K block GEMM. H200, GPU time in graphs (probe_kernels.py decodex, BENCHMARKS.md
# "Decode at M = 2-16: two K splits added by exchange"): against the auto plan, channel 1.02-1.06x
# faster and block 1.01-1.08x at 4096 x 4096, 6144 x 4096, 4096 x 14336, 8192 x 8192 and 8192 x 28672,
# M = 2-16.
# Outside it the auto plan stays: at N = 1024 two splits are too few programs (0.85x), and from
# N = 28672 the output tiles alone fill the GPU and the exchange's atomics cost more than the ticket.
FEW_SPLITS_N = (4096, 8192)
BLOCK_GEMM = "torch"    # "torch" (blockwise F.scaled_mm) or "triton" above TRITON_MAX_M["block"]
# Under torch.compile, per activation kind: quantize with numerics' torch ops, which inductor fuses
# into the producing kernel, instead of the Triton quantizer. "group" is off. Behind SiLU x up
# (M = 8192, K = 14336) inductor splits it into a reduction and a pointwise pass that recomputes the
# producer, 1155 against 996 µs per layer; behind RMSNorm it is within 3% either way (H200, 2026-12-04).
COMPILED_QUANT = {"token": True, "group": False}


_FEW_TOKEN = {s: dict(num_stages=6, SPLIT_K=s) for s in (2, 4)}
_FEW_BLOCK = {s: dict(SPLIT_K=2 * s) for s in (2, 4)}


def _tickets(n: int) -> int:
    """Ticket counters at the head of a layer's decode workspace: one per output tile of >= 16 columns."""
    return -(-n // 16)


def _few(n: int) -> bool:
    return FEW_SPLITS_N[0] <= n <= FEW_SPLITS_N[1]


def few_splits(n: int, k: int) -> int:
    """K splits of the few-split plan (FEW_SPLITS_N): 2, or 4 for a long K on under 128 output tiles of
    64 (4096 x 14336: 4 splits 1.02-1.05x faster than 2)."""
    return 2 if k <= 8192 or n >= 8192 else 4


def token_decode_plan(n: int, k: int, counters: torch.Tensor | None, device: torch.device
                      ) -> tuple[dict | None, torch.Tensor | None]:
    """(config, exchange slots) of tensor / channel's decode kernel for an [N, K] weight: the few-split
    plan where FEW_SPLITS_N takes N (the slots from the layer's workspace `counters`), else (None, None):
    the auto plan and the ticket."""
    if not _few(n):
        return None, None
    splits = few_splits(n, k)
    return _FEW_TOKEN[splits], _slots_of(counters, n, device) if splits == 2 else None


def decode_workspace(n: int, device: torch.device | str) -> torch.Tensor:
    """A layer's int32 decode workspace: the decode kernel's per-tile ticket counters (zeros), then,
    where FEW_SPLITS_N takes this N, the exchange slots for two splits of up to 16 rows (EMPTY). Both
    are back to these values after every launch. `fp8now.kernels.split_counters` returns this."""
    tickets = torch.zeros(_tickets(n), dtype=torch.int32, device=device)
    if not _few(n):
        return tickets
    return torch.cat([tickets, triton_decode.exchange_slots(n, 2, device)])


def _slots_of(counters: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The exchange slots inside a layer's decode workspace, or fresh ones when it has none."""
    start = _tickets(n)
    if counters is not None and counters.numel() >= start + triton_decode.MAX_M * n:
        return counters[start:]
    return triton_decode.exchange_slots(n, 2, device)


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if the Triton path can run this layer, else why not."""
    for why in (triton_quant.available(device), triton_gemm.available(device)):
        if why is not None:
            return why
    if device.type != "cuda":
        return "the triton backend runs on CUDA GPUs"
    if act_kind == "tensor":
        return "per-tensor activations need a global amax; the triton backend quantizes per token"
    if n % 16 or k % 16:
        return f"FP8 GEMMs need N and K divisible by 16 (N={n}, K={k})"
    if scheme is Scheme.BLOCK and k % 128:
        return f"block GEMMs need K divisible by 128 (K={k})"
    return None


def _token(x: torch.Tensor, early_launch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 rows and [M, 1] scales: torch ops for inductor under compile, else the Triton kernel."""
    if COMPILED_QUANT["token"] and torch.compiler.is_compiling():
        return numerics.quantize_activation(x, "token")
    return triton_quant.quantize_act_token(x, early_launch=early_launch)


def _group(x: torch.Tensor, col_major: bool = False, early_launch: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128-group FP8 and [M, K/128] scales (strides (1, M) if `col_major`), the same way."""
    if COMPILED_QUANT["group"] and torch.compiler.is_compiling():
        q, s = numerics.quantize_activation(x, "group")
        return q, (s.t().contiguous().t() if col_major else s)
    return triton_quant.quantize_act_group(x, col_major=col_major, early_launch=early_launch)


def linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           scheme: Scheme, act_kind: str, batch_invariant: bool = False,
           counters: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias in x.dtype; `counters`: the layer's split-K counters."""
    m = x.shape[0]
    if m <= triton_decode.MAX_M and not batch_invariant:
        n, k = w_q.shape
        lo, hi = GEMV_N[scheme.value].get(triton_gemv.rows_bucket(m), (1, 0)) if m <= triton_gemv.MAX_M else (1, 0)
        if lo <= n <= hi:
            x_q, x_s = _group(x, early_launch=True) if scheme is Scheme.BLOCK else _token(x, early_launch=True)
            return triton_gemv.gemv(x_q, w_q, w_scale, scheme.value, bias, x_scale=x_s, out_dtype=x.dtype,
                                    pdl=True)
        if scheme is Scheme.TENSOR and m == 1 and TENSORWISE_M1:
            x_q, x_s = _token(x)
            return torch_mm.rowwise_mm(x_q, x_s.reshape(()), w_q, w_scale.reshape(()), bias, x.dtype)
        if scheme is not Scheme.BLOCK:
            pdl = m <= PDL_MAX_M
            x_q, x_s = _token(x, early_launch=pdl)
            cfg, slots = token_decode_plan(n, k, counters, w_q.device)
            return triton_decode.decode_linear(x_q, w_q, w_scale, scheme.value, "token", bias,
                                               x_scale=x_s, counters=counters, out_dtype=x.dtype, pdl=pdl,
                                               config=cfg, slots=slots)
        if m == 1 and n <= FUSED_BLOCK_MAX_N:
            return triton_decode.decode_linear(x, w_q, w_scale, "block", "group", bias, counters=counters)
        if _few(n):
            x_q, x_s = _group(x)
            return triton_decode.decode_linear(x_q, w_q, w_scale, "block", "group", bias, x_scale=x_s,
                                               counters=counters, out_dtype=x.dtype,
                                               config=_FEW_BLOCK[few_splits(n, k)])
    if scheme is Scheme.BLOCK:
        if batch_invariant:
            x_q, x_s = _group(x)
            return triton_gemm.block_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype, batch_invariant=True)
        if m > TRITON_MAX_M["block"] and BLOCK_GEMM == "torch" and torch_mm.blockwise_unfit(x.shape[1]) is None:
            x_q, x_s = _group(x, col_major=True)
            return torch_mm.blockwise_mm(x_q, x_s, w_q, w_scale, bias, x.dtype)
        x_q, x_s = _group(x)
        return triton_gemm.block_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype)
    if batch_invariant:
        x_q, x_s = _token(x)
        return triton_gemm.rowwise_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype, batch_invariant=True)
    x_q, x_s = _token(x)
    if m <= TRITON_MAX_M["rowwise"]:
        return triton_gemm.rowwise_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype)
    return torch_mm.rowwise_mm(x_q, x_s, w_q, w_scale, bias, x.dtype)
