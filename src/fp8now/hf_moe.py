"""transformers MoE integration: find the fused `*Experts` modules, swap them for `Fp8Experts`.

transformers keeps routed experts as 3-D parameters `gate_up_proj`, `down_proj` of an `*Experts`
module. Most families store them `[E, 2I, H]` / `[E, H, I]` (gate rows, then up rows); some store
them transposed (`[E, H, 2I]` / `[E, I, H]`) and GPT-OSS also interleaves gate and up columns and
adds biases. `hf_to_fused` turns any of these into `Fp8Experts`' layout. Routers (`*TopKRouter`,
`router`, `gate`, DeepSeek-V3's `e_score_correction_bias`) are not experts and are left untouched;
shared experts and dense MLPs are ordinary linears (hf.target_linears).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from .config import Fp8Config
from .hf import match_ignore, set_submodule
from .linear import Fp8Linear
from .moe import Fp8Experts
from .moe_backends import expert_plan_names
from .report import ExpertsRow, LoadReport
from .weight_error import weight_error


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
                             f"table says {getattr(layout, field_name)}; update fp8now.hf_moe.LAYOUTS")
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


def experts_row(layer: Fp8Experts, w13: torch.Tensor, w2: torch.Tensor, measure: bool) -> ExpertsRow:
    """The report row of a loaded layer; per expert, the SQNR of its worse matrix (w13 or w2)."""
    per_expert: list[float] = []
    if measure:
        p13, p2 = layer.padded(w13.to(layer.w13.device), w2.to(layer.w2.device))
        for e in range(layer.num_experts):
            per_expert.append(min(weight_error(p13[e], layer.w13[e], layer.w13_scale[e], layer.scheme)[0],
                                  weight_error(p2[e], layer.w2[e], layer.w2_scale[e], layer.scheme)[0]))
    return ExpertsRow(layer.name, layer.num_experts, layer.hidden_size, layer.intermediate_size,
                      layer.scheme.value, layer.backend or "?", layer.w13_bias is not None,
                      min(per_expert) if per_expert else None,
                      statistics.median(per_expert) if per_expert else None, layer.act_kind,
                      expert_plan_names(layer))


def quantize_experts_(model: nn.Module, config: Fp8Config, measure: bool = True
                      ) -> tuple[list[ExpertsRow], list[tuple[str, str]]]:
    """Swap every materialized experts module of `model` for a loaded `Fp8Experts`, in place."""
    targets, ignored = target_experts(model, config)
    rows = []
    for name, module in targets.items():
        params = [getattr(module, leaf, None) for leaf in (*FUSED_LEAVES, *BIAS_LEAVES)]
        if any(p is not None and p.is_meta for p in params):
            raise ValueError(f"quantize_: {name} is on the meta device; load checkpoints with fp8now.load")
        layer = empty_fp8_experts(name, module, config)
        w13, w2, b13, b2 = hf_to_fused(experts_layout(name, module), *(None if p is None else p.detach()
                                                                       for p in params))
        layer.load_(w13, w2, b13, b2)
        rows.append(experts_row(layer, w13, w2, measure))
        set_submodule(model, name, layer)
    return rows, ignored


def experts_bytes(model: nn.Module) -> tuple[int, int]:
    """(bf16 bytes at 2 per element, FP8 bytes incl. scales) of every Fp8Experts of `model`."""
    bf16 = fp8 = 0
    for m in model.modules():
        if isinstance(m, Fp8Experts) and m.is_loaded:
            real = m.num_experts * 3 * m.hidden_size * m.intermediate_size
            bf16 += 2 * real
            fp8 += sum(t.numel() * t.element_size() for t in (m.w13, m.w2, m.w13_scale, m.w2_scale))
    return bf16, fp8


def add_experts(report: LoadReport, model: nn.Module, rows: list[ExpertsRow]) -> None:
    """Put the experts rows (in model order) and their bytes into a load report."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    report.experts = sorted(rows, key=lambda row: order.get(row.name, -1))
    bf16, fp8 = experts_bytes(model)
    report.bf16_bytes += bf16
    report.fp8_bytes += fp8


def freeze_fp8(model: nn.Module) -> None:
    """No gradients for the FP8 layers' tensors; the model's other parameters keep requires_grad as
    `from_pretrained` leaves them (True). Freezing those too would cost time on CPU: torch then folds a
    3-D input's matmul with a frozen weight through a transposed copy of the weight, 54 MiB and ~150 ms
    on every prefill for the embedded model's tied lm_head."""
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            module.requires_grad_(False)
