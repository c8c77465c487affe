"""The plan of one load, made once from the config and the model: which modules become FP8 layers (dense linears,
experts, the head, the embedding) and which are left alone and why, each rank's tensor-parallel slices, and every
tensor the load then expects (slots). Making the plan swaps the FP8 modules into the model, empty on meta."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import Fp8Config
from ..hf.head import prepare as prepare_head
from ..hf.experts import swap_experts, target_experts
from ..hf.modules import embedding_name, swap_linears, target_linears
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..parallel.shard import TpState, shard
from .experts import ExpertsLoad
from .route import Dest, Router
from .slots import Slot, keep_fp32_names, model_slots


@dataclass
class Plan:
    """What a load writes into `model` and how checkpoint keys reach it. `experts`: the MoE experts being merged
    and quantized; `adopted`: a pre-quantized checkpoint's FP8 layers (loading.prequantized); `explicit`: keys
    the plan routes itself; `tp`: this rank's tensor-parallel state; `ignored`: (module, why) left alone."""

    model: nn.Module
    slots: dict[str, Slot]
    alias_of: dict[str, str]
    computed: set[str]
    ignored: list[tuple[str, str]] = field(default_factory=list)
    experts: ExpertsLoad | None = None
    adopted: object = None
    explicit: dict[str, Dest] = field(default_factory=dict)
    tp: TpState | None = None
    replaced: dict[str, nn.Module] = field(default_factory=dict)   # module name -> what the plan swapped out
    scheme: str = ""   # the scheme the report shows (a pre-quantized checkpoint: its first FP8 layer's)
    weight_numerics: str = "spec"   # the rules the weights were quantized by (Fp8Config.weight_numerics)

    @property
    def prefix(self) -> str:
        return getattr(self.model, "base_model_prefix", "") or ""

    def router(self) -> Router:
        return Router(self.slots, self.alias_of, self.computed, self.prefix, self.experts, self.explicit)

    def keep_fp32(self) -> None:
        """Parameters the model keeps in float32 (`_keep_in_fp32_modules`) are stored so."""
        for name in keep_fp32_names(self.model, self.slots):
            self.slots[name].keep_fp32 = self.slots[name].kind == "param"


def already_fp8(model: nn.Module) -> bool:
    """True when `model` holds FP8 layers already (quantize_ is idempotent: those are not quantized again)."""
    return any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())


def plan_quantize(model: nn.Module, config: Fp8Config, where: str, dtype: torch.dtype, *, tp_plan=None,
                  tp_group=None, moe_parallel: str | None = None) -> Plan:
    """The plan of a load from float tensors (`fp8now.load` of a bf16 checkpoint, `quantize_`): the target
    linears, experts, head and embedding swapped for empty FP8 modules; with `tp_plan`, this rank's parts."""
    emb = embedding_name(model) if config.embedding else None
    replaced = {} if emb is None else {emb: model.get_submodule(emb)}
    prepare_head(model, config, where, dtype, tp=tp_plan is not None)   # head=, embedding=
    targets, ignored = target_linears(model, config)
    expert_targets, experts_ignored = target_experts(model, config)
    replaced.update({**targets, **expert_targets})
    if not targets and not expert_targets and not already_fp8(model):
        raise ValueError(f"{where}: nothing to quantize: all {len(ignored)} linear layers are left alone (e.g. "
                         f"{ignored[0] if ignored else 'none found'}); loosen Fp8Config.ignore")
    if moe_parallel is not None and tp_plan is None:
        raise ValueError("moe_parallel splits MoE experts across a tensor-parallel group: pass tp_plan too")
    experts = ExpertsLoad(model, swap_experts(model, expert_targets, config))
    swap_linears(model, targets, config, "meta", dtype)
    invariant = config.tp_invariant
    tp = None if tp_plan is None else shard(model, tp_plan, invariant, tp_group, experts.layers, moe_parallel)
    slots, alias_of, computed = model_slots(model)
    if tp is not None:
        tp.full_shapes_into(slots)
        model._fp8now_tp = tp
        experts.tp = tp.moe
    experts.add_slots(slots)
    plan = Plan(model, slots, alias_of, computed, ignored + experts_ignored, experts, tp=tp, replaced=replaced,
                scheme=config.scheme.value, weight_numerics=config.weight_numerics)
    plan.keep_fp32()
    return plan


def plan_loaded(model: nn.Module) -> Plan:
    """The plan of `reload_weights`: the loaded model's own FP8 layers, experts (under transformers' names) and
    plain tensors; under tensor parallelism the load's slices (full tensors in, this rank's parts kept)."""
    slots, alias_of, computed = model_slots(model)
    tp = getattr(model, "_fp8now_tp", None)
    if tp is not None:
        tp.full_shapes_into(slots)
    experts = ExpertsLoad(model, None, None if tp is None else tp.moe)
    experts.add_slots(slots)
    return Plan(model, slots, alias_of, computed, experts=experts, tp=tp)
