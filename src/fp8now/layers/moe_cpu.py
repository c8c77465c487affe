"""The `cpu` experts backend of `Fp8Experts`: the dense `cpu` backend's trade, per expert.

Each expert keeps a bf16 working copy of its dequantized weights beside the FP8 bytes (`w13_work`
[E, 2Ip, Hp], `w2_work` [E, Hp, Ip]; rebuilt on every load), so an expert's call is the activation's
quantization (the same bytes as numerics', widened to bf16; compiled when `cpu_quantizer` installed
one) and one oneDNN bf16 GEMM with float32 accumulation: within rel_diff 1e-4 of the exact `reference`
product. Memory: 3 bytes per expert weight instead of 1. Batch-invariant mode runs each GEMM on fixed
16-row chunks, so an expert's rows do not depend on how many tokens it received.
"""

from __future__ import annotations

import torch

from ..kernels import cpu


def prepare(layer, works: dict[str, torch.Tensor] | None = None) -> None:
    """(Re)build the layer's working copies from its FP8 bytes (in place when they exist); `works`: made already
    (by the CPU weight quantizer, with the bytes), then only kept."""
    if works is not None:
        layer.w13_work, layer.w2_work = works["w13"], works["w2"]
        return
    with torch.no_grad():
        for leaf in ("w13", "w2"):
            q, s = getattr(layer, leaf), getattr(layer, f"{leaf}_scale")
            work = getattr(layer, f"{leaf}_work", None)
            if work is None or work.shape != q.shape or work.device != q.device:
                work = torch.empty(q.shape, dtype=cpu.WORK_DTYPE, device=q.device)
            for e in range(q.shape[0]):
                cpu.working_copy(q[e], s[e], layer.scheme, out=work[e])
            setattr(layer, f"{leaf}_work", work)


def release(layer) -> None:
    """Drop the working copies (another backend was picked)."""
    layer.w13_work = layer.w2_work = None


def gemm(layer, x: torch.Tensor, work: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """quantize(x [m, K]) @ work.T (+ bias) -> [m, N] in x.dtype, as the layer runs every expert GEMM."""
    x_w = cpu.widened_activation(x, layer.act_kind, layer.act_quantizer)
    return cpu.matmul(x_w, work, bias, layer.batch_invariant).to(x.dtype)
