"""MoE experts under a tensor-parallel group (SPEC §6): expert parallelism or TP inside the experts.

"ep" (the default): whole experts per rank, contiguous and even, as transformers' own expert plan
places them (`grouped_gemm` is `Shard(0)` on the expert dim); each rank reads only its experts and
their scales need nothing. "tp": every rank holds every expert, `w13` column-parallel (its output
rows: the gate and up halves each split alike) and `w2` row-parallel (its input, the intermediate dim
I); tensor scales (w13, w2) and channel scales (w2) take the amax MAX over the group, and block tiles
must not be cut.
tp_moe_forward.py holds the forward; this file decides the split and feeds the loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import numerics
from ..config import Scheme
from ..hf.modules import set_submodule
from ..hf.experts import ExpertsLayout, hf_shapes, is_experts
from ..layers.moe import Fp8Experts
from .plan import expert_entries, generic_name
from .slices import Slice, check_block, split_ranges

MODES = ("ep", "tp")
# transformers' per-parameter expert styles (5.17's tp_plan, 5.25's ep_plan) -> the mode they mean.
PARAM_STYLES = {"grouped_gemm": "ep", "packed_colwise": "tp", "colwise": "tp", "rowwise": "tp",
                "packed_rowwise": "tp"}
# Forward styles of the experts module or the router: fp8now's own collectives take their place.
FORWARD_STYLES = ("ep_dispatch_experts", "moe_tp_experts", "ep_router")


@dataclass(frozen=True)
class ExpertsSplit:
    """This rank's part of one experts layer: global expert ids [a, b) and intermediate rows [a, b)."""

    mode: str
    experts: tuple[int, int]
    inter: tuple[int, int]
    num_experts: int           # all ranks together
    placement: str             # where the split comes from, for the report


def experts_names(model: nn.Module) -> list[str]:
    """Every MoE experts module of `model`: FP8 ones and those left in bf16."""
    return [n for n, m in model.named_modules() if isinstance(m, Fp8Experts) or is_experts(m)]


def experts_mode(tp_plan: str | dict[str, str], names: list[str], moe_parallel: str | None) -> str:
    """"ep" or "tp": `moe_parallel`, else what a user plan's expert styles say, else "ep".

    The model's own plan ("auto") is not asked: transformers 5.17 puts TP inside the experts in its
    tp_plan and 5.25 expert parallelism in its ep_plan, so "auto" would change with the version."""
    if moe_parallel not in (None, *MODES):
        raise ValueError(f"moe_parallel must be 'ep' (whole experts per rank) or 'tp' (every expert split "
                         f"across the ranks), got {moe_parallel!r}")
    implied: set[str] = set()
    if isinstance(tp_plan, dict):
        for key, style in expert_entries(tp_plan, names).items():
            if style in PARAM_STYLES:
                implied.add(PARAM_STYLES[style])
            elif style not in FORWARD_STYLES:
                raise ValueError(f"tp_plan: style {style!r} of {key} is not an experts style fp8now knows "
                                 f"(parameters: {', '.join(PARAM_STYLES)}; modules: {', '.join(FORWARD_STYLES)})")
    if len(implied) > 1 or (implied and moe_parallel and implied != {moe_parallel}):
        raise ValueError(f"tp_plan asks for {' and '.join(sorted(implied))} on the MoE experts"
                         + (f" but moe_parallel={moe_parallel!r}" if moe_parallel else "")
                         + ": pick one (moe_parallel='ep' or 'tp')")
    return moe_parallel or (implied.pop() if implied else "ep")


