"""The `triton` experts backend of `Fp8Experts`: its tensors and activation handed to
`kernels.triton_moe.experts_forward` along the plan of the call (`kernels.plan.moe_plan`).

The Llama4 layout (`dense_input`: x [E*T, H], expert e owning rows e*T..(e+1)*T, all-zero rows not
routed) runs the same kernels as T' = E*T tokens with top-1 routing to their row's expert and a routing
weight of 1 for non-zero rows, 0 for zero rows, so every row is computed (as transformers does) and the
rows nobody routed come out exactly zero. No host sync, so the call captures in a CUDA graph; the expert
ids are not range-checked here (that would sync): an id outside [0, E) stops the device with an
index assertion in the torch alignment, while the single-launch Triton alignment (few slots) skips it
and leaves that slot's output unset.

Eager calls of up to `decode_graphs.MAX_M` tokens on CUDA replay per-layer CUDA graphs
(`Fp8Config.decode_graphs`), as `Fp8Linear` does and for the same reason: a small call is a few dozen
launches of host time against microseconds of GPU work. `DecodeGraphs` stages one input tensor, so x,
the expert ids and the routing weights travel packed into one row of the activation dtype (their
bytes, reinterpreted; the graph unpacks them), and the replay is bit-identical to the plain call.
"""

from __future__ import annotations

import torch
from torch import nn

from . import decode_graphs
from ..kernels import device_class
from ..kernels.plan import MoePath, moe_plan
from ..kernels.triton_moe import ExpertWeights, Gate, experts_forward, gate_of


def expert_weights(experts: nn.Module) -> ExpertWeights:
    """The layer's stored FP8 tensors, scales and biases."""
    return ExpertWeights(experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                         experts.w13_bias, experts.w2_bias)


def expert_gate(experts: nn.Module) -> Gate:
    gate = gate_of(experts.gate_kind, experts.act_fn, experts.alpha, experts.limit)
    if isinstance(gate, str):   # load_ picked this backend, so this is a module changed after loading
        raise RuntimeError(f"{experts.name or 'experts'}: {gate}")
    return gate


def path_of(experts: nn.Module, tokens: int, top_k: int, device: torch.device) -> MoePath:
    """The plan of one call on `tokens` tokens routed to `top_k` experts each."""
    return moe_plan(experts.scheme, tokens, top_k, experts.num_experts, device_class(device),
                    experts.batch_invariant, compiling=torch.compiler.is_compiling(), fast_accum=experts.fast_accum)


def triton_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None,
                   top_k_weights: torch.Tensor | None) -> torch.Tensor:
    """`Fp8Experts.forward` on the triton backend (same arguments, same result layout)."""
    x = hidden_states.reshape(-1, experts.hidden_size)
    if experts.dense_input:
        per_expert = max(x.shape[0] // experts.num_experts, 1)
        top_k_index = (torch.arange(x.shape[0], device=x.device) // per_expert)[:, None]    # [E*T, 1]
        top_k_weights = x.ne(0).any(dim=-1, keepdim=True).float()                          # [E*T, 1]
    elif top_k_index is None or top_k_weights is None:
        raise ValueError(f"{experts.name or 'Fp8Experts'}: forward needs top_k_index and top_k_weights")
    t, k = top_k_index.shape
    if experts.graphs is not None and x.is_cuda and 0 < t <= decode_graphs.MAX_M and decode_graphs.usable(x):
        y = experts.graphs.run(pack(x, top_k_index, top_k_weights), _call(experts, x.shape[1], k, x.device),
                               x.shape[1], _addresses(experts))
    else:
        y = experts_forward(x, top_k_index, top_k_weights, expert_weights(experts), expert_gate(experts),
                            path_of(experts, t, k, x.device), experts.workspace)
    return y.reshape(hidden_states.shape)


def pack(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], ids [T, k], weights [T, k] -> one [T, H + ids + weights] tensor of x.dtype holding the
    bytes of x, the ids as int64 and the weights as float32."""
    return torch.cat([x, top_k_index.long().contiguous().view(x.dtype),
                      top_k_weights.float().contiguous().view(x.dtype)], dim=1)


def unpack(packed: torch.Tensor, h: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (x [T, H] (a view), ids [T, k] int64, weights [T, k] float32)."""
    ids_end = h + 8 * k // packed.element_size()
    # Flattened before the dtype view: a [1, n] slice is "contiguous" with its parent's row stride, which
    # a view to a wider dtype refuses unless the row width happens to be a multiple of it.
    return (packed[:, :h], packed[:, h:ids_end].contiguous().view(-1).view(torch.int64).view(-1, k),
            packed[:, ids_end:].contiguous().view(-1).view(torch.float32).view(-1, k))


def _call(experts: nn.Module, h: int, k: int, device: torch.device):
    """The graphed call: `pack`ed rows -> [T, H]."""
    def call(packed: torch.Tensor) -> torch.Tensor:
        x, idx, wts = unpack(packed, h, k)
        return experts_forward(x, idx, wts, expert_weights(experts), expert_gate(experts),
                               path_of(experts, packed.shape[0], k, device), experts.workspace)
    return call


def _addresses(experts: nn.Module) -> tuple[int, ...]:
    """Where the tensors a captured call reads live (a graph is valid while these stay)."""
    return tuple(0 if t is None else t.data_ptr() for t in (*expert_weights(experts), experts.workspace))
