"""Rules every experts backend follows: which activation scales experts use, and the fixed order in which each
token's routed outputs are weighted and summed (the same whatever the batch or the ranks that computed them)."""

from __future__ import annotations

import torch

from ..config import Fp8Config


def expert_act_kind(config: Fp8Config) -> str:
    """Per-token or per-group activation scales for experts; never one scale over the batch: with
    activation='tensor' (e.g. scheme "tensor-tensor") the dense layers use per-tensor scales and the
    experts per-token ones (one scale over the tokens routed to an expert would couple them); the
    report's experts rows show it."""
    kind = config.act_kind(config.expert_scheme)
    return "token" if kind == "tensor" else kind


def combine(out: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each token's routed outputs `out [T*k, H]` weighted and summed in a fixed order -> float32 [T, H]
    (the same order whatever the batch, or the ranks that computed them: tp_moe_forward.py)."""
    t, k = top_k_weights.shape
    weighted = out.float().view(t, k, -1) * top_k_weights.float().unsqueeze(-1)
    acc = weighted[:, 0]
    for j in range(1, k):
        acc = acc + weighted[:, j]
    return acc
