"""The forward of a MoE experts layer split over a tensor-parallel group (tp_moe.py), installed per layer.

Every rank holds the same tokens and routing (the router runs replicated). Each rank runs its own
experts (ep) or its slice of every expert (tp) on the tokens routed to them and writes one float32
row per (token, expert) slot (Llama4's dense input: per expert and token), zero where it has
nothing; one all-reduce (SUM) of those rows gives
every rank every slot's output, which is then rounded and weighted exactly as one process does. With
expert parallelism each slot has one nonzero contributor, so the output equals TP=1 bit for bit;
with TP inside the experts the partial `w2` products are summed, and with `tp_invariant` the
per-token amax of `w2`'s input shard is reduced (MAX) first, so its FP8 bytes equal TP=1's too.
This all-reduce of k rows per token (not a token exchange) is the simple combine; an all-to-all
dispatch would move less data for large batches. The expert GEMMs run on the layer's backend, one of
`moe_backends.SPLIT_BACKENDS` (cpu working copies, or the exact reference product).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..kernels import cpu
from ..kernels.reference import exact_matmul
from ..layers.moe import Fp8Experts
from ..layers.moe_rules import combine
from ..numerics import quantize_activation


def _routed_groups(layer: Fp8Experts, x: torch.Tensor, flat: torch.Tensor, k: int, first: int) -> list:
    """(local expert, its slots in [T*k], its input rows [m, H]) for each local expert that got tokens."""
    local = flat - first
    slots = ((local >= 0) & (local < layer.num_experts)).nonzero().flatten()
    slots = slots[torch.argsort(local[slots], stable=True)]
    counts = torch.bincount(local[slots], minlength=layer.num_experts).tolist()
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            mine = slots[start:start + n]
            start += n
            out.append((e, mine, x[mine // k]))
    return out


def _dense_groups(layer: Fp8Experts, x: torch.Tensor, first: int) -> list:
    """Llama4's layout x [E, T, H]: (local expert, its nonzero rows in [E*T], those rows [m, H])."""
    out = []
    for e in range(layer.num_experts):
        rows = x[first + e].ne(0).any(dim=-1).nonzero().flatten()
        if rows.numel():
            out.append((e, (first + e) * x.shape[1] + rows, x[first + e, rows]))
    return out


def _input_amax(layer: Fp8Experts, gated: list, split, state) -> list[torch.Tensor | None]:
    """Per-token amax of each expert's `w2` input; under tp_invariant reduced (MAX) over the group."""
    if not (state.invariant and split.mode == "tp" and layer.act_kind == "token" and gated):
        return [None] * len(gated)
    amax = torch.cat([g.abs().amax(dim=1, keepdim=True).float() for _, _, g in gated])
    state.collective(lambda: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=state.group),
                     f"{layer.name} w2 input amax")
    return list(amax.split([g.shape[0] for _, _, g in gated]))


def _summed_rows(layer: Fp8Experts, groups: list, n: int, split, state, device: torch.device) -> torch.Tensor:
    """float32 [n, H]: every rank's expert outputs for the rows of `groups`, summed over the group
    (w2's bias: added here by its expert's owner (ep), after the sum by the caller (tp))."""
    gated = []
    for e, rows, x_e in groups:
        b13 = None if layer.w13_bias is None else layer.w13_bias[e]
        x_e = nn.functional.pad(x_e, (0, layer.h_pad - layer.hidden_size))
        gated.append((e, rows, layer._gated(layer.expert_gemm(e, "w13", x_e, b13))))
    out = torch.zeros((n, layer.hidden_size), dtype=torch.float32, device=device)
    for (e, rows, g), amax in zip(gated, _input_amax(layer, gated, split, state)):
        if split.mode == "ep":   # the whole expert, run as one process runs it (its owner adds w2's bias)
            y = layer.expert_gemm(e, "w2", g, None if layer.w2_bias is None else layer.w2_bias[e]).float()
        else:
            y = _partial_down(layer, e, g, amax)
        out[rows] = y[:, :layer.hidden_size]
    state.collective(lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=state.group), f"{layer.name} output")
    return out


def _partial_down(layer: Fp8Experts, e: int, g: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """float32 [m, Hp]: this rank's partial `w2` product of expert e's slice, g [m, Ip] quantized with
    `amax` (None: its own), left unrounded for the sum over ranks."""
    g_q, g_s = quantize_activation(g, layer.act_kind, amax=amax)
    if layer.backend == "cpu":
        return cpu.widened_product(g_q, g_s, layer.act_kind, layer.w2_work[e])
    return exact_matmul(g_q, g_s, layer.w2[e], layer.w2_scale[e], layer.scheme).float()


def _tp_bias(layer: Fp8Experts, split, out: torch.Tensor, expert: torch.Tensor, used: torch.Tensor
             ) -> torch.Tensor:
    """TP inside the experts: w2's bias of each row's `expert [n]`, once, on the rows `used [n]`."""
    if split.mode != "tp" or layer.w2_bias is None:
        return out
    return torch.where(used.unsqueeze(-1), out + layer.w2_bias[expert, :layer.hidden_size].float(), out)


def _forward(layer: Fp8Experts, split, state):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if layer.backend is None:
            raise RuntimeError(f"Fp8Experts {layer.name} has no weights yet: call load_ first")
        if layer.dense_input:
            x = hidden_states.reshape(split.num_experts, -1, layer.hidden_size)
            out = _summed_rows(layer, _dense_groups(layer, x, split.experts[0]), x.shape[0] * x.shape[1], split,
                               state, x.device)
            expert = torch.arange(split.num_experts, device=x.device).repeat_interleave(x.shape[1])
            out = _tp_bias(layer, split, out, expert, x.ne(0).any(dim=-1).reshape(-1))
            return out.to(hidden_states.dtype).reshape(hidden_states.shape)
        if top_k_index is None or top_k_weights is None:
            raise ValueError(f"{layer.name}: forward needs top_k_index and top_k_weights")
        x = hidden_states.reshape(-1, layer.hidden_size)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= split.num_experts):
            raise ValueError(f"{layer.name}: expert index out of range [0, {split.num_experts})")
        groups = _routed_groups(layer, x, flat, k, split.experts[0])
        out = _summed_rows(layer, groups, flat.numel(), split, state, x.device)
        out = _tp_bias(layer, split, out, flat, torch.ones_like(flat, dtype=torch.bool))
        return combine(out.to(hidden_states.dtype), top_k_weights).to(hidden_states.dtype)

    return forward


def install(layer: Fp8Experts, split, state) -> None:
    """Replace the layer's forward (on this instance) by the split one."""
    layer.forward = _forward(layer, split, state)
