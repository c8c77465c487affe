"""The on-disk layout of FP8 MoE experts: one tensor per expert and projection under the family's
checkpoint names (`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`),
each next to its scale under the format's name (`weight_scale` / `weight_scale_inv`).

That is the layout vLLM and SGLang map onto their fused w13/w2 (`make_expert_params_mapping`) and the one
transformers merges with its conversion rules, so the names come from transformers' own reverse mapping
(`revert_weight_conversion`) rather than from a table of ours. `Fp8Experts` pads gate and up to `Ip` rows
each (block scheme), so a gate's block scales are w13_scale's first `Ip/128` rows and the up's the rest;
a per-tensor w13 scale covers gate and up together, and both files carry it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Scheme
from ..layers.moe import Fp8Experts

PARTS = ("gate", "up", "down")


def expert_modules(model: nn.Module, name: str, num_experts: int) -> dict[tuple[int, str], str]:
    """(expert, part) -> checkpoint module name (`model.layers.0.mlp.experts.3.gate_proj`) of the
    experts module `name`, found by running transformers' reverse conversion on index tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    codes13 = torch.tensor([[3 * e, 3 * e + 1] for e in range(num_experts)])   # [E, 2]: gate, up
    codes2 = torch.tensor([[3 * e + 2] for e in range(num_experts)])           # [E, 1]: down
    out = revert_weight_conversion(model, {f"{name}.gate_up_proj": codes13, f"{name}.down_proj": codes2})
    modules: dict[tuple[int, str], str] = {}
    for key, code in out.items():
        if code.numel() != 1 or not key.endswith(".weight"):
            raise ValueError(f"{name} ({getattr(model.config, 'model_type', '?')}): transformers stores these experts fused on disk "
                             f"({key!r}), and no FP8 reader shares a fused FP8 layout for them; fp8now writes "
                             "and reads FP8 experts one per expert only. Keep the experts in high precision "
                             f"(Fp8Config.ignore=[..., {name!r}]) to export this model")
        modules[divmod(int(code), 3)[0], PARTS[int(code) % 3]] = key.removesuffix(".weight")
    if len(modules) != 3 * num_experts:
        raise ValueError(f"{name}: transformers' reverse conversion gave {len(modules)} expert tensors, "
                         f"expected {3 * num_experts} (gate, up and down of {num_experts} experts)")
    return modules


def expert_tensors(layer: Fp8Experts, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Expert e's part -> (FP8 weight [rows, cols] without padding, float32 scale in a linear's shape:
    `[1]` tensor, `[rows, 1]` channel, `[ceil(rows/128), ceil(cols/128)]` block); views, no copies."""
    h, i, ip = layer.hidden_size, layer.intermediate_size, layer.i_pad
    w13, s13, w2, s2 = layer.expert_weight(e)
    if layer.scheme is Scheme.TENSOR:
        gate_s, up_s = s13.reshape(1), s13.reshape(1).clone()   # one value, two files
        s2 = s2.reshape(1)
    else:
        cut = ip // 128 if layer.scheme is Scheme.BLOCK else ip
        gate_s, up_s = s13[:cut], s13[cut:]
    return {"gate": (w13[:i, :h], gate_s), "up": (w13[ip:ip + i, :h], up_s), "down": (w2[:h, :i], s2)}


def stacked(layer: Fp8Experts, parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert (FP8 weight, scale) of every (expert, part) -> `layer`'s stored (w13 [E, 2Ip, Hp],
    w13_scale, w2 [E, Hp, Ip], w2_scale), padding zero; the inverse of `expert_tensors` (scales -> float32)."""
    e_n, h, i, ip = layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.i_pad
    w13 = torch.zeros(layer.w13.shape, dtype=layer.w13.dtype)
    w2 = torch.zeros(layer.w2.shape, dtype=layer.w2.dtype)
    s13 = torch.empty(layer.w13_scale.shape, dtype=torch.float32)
    s2 = torch.empty(layer.w2_scale.shape, dtype=torch.float32)
    for e in range(e_n):
        (gate, gate_s), (up, up_s), (down, down_s) = (parts[e, p] for p in PARTS)
        w13[e, :i, :h], w13[e, ip:ip + i, :h], w2[e, :h, :i] = gate, up, down
        if layer.scheme is Scheme.TENSOR:
            s13[e], s2[e] = gate_s.float().reshape(()), down_s.float().reshape(())
        else:
            s13[e] = torch.cat([gate_s.float().reshape(-1, s13.shape[2]), up_s.float().reshape(-1, s13.shape[2])])
            s2[e] = down_s.float().reshape(s2.shape[1:])
    return w13, s13, w2, s2
