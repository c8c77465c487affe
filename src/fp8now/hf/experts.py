"""transformers MoE integration: find the fused `*Experts` modules, swap them for `Fp8Experts`.

transformers keeps routed experts as 3-D parameters `gate_up_proj`, `down_proj` of an `*Experts`
module. Most families store them `[E, 2I, H]` / `[E, H, I]` (gate rows, then up rows); some store
them transposed (`[E, H, 2I]` / `[E, I, H]`) and GPT-OSS also interleaves gate and up columns and
adds biases. `hf_to_fused` turns any of these into `Fp8Experts`' layout. Routers (`*TopKRouter`,
`router`, `gate`, DeepSeek-V3's `e_score_correction_bias`) are not experts and are left untouched;
shared experts and dense MLPs are ordinary linears (hf.target_linears).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import Fp8Config
from .modules import match_ignore, set_submodule
from ..layers.moe import Fp8Experts


@dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts class stores its weights and which gated activation it applies."""

    transposed: bool = False    # gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved: bool = False   # gate/up alternate along the 2I dim (g0, u0, g1, u1, ...)
    bias: bool = False          # gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
    gate: str = "glu"           # Fp8Experts gate kind
    dense_input: bool = False   # forward(x [E*T, H]) with router-scaled rows (Llama4)


# Classes whose layout differs from the default (checked against transformers' own flags where it
# sets them: is_transposed / is_concatenated / has_bias from `use_experts_implementation`).
LAYOUTS: dict[str, ExpertsLayout] = {
    "GptOssExperts": ExpertsLayout(transposed=True, interleaved=True, bias=True, gate="clamped_swiglu"),
    "Llama4TextExperts": ExpertsLayout(transposed=True, dense_input=True),
}
FUSED_LEAVES = ("gate_up_proj", "down_proj")
BIAS_LEAVES = ("gate_up_proj_bias", "down_proj_bias")


def is_experts(module: nn.Module) -> bool:
    """A fused transformers experts module: 3-D `gate_up_proj` and `down_proj` parameters."""
    params = module._parameters
    return all(isinstance(params.get(leaf), torch.Tensor) and params[leaf].dim() == 3 for leaf in FUSED_LEAVES)


def experts_layout(name: str, module: nn.Module) -> ExpertsLayout:
    """The layout of `module`; a class with a custom gate we do not know raises naming it."""
    cls = type(module).__name__
    layout = LAYOUTS.get(cls, ExpertsLayout())
    flags = {"transposed": getattr(module, "is_transposed", None),
             "interleaved": (None if getattr(module, "is_concatenated", None) is None
                             else not module.is_concatenated),
             "bias": getattr(module, "has_bias", None)}
    for field_name, flag in flags.items():
        if flag is not None and bool(flag) != getattr(layout, field_name):
            raise ValueError(f"{name} ({cls}): transformers says {field_name}={bool(flag)}, fp8now's layout "
                             f"table says {getattr(layout, field_name)}; update fp8now.hf.experts.LAYOUTS")
    if cls not in LAYOUTS:
        gate_fn = getattr(type(module), "_apply_gate", None)   # the decorator adds transformers' default
        custom = gate_fn is not None and gate_fn.__name__ != "_default_apply_gate"
        if custom or not isinstance(getattr(module, "act_fn", None), nn.Module) or getattr(module, "has_gate", True) is False:
            raise ValueError(f"{name} ({cls}): unknown experts gate/activation; fp8now supports the "
                             f"act(gate) * up experts and {', '.join(LAYOUTS)}; add it to Fp8Config.ignore")
    return layout


def hf_to_fused(layout: ExpertsLayout, gate_up: torch.Tensor, down: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """transformers tensors -> (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I], b2 [E, H])."""
    w13 = gate_up.transpose(1, 2) if layout.transposed else gate_up
    w2 = down.transpose(1, 2) if layout.transposed else down
    b13 = gate_up_bias
    if layout.interleaved:
        w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
        b13 = None if b13 is None else torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return w13.contiguous(), w2.contiguous(), b13, down_bias


def hf_shapes(layer: Fp8Experts, layout: ExpertsLayout) -> dict[str, tuple[int, ...]]:
    """The transformers parameter shapes of a swapped experts module, by leaf name."""
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    shapes = {"gate_up_proj": (e, h, 2 * i) if layout.transposed else (e, 2 * i, h),
              "down_proj": (e, i, h) if layout.transposed else (e, h, i)}
    if layout.bias:
        shapes.update(gate_up_proj_bias=(e, 2 * i), down_proj_bias=(e, h))
    return shapes


def empty_fp8_experts(name: str, module: nn.Module, config: Fp8Config,
                      device: torch.device | str = "meta") -> Fp8Experts:
    """An unloaded `Fp8Experts` with the shape, layout and activation of transformers' `module`."""
    layout = experts_layout(name, module)
    gate_up = module.gate_up_proj
    e, two_i = gate_up.shape[0], gate_up.shape[2 if layout.transposed else 1]
    h = gate_up.shape[1 if layout.transposed else 2]
    layer = Fp8Experts(e, h, two_i // 2, config, bias=layout.bias, gate=layout.gate,
                       act_fn=getattr(module, "act_fn", None), alpha=float(getattr(module, "alpha", 1.702)),
                       limit=float(getattr(module, "limit", 7.0)), dense_input=layout.dense_input,
                       device=device, dtype=gate_up.dtype, name=name)
    layer.hf_layout = layout   # reload_weights maps transformers' names and layout onto the layer again
    return layer


def target_experts(model: nn.Module, config: Fp8Config
                   ) -> tuple[dict[str, nn.Module], list[tuple[str, str]]]:
    """The experts modules to quantize, and those left alone with the reason (ignore patterns)."""
    targets: dict[str, nn.Module] = {}
    ignored: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Experts):
            ignored.append((name, "already FP8 experts (not quantized again)"))
        elif is_experts(module):
            pattern = match_ignore(name, config.ignore)
            if pattern is None:
                targets[name] = module
            else:
                ignored.append((name, f"matches ignore pattern {pattern!r}"))
    return targets, ignored


def swap_experts(model: nn.Module, targets: dict[str, nn.Module], config: Fp8Config
                 ) -> dict[str, tuple[Fp8Experts, ExpertsLayout]]:
    """Replace each target experts module by an empty meta `Fp8Experts` -> {name: (layer, layout)}."""
    out = {}
    for name, module in targets.items():
        layer = empty_fp8_experts(name, module, config, "meta")
        set_submodule(model, name, layer)
        out[name] = (layer, layer.hf_layout)
    return out
