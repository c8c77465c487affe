"""The forward of a MoE experts layer split over a tensor-parallel group (tp_moe.py), installed per layer.

Every rank holds the same tokens and routing (the router runs replicated). Each rank runs its own
experts (ep) or its slice of every expert (tp) on the tokens routed to them and writes one float32
row per (token, expert) slot, zero where it has nothing; one all-reduce (SUM) of those rows gives
every rank every slot's output, which is then rounded and weighted exactly as one process does. With
expert parallelism each slot has one nonzero contributor, so the output equals TP=1 bit for bit;
with TP inside the experts the partial `w2` products are summed, and with `tp_invariant` the
per-token amax of `w2`'s input shard is reduced (MAX) first, so its FP8 bytes equal TP=1's too.
This all-reduce of k rows per token (not a token exchange) is the simple combine; an all-to-all
dispatch would move less data for large batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .kernels.reference import exact_matmul
from .moe import Fp8Experts, combine
from .numerics import quantize_activation


def _gated_inputs(layer: Fp8Experts, x: torch.Tensor, flat: torch.Tensor, k: int, first: int
                  ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(local expert, its slots, gate(W13 x) [m, I_local]) for each local expert that got tokens."""
    local = flat - first
    slots = ((local >= 0) & (local < layer.num_experts)).nonzero().flatten()
    order = torch.argsort(local[slots], stable=True)
    slots = slots[order]
    counts = torch.bincount(local[slots], minlength=layer.num_experts).tolist()
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            mine = slots[start:start + n]
            start += n
            xe = nn.functional.pad(x[mine // k], (0, layer.h_pad - layer.hidden_size))
            b13 = None if layer.w13_bias is None else layer.w13_bias[e]
            out.append((e, mine, layer._gated(layer._gemm(xe, layer.w13[e], layer.w13_scale[e], b13))))
    return out


def _input_amax(layer: Fp8Experts, gated: list, split, state) -> list[torch.Tensor | None]:
    """Per-token amax of each expert's `w2` input; under tp_invariant reduced (MAX) over the group."""
    if not (state.invariant and split.mode == "tp" and layer.act_kind == "token" and gated):
        return [None] * len(gated)
    amax = torch.cat([g.abs().amax(dim=1, keepdim=True).float() for _, _, g in gated])
    state.collective(lambda: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=state.group),
                     f"{layer.name} w2 input amax")
    return list(amax.split([g.shape[0] for _, _, g in gated]))


def _slot_rows(layer: Fp8Experts, x: torch.Tensor, flat: torch.Tensor, k: int, split, state) -> torch.Tensor:
    """float32 [T*k, H]: this rank's contribution to each slot's expert output (bias: see forward)."""
    out = torch.zeros((flat.numel(), layer.hidden_size), dtype=torch.float32, device=x.device)
    gated = _gated_inputs(layer, x, flat, k, split.experts[0])
    for (e, mine, g), amax in zip(gated, _input_amax(layer, gated, split, state)):
        g_q, g_s = quantize_activation(g, layer.act_kind, amax=amax)
        y = exact_matmul(g_q, g_s, layer.w2[e], layer.w2_scale[e], layer.scheme).float()
        if split.mode == "ep" and layer.w2_bias is not None:
            y = y + layer.w2_bias[e].float()
        out[mine] = y[:, :layer.hidden_size]
    return out


def _forward(layer: Fp8Experts, split, state):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if layer.backend is None:
            raise RuntimeError(f"Fp8Experts {layer.name} has no weights yet: call load_ first")
        if top_k_index is None or top_k_weights is None:
            raise ValueError(f"{layer.name}: forward needs top_k_index and top_k_weights")
        x = hidden_states.reshape(-1, layer.hidden_size)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= split.num_experts):
            raise ValueError(f"{layer.name}: expert index out of range [0, {split.num_experts})")
        rows = _slot_rows(layer, x, flat, k, split, state)
        state.collective(lambda: dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=state.group),
                         f"{layer.name} output")
        if split.mode == "tp" and layer.w2_bias is not None:
            rows = rows + layer.w2_bias[flat, :layer.hidden_size].float()
        return combine(rows.to(hidden_states.dtype), top_k_weights).to(hidden_states.dtype)

    return forward


def install(layer: Fp8Experts, split, state) -> None:
    """Replace the layer's forward (on this instance) by the split one."""
    layer.forward = _forward(layer, split, state)