def _split(model: nn.Module, name: str, layer: Fp8Experts, mode: str, size: int, rank: int) -> ExpertsSplit:
    """This rank's experts (ep) or intermediate rows (tp); refusals name the layer, before any read."""
    e, i = layer.num_experts, layer.intermediate_size
    if mode == "ep":
        if e % size:
            raise ValueError(f"{name}: {e} experts do not split evenly over {size} expert-parallel ranks; use "
                             f"a group size that divides {e}, or moe_parallel='tp'")
        ep_plan = getattr(model, "_ep_plan", None) or {}
        planned = ep_plan.get(generic_name(f"{name}.gate_up_proj")) == "grouped_gemm"
        placement = ("transformers ep_plan grouped_gemm (Shard(0) on the expert dim)" if planned
                     else "even contiguous split (the model has no expert-parallel plan)")
        step = e // size
        return ExpertsSplit(mode, (rank * step, (rank + 1) * step), (0, i), e, placement)
    (inter,) = split_ranges(i, size, rank, 1, f"{name} (expert intermediate size)")
    if layer.scheme is Scheme.BLOCK:
        check_block(f"{name} (w13 gate/up rows, w2 columns)", Slice(0, (inter,), (i, layer.hidden_size)))
    return ExpertsSplit(mode, (0, e), inter, e, "tensor parallel inside the experts")


def _fused_slices(name: str, layer: Fp8Experts, layout: ExpertsLayout, split: ExpertsSplit) -> dict[str, Slice]:
    """Checkpoint name -> slice for experts stored fused (`gate_up_proj [E, 2I, H]` ...)."""
    shapes = hf_shapes(layer, layout)
    out = {}
    if split.mode == "ep":
        for leaf, shape in shapes.items():
            out[f"{name}.{leaf}"] = Slice(0, (split.experts,), shape)
        return out
    a, b = split.inter
    i = layer.intermediate_size
    halves = ((2 * a, 2 * b),) if layout.interleaved else ((a, b), (i + a, i + b))  # gate and up alike
    for leaf, shape in shapes.items():
        if leaf.startswith("gate_up"):
            dim = 2 if layout.transposed and leaf == "gate_up_proj" else 1
            out[f"{name}.{leaf}"] = Slice(dim, halves, shape)
        elif leaf == "down_proj":
            out[f"{name}.{leaf}"] = Slice(1 if layout.transposed else 2, (split.inter,), shape)
    return out  # down_proj_bias [E, H]: whole on every rank, added once after the sum


def _local_layer(name: str, layer: Fp8Experts, split: ExpertsSplit) -> Fp8Experts:
    """An empty meta Fp8Experts of this rank's shape, same activation and layout."""
    bias = layer.w13_bias
    return Fp8Experts(split.experts[1] - split.experts[0], layer.hidden_size, split.inter[1] - split.inter[0],
                      layer.config, bias=bias is not None, gate=layer.gate_kind, act_fn=layer.act_fn, alpha=layer.alpha,
                      limit=layer.limit, dense_input=layer.dense_input, device="meta",
                      dtype=torch.bfloat16 if bias is None else bias.dtype, name=name, split=True)


