"""What a weight given to an FP8 layer must be, and how its scales and FP8 bytes are shaped and kept: the float
weight check, the scales' shape per scheme (SPEC §3), the `.to()` guard that never casts FP8 bytes."""

from __future__ import annotations

import math

import torch

from ..config import Scheme

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # quantized from these


def weight_scale_shape(scheme: Scheme, n: int, k: int) -> tuple[int, ...]:
    """Scale shape of an `[N, K]` weight (SPEC §3)."""
    match scheme:
        case Scheme.TENSOR:
            return ()
        case Scheme.CHANNEL:
            return (n, 1)
        case Scheme.BLOCK:
            return (math.ceil(n / 128), math.ceil(k / 128))
    raise ValueError(scheme)


def check_float_weight(w: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """A weight to quantize must be bf16/fp16/fp32/fp64 of the expected shape; say what it is otherwise."""
    if w.dtype in _FP8_DTYPES:
        raise ValueError(
            f"{name or 'weight'} is already quantized ({w.dtype}, FP8); fp8now quantizes bf16/fp16/fp32/fp64 "
            "checkpoints while loading. Loading a pre-quantized checkpoint is a different path: "
            "fp8now.load reads one as it is when its config.json has a quantization_config "
            "(compressed-tensors or fp8); otherwise use the original bf16 checkpoint here")
    if w.dtype not in _WEIGHT_DTYPES:
        kind = "a float format fp8now does not read" if w.is_floating_point() else (
            "booleans" if w.dtype == torch.bool else "integers (packed weights of an integer-quantized "
            "checkpoint, or not a weight at all)")
        raise ValueError(f"{name or 'weight'} has dtype {w.dtype}: {kind}; fp8now quantizes bf16, fp16, "
                         "fp32 or fp64 weights: use the original unquantized checkpoint")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name or 'weight'} has shape {tuple(w.shape)}, expected {tuple(shape)}")


def keep_fp8_on_apply(fn, tensors):
    """`fn` of `nn.Module._apply` that only moves `tensors` (FP8 bytes, float32 scales), never casts them."""
    keep = {id(t) for t in tensors}

    def guarded(t: torch.Tensor) -> torch.Tensor:
        if id(t) in keep:
            return t.to(fn(t.reshape(-1)[:0]).device)
        return fn(t)
    return guarded
