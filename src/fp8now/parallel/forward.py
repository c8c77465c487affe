"""The forward collectives of a tensor-parallel model (SPEC §6), installed per module by tp.shard.

Explicit collectives rather than transformers' parallel styles: those wrap parameters in DTensors
and changed shape between transformers 5.17 and 5.25, while an FP8 layer's weight and scales need
no DTensor at all. Column-parallel layers run locally (their output stays split, or is all-gathered
for `colwise_gather_output`); row-parallel layers run on their input shard without the bias, then
all-reduce (SUM) and add the bias once; vocabulary-split embeddings look up their own rows and
all-reduce. With `tp_invariant`, row-parallel FP8 layers quantize their input with the per-token
amax reduced (MAX) over the group and sum float32 partial products, so logits match TP=1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import numerics
from ..config import Scheme
from ..layers.linear import Fp8Linear


def _exact(x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    from ..kernels.reference import exact_matmul
    return exact_matmul(x_q, x_scale, layer.weight, layer.weight_scale, layer.scheme).float()


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    from ..kernels import torch_mm
    mm = torch_mm.blockwise_mm if layer.scheme is Scheme.BLOCK else torch_mm.rowwise_mm
    return mm(x_q, x_scale, layer.weight, layer.weight_scale, None, torch.float32).float()


def _widened(x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """The cpu backend's product in float32 (its bf16 working copy, made here if the layer has none)."""
    from ..kernels.cpu import widened_product, working_copy

    work = layer._work
    if work is None:
        work = working_copy(layer.weight, layer.weight_scale, layer.scheme)
    return widened_product(x_q, x_scale, layer.act_kind, work)


# Backend -> GEMM of pre-quantized operands, float32 out: [M, K] fp8 x [N, K] fp8 -> [M, N].
INVARIANT_GEMMS = {"reference": _exact, "torch": _scaled_mm, "cpu": _widened}


def check_invariant_backend(layer: Fp8Linear) -> None:
    """tp_invariant quantizes outside the backend, so the backend must offer a pre-quantized GEMM."""
    if layer.backend not in INVARIANT_GEMMS:
        raise ValueError(f"{layer.name}: tp_invariant=True runs row-parallel layers through a GEMM of "
                         f"pre-quantized inputs, offered by the {', '.join(INVARIANT_GEMMS)} backends; this "
                         f"layer runs on {layer.backend!r}: pass Fp8Config(backend=...) one of those")


def _all_reduce(t: torch.Tensor, state, op, what: str) -> torch.Tensor:
    state.collective(lambda: dist.all_reduce(t, op=op, group=state.group), what)
    return t


def _invariant_partial(layer: Fp8Linear, x2: torch.Tensor, state) -> torch.Tensor:
    """This rank's float32 partial product [M, N], its input quantized with the group's amax."""
    amax = None
    if layer.act_kind == "token":
        amax = x2.abs().amax(dim=1, keepdim=True).float()
    elif layer.act_kind == "tensor":
        amax = x2.abs().amax().float().reshape(1)
    if amax is not None:
        amax = _all_reduce(amax, state, dist.ReduceOp.MAX, f"{layer.name} input amax")
    x_q, x_scale = numerics.quantize_activation(x2, layer.act_kind, amax=amax)
    return INVARIANT_GEMMS[layer.backend](x_q, x_scale, layer)


def _row_forward(module: nn.Module, name: str, cols: tuple[int, int] | None, state):
    """Row-parallel forward: local product without bias, all-reduce SUM, bias once."""
    original = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if cols is not None:
            x = x[..., cols[0]:cols[1]]
        bias = module._parameters.get("bias")
        if state.invariant and isinstance(module, Fp8Linear):
            y = _invariant_partial(module, x.reshape(-1, x.shape[-1]), state)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        else:
            module._parameters["bias"] = None
            try:
                y = original(x)
            finally:
                module._parameters["bias"] = bias
        y = _all_reduce(y, state, dist.ReduceOp.SUM, f"{name} output")
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype)

    return forward


def _gather_forward(module: nn.Module, name: str, state):
    """Column-parallel forward with the output all-gathered along its last dim."""
    original = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = original(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(state.size)]
        state.collective(lambda: dist.all_gather(parts, y, group=state.group), f"{name} output")
        return torch.cat(parts, dim=-1)

    return forward


def _vocab_forward(module: nn.Module, name: str, rows: tuple[int, int], state):
    """Vocabulary-split embedding: own rows looked up, others zero, all-reduce SUM (exact: one nonzero)."""
    original = module.forward

    def forward(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < rows[0]) | (ids >= rows[1])
        y = original((ids - rows[0]).masked_fill(outside, 0))
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return _all_reduce(y, state, dist.ReduceOp.SUM, f"{name} output")

    return forward


def install(module: nn.Module, name: str, style, state) -> None:
    """Replace the module's forward (on this instance) by its style's collective version."""
    sl = state.slices[f"{name}.weight"]
    if style.split == "in":
        module.forward = _row_forward(module, name, sl.ranges[0] if style.split_input else None, state)
    elif style.split == "out" and style.gather:
        module.forward = _gather_forward(module, name, state)
    elif style.split == "vocab":
        module.padding_idx = None  # only steers gradients; a global index may not exist locally
        module.forward = _vocab_forward(module, name, sl.ranges[0], state)
