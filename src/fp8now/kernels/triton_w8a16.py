"""The `triton-w8a16` backend: weights stay FP8 in memory and are dequantized inside a bf16/fp16
GEMM, for GPUs without FP8 tensor cores (sm_80/86). Activations are not quantized, so the
`channel` scheme (whose point is per-token activation quantization) refuses it (SPEC §9)."""

from __future__ import annotations

import torch

from ..config import WEIGHT_GROUP, Scheme
from . import triton_gemm


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if the weight-only kernel can run this layer, else why not."""
    if scheme is Scheme.CHANNEL:
        return ("the channel scheme quantizes activations per token; a weight-only kernel would "
                "silently drop that")
    if batch_invariant:
        return "the weight-only kernel has no fixed-configuration (batch-invariant) variant"
    return triton_gemm.available_w8a16(device)


def linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           scheme: Scheme, act_kind: str, batch_invariant: bool = False,
           counters: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x @ (W_q * s).T + bias, x left in bf16/fp16. (`counters`: unused here.)"""
    return triton_gemm.w8a16_gemm(x, w_q, w_scale, WEIGHT_GROUP[scheme], bias, out_dtype=x.dtype)
