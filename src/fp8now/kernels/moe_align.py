"""Routing alignment for the grouped MoE GEMMs: routed slots sorted by expert, each expert's run padded to
a multiple of BLOCK_M, and the expert of every BLOCK_M rows, with torch ops only and no host sync (the
sizes come from a static bound on T*k, never from the routing), so a CUDA graph can capture it.

A slot is one (token, choice) pair: slot = t * k + j for `top_k_index [T, k]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Slots sorted by expert in runs padded to BLOCK_M rows, and the expert of each BLOCK_M rows."""

    slots: torch.Tensor          # [blocks * BLOCK_M] int32: slot id, or -1 for a padding row
    block_expert: torch.Tensor   # [blocks] int32: the expert of each BLOCK_M rows, or -1 (unused block)
    block_m: int


def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Upper bound on the padded blocks: sum_e ceil(c_e / BM) <= floor(S / BM) + (experts with tokens)."""
    return slots // block_m + min(experts, slots)


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """`top_k_index [T, k]` (ids in [0, E)) -> the sorted, padded slots and the expert of each block.

    Slots of one expert keep their ascending order (stable sort), so a slot's position inside its block
    does not depend on the routing of tokens that went elsewhere."""
    flat = top_k_index.reshape(-1).long()                               # [S]
    s, dev = flat.numel(), flat.device
    blocks = max_blocks(s, num_experts, block_m)
    expert_sorted, order = torch.sort(flat, stable=True)                # [S], [S]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))                 # [E] (bincount would sync)
    padded = (counts + block_m - 1) // block_m * block_m                # [E]
    padded_end = torch.cumsum(padded, 0)                                # [E]
    first = torch.cumsum(counts, 0) - counts                            # [E] first sorted position
    dest = (padded_end - padded)[expert_sorted] + torch.arange(s, device=dev) - first[expert_sorted]
    slots = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=dev)
    slots.scatter_(0, dest, order.to(torch.int32))
    row0 = torch.arange(blocks, device=dev) * block_m                   # [blocks] first row of each block
    owner = torch.searchsorted(padded_end, row0, right=True)            # experts whose run ends <= row0
    block_expert = torch.where(row0 < padded_end[-1:], owner, -1).to(torch.int32)
    return Routing(slots, block_expert, block_m)