def _expert_index(key: str, pattern: str) -> int:
    """The expert number of a per-expert checkpoint key, at the `*` of transformers' source pattern."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None:
        raise ValueError(f"checkpoint key {key!r} does not match transformers' experts pattern {pattern!r}")
    return int(match.group(1))


@dataclass
class ExpertsTp:
    """The experts side of one tensor-parallel load: which parts this rank reads, and how it quantizes."""

    state: object                                   # tp.TpState
    splits: dict[str, ExpertsSplit] = field(default_factory=dict)
    layouts: dict[str, ExpertsLayout] = field(default_factory=dict)
    fused_slices: dict[str, Slice] = field(default_factory=dict)   # fused name -> this rank's slice of it

    def claim(self, fused: str, key: str, pattern: str) -> None:
        """A per-expert checkpoint key of `fused`: skipped (another rank's expert) or read in slices."""
        state = self.state
        state.slices.pop(fused, None)  # the fused tensor's slice does not fit one expert's tensor
        part = self._part(fused, key, pattern)
        if part is False:
            state.skip.add(key)
        elif part is not None:
            state.slices[fused] = part

    def _part(self, fused: str, key: str, pattern: str) -> Slice | bool | None:
        """This rank's part of one expert's tensor `key` of `fused`: False (another rank's expert), a
        Slice, or None (all of it)."""
        name, _, leaf = fused.rpartition(".")
        split = self.splits[name]
        if split.mode == "ep":
            return None if split.experts[0] <= _expert_index(key, pattern) < split.experts[1] else False
        if leaf == "down_proj_bias":
            return None
        dim = 0 if leaf.startswith("gate_up") else 1   # Linear weights [out, in]: gate/up split rows, down columns
        if self.layouts[name].transposed and leaf in ("gate_up_proj", "down_proj"):
            dim = 1 - dim
        return Slice(dim, (split.inter,), ())

    def full_shape(self, fused: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape of `fused`, whose part on this rank has shape `local`."""
        sl = self.fused_slices.get(fused)
        return local if sl is None else sl.full_shape

    def local(self, fused: str, key: str, pattern: str | None, t: torch.Tensor) -> torch.Tensor | None:
        """reload_weights: this rank's part of a full tensor, `fused` whole (pattern None) or one expert's
        `key`; None for another rank's expert."""
        if pattern is None:
            sl = self.fused_slices.get(fused)
            return t if sl is None else sl.of(t)
        part = self._part(fused, key, pattern)
        return None if part is False else t if part is None else part.of(t)

    def load(self, layer: Fp8Experts, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
             b2: torch.Tensor | None) -> None:
        """Quantize this rank's part with SPEC §6's scales; one collective per layer on every rank."""
        split = self.splits[layer.name]
        leaves = [] if split.mode == "ep" else {Scheme.TENSOR: ["w13", "w2"], Scheme.CHANNEL: ["w2"]}.get(
            layer.scheme, [])
        error, amax = None, None
        try:
            if leaves:
                local = {leaf: torch.stack([numerics.weight_amax(w[x], layer.scheme, f"{layer.name}.{leaf}[{x}]")
                                            for x in range(layer.num_experts)])
                         for leaf, w in (("w13", w13), ("w2", w2)) if leaf in leaves}
                amax = torch.cat([a.reshape(-1) for a in local.values()])
            else:
                layer.load_(w13, w2, b13, b2)
        except ValueError as e:
            error = e if split.experts[0] == 0 else ValueError(
                f"{e} (this rank holds experts {split.experts[0]}..{split.experts[1] - 1}: local index i is "
                f"expert {split.experts[0]} + i)")
        per_expert = 1 if layer.scheme is Scheme.TENSOR else layer.hidden_size  # channel: w2's rows
        numel = layer.num_experts * per_expert * len(leaves)
        amax = self.state.agree(f"experts {layer.name}", error, amax, numel)
        if leaves:
            parts = dict(zip(local, amax.split([a.numel() for a in local.values()])))
            layer.load_(w13, w2, b13, b2, amax={k: v.reshape(local[k].shape) for k, v in parts.items()})


def shard_experts(model: nn.Module, tp_plan: str | dict[str, str], experts: dict, moe_parallel: str | None,
                  state) -> ExpertsTp:
    """Replace each FP8 experts layer of `experts` ({name: (layer, layout)}, updated in place) by this
    rank's meta part, note the slices it reads, install the forward; bf16 experts stay whole."""
    from .experts_forward import install

    names = experts_names(model)
    mode = experts_mode(tp_plan, names, moe_parallel)
    out = ExpertsTp(state)
    for name in names:
        if name not in experts:
            state.replicated.append((name, "MoE experts left in bf16: kept whole on every rank"))
    for name, (layer, layout) in list(experts.items()):
        split = _split(model, name, layer, mode, state.size, state.rank)
        slices = _fused_slices(name, layer, layout, split)
        out.fused_slices.update(slices)
        state.slices.update(slices)
        local = _local_layer(name, layer, split)
        local.hf_layout = layout   # reload_weights maps transformers' names onto the part again
        set_submodule(model, name, local)
        experts[name] = (local, layout)
        out.splits[name], out.layouts[name] = split, layout
        install(local, split, state)
    return out
