"""The `triton` backend (sm_89+): fused Triton activation quantization in front of the fastest GEMM.

Per call, by M (the thresholds are the dispatch data, measured on the H200, BENCHMARKS.md):
- tensor / channel: M <= FUSED_MAX_M: one Triton launch that quantizes per token inside the GEMM;
  larger M: the Triton per-token quantizer, then cuBLAS `_scaled_mm` rowwise.
- block: M <= FUSED_MAX_M: one Triton launch quantizing 1x128 groups inside the block GEMM;
  larger M: the Triton group quantizer, then torch's blockwise `scaled_mm` (column-major scales)
  where `BLOCK_GEMM` says so and cuBLAS takes the shape, else the Triton block GEMM.
- batch_invariant: Triton quantizer + Triton GEMM with one fixed configuration for every M.
All of it is launches only: no host synchronization, so it captures in CUDA graphs.
"""

from __future__ import annotations

import torch

from ..config import Scheme
from . import torch_mm, triton_gemm, triton_quant

FUSED_MAX_M = 16        # at or below: the single-launch fused kernels
BLOCK_GEMM = "torch"    # "torch" (blockwise F.scaled_mm) or "triton" for M > FUSED_MAX_M


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if the fused Triton path can run this layer, else why not."""
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


def linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           scheme: Scheme, act_kind: str, batch_invariant: bool = False) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias in x.dtype."""
    m = x.shape[0]
    if scheme is Scheme.BLOCK:
        if batch_invariant:
            x_q, x_s = triton_quant.quantize_act_group(x)
            return triton_gemm.block_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype, batch_invariant=True)
        if m <= FUSED_MAX_M:
            return triton_gemm.fused_group_gemm(x, w_q, w_scale, bias, out_dtype=x.dtype)
        if BLOCK_GEMM == "torch" and torch_mm.blockwise_unfit(x.shape[1]) is None:
            x_q, x_s = triton_quant.quantize_act_group(x, col_major=True)
            return torch_mm.blockwise_mm(x_q, x_s, w_q, w_scale, bias, x.dtype)
        x_q, x_s = triton_quant.quantize_act_group(x)
        return triton_gemm.block_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype)
    if batch_invariant:
        x_q, x_s = triton_quant.quantize_act_token(x)
        return triton_gemm.rowwise_gemm(x_q, x_s, w_q, w_scale, bias, x.dtype, batch_invariant=True)
    if m <= FUSED_MAX_M:
        return triton_gemm.fused_token_gemm(x, w_q, w_scale, bias, scheme=scheme.value, out_dtype=x.dtype)
    x_q, x_s = triton_quant.quantize_act_token(x)
    return torch_mm.rowwise_mm(x_q, x_s, w_q, w_scale, bias, x.dtype)
