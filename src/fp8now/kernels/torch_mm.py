"""The `torch` backend: `torch._scaled_mm` tensorwise / rowwise, and blockwise `F.scaled_mm` where offered."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import Scheme
from ..numerics import quantize_activation
from .plan import Path, Weights, blockwise_unfit


@functools.cache
def _cpu_scaled_mm_ok() -> bool:
    """Does this torch run `_scaled_mm` (rowwise, float32 out) on CPU tensors?"""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def _has_blockwise() -> bool:
    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise128x128")


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if this backend can run the layer, else why not."""
    if batch_invariant:
        return "cuBLAS picks its kernel (and split) by batch size, so results are not batch-invariant"
    if n % 16 or k % 16:
        return f"_scaled_mm needs N and K divisible by 16 (N={n}, K={k})"
    if device.type == "cpu":
        if scheme is Scheme.BLOCK:
            return "blockwise scaled_mm is not offered on CPU"
        return None if _cpu_scaled_mm_ok() else f"torch {torch.__version__} has no CPU _scaled_mm"
    if device.type != "cuda":
        return f"no FP8 GEMM for device type {device.type!r}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"FP8 tensor cores need compute capability >= 8.9, this GPU has {cap[0]}.{cap[1]}"
    if scheme is Scheme.BLOCK:
        if not _has_blockwise():
            return f"torch {torch.__version__} has no blockwise F.scaled_mm"
        if cap[0] != 9:
            return "blockwise scaled_mm (1x128 x 128x128) runs on sm_90 only"
        return blockwise_unfit(k)
    return None


def rowwise_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """`_scaled_mm` of x_q [M, K] and w_q [N, K]: both scales 0-d (tensorwise), or a per-token /
    single activation scale with a per-channel / single weight scale (rowwise, shaped here to the
    [M, 1] and [1, N] cuBLAS wants; views when they already are).

    On CPU the product is taken in float32 (exact there); cuBLAS rowwise writes bf16 only.
    `fast_accum`: cuBLAS's fast FP8 accumulation (`use_fast_accum`; the plan sets it on GPUs only).
    """
    tensorwise = x_scale.dim() == 0 and w_scale.dim() == 0
    if not tensorwise:
        x_scale = x_scale.reshape(-1, 1).expand(x_q.shape[0], 1).contiguous()
        w_scale = w_scale.reshape(1, -1).expand(1, w_q.shape[0]).contiguous()
    if x_q.device.type == "cpu":
        mm_dtype = torch.float32
    else:
        mm_dtype = out_dtype if tensorwise else torch.bfloat16
    fuse_bias = bias is not None and bias.dtype == mm_dtype
    y = torch._scaled_mm(x_q, w_q.t(), x_scale, w_scale, bias=bias if fuse_bias else None,
                         out_dtype=mm_dtype, use_fast_accum=fast_accum)
    if bias is not None and not fuse_bias:
        y = y.float() + bias.float()
    return y.to(out_dtype)


def blockwise_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """F.scaled_mm with 1x128 activation groups x_scale [M, K/128] and 128x128 weight tiles (sm_90)."""
    m = x_q.shape[0]
    if m % 4:  # the column-major scale's leading dimension must be 16-byte aligned: pad rows
        pad = 4 - m % 4
        x_q = torch.cat([x_q, x_q.new_zeros(pad, x_q.shape[1])])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad, x_scale.shape[1])])
    if x_scale.stride(0) != 1:
        x_scale = x_scale.t().contiguous().t()                # [M, K/128], strides (1, M)
    # torch._scaled_mm infers (BlockWise1x128, BlockWise128x128) from the scale shapes and, unlike
    # F.scaled_mm (whose _scaled_mm_v2 dynamo cannot trace), compiles under torch.compile.
    y = torch._scaled_mm(x_q, w_q.t(), x_scale, w_scale.t(), out_dtype=torch.bfloat16)
    y = y[:m]
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(out_dtype)


def linear(x: torch.Tensor, weights: Weights, path: Path) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias in x.dtype."""
    w_q, w_scale, bias, _ = weights
    x_q, x_scale = quantize_activation(x, path.act)
    if path.scheme is Scheme.BLOCK:
        return blockwise_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype)
    return rowwise_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype, path.fast_accum)
