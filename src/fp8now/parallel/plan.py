"""transformers' tensor-parallel plan -> a Style per module: which modules split, along which dim,
and what their forward then needs (the styles of transformers 5.17 - 5.25, by name)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Style:
    """What a transformers TP style does to a module's weight (split dim) and to its forward."""

    split: str                 # "out": column-parallel; "in": row-parallel; "vocab": embedding rows; "none"
    gather: bool = False       # column-parallel with the output all-gathered (replicated after)
    split_input: bool = False  # row-parallel whose input arrives whole: each rank takes its columns
    packed: int = 1            # the output dim stacks `packed` parts (fused gate_up), each split


# transformers style name -> Style (names as in transformers 5.17 - 5.25).
STYLES: dict[str, Style] = {
    "colwise": Style("out"),
    "colwise_rep": Style("out", gather=True),
    "colwise_gather_output": Style("out", gather=True),
    "packed_colwise": Style("out", packed=2),
    "rowwise": Style("in"),
    "rowwise_rep": Style("in", split_input=True),
    "rowwise_split_input": Style("in", split_input=True),
    "embedding_rowwise": Style("vocab"),
    "replicated_with_grad_allreduce": Style("none"),
    "replicate": Style("none"),
}


# The parameters of a fused experts module that plans name (transformers 5.17 - 5.25).
EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def generic_name(name: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp`, how transformers keys its plans."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", name)


def expert_entries(plan: dict[str, str], experts: Iterable[str]) -> dict[str, str]:
    """The entries of `plan` about MoE experts modules (the module, its fused parameters) or routers
    (`ep_router`): tp_moe.py decides those; the other styles act on ordinary linears."""
    generic = {generic_name(n) for n in experts}
    out = {}
    for key, style in plan.items():
        owner, _, leaf = key.rpartition(".")
        if (generic_name(key) in generic or (leaf in EXPERT_LEAVES and generic_name(owner) in generic)
                or style == "ep_router"):
            out[key] = style
    return out


def resolve_plan(model: nn.Module, tp_plan: str | dict[str, str], experts: Iterable[str] = ()
                 ) -> dict[str, str]:
    """Module name -> style name, from the model's own plan ("auto") or a user dict of the same form;
    the entries about the MoE `experts` modules are left to tp_moe.py."""
    if tp_plan == "auto":
        plan = dict(getattr(model, "_tp_plan", None) or {})
        if not plan:
            raise ValueError(f"{type(model).__name__} defines no tensor-parallel plan (config.base_model_tp_plan"
                             "); pass tp_plan={module pattern: style} to fp8now.load")
    elif isinstance(tp_plan, dict):
        plan = dict(tp_plan)
    else:
        raise TypeError(f"tp_plan must be 'auto' or a dict of module pattern -> style, got {tp_plan!r}")
    for key in expert_entries(plan, experts):
        del plan[key]
    modules = [name for name, _ in model.named_modules()]
    for name, _ in model.named_parameters():
        if generic_name(name) in plan or name in plan:
            raise ValueError(f"{name}: tensor-parallel style {plan.get(name, plan.get(generic_name(name)))!r} "
                             "on a parameter; fp8now splits linear and embedding modules and MoE experts")
    out: dict[str, str] = {}
    for name in modules:
        style = plan.get(name, plan.get(generic_name(name)))
        if style is None:
            continue
        if style not in STYLES:
            raise ValueError(f"tensor-parallel style {style!r} of {name} is not supported by fp8now yet "
                             f"(known: {', '.join(STYLES)})")
        out[name] = style
    return out


def check_heads(model: nn.Module, plan: dict[str, str], size: int) -> None:
    """Column-split attention projections must keep whole heads on each rank."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    split = [n for n, s in plan.items() if STYLES[s].split == "out" and not STYLES[s].gather
             and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
    for field_name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(cfg, field_name, None)
        if split and isinstance(heads, int) and heads % size:
            raise ValueError(f"tensor parallel size {size} does not divide {field_name}={heads} of this model "
                             f"(e.g. {split[0]} would split a head); choose a TP size that divides it")
