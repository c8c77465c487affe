"""Tensor parallelism on the model's own transformers plan (SPEC §6): the slice each rank reads,
and the weight-scale amax reduced over the TP group.

tp_plan.py turns the model's plan into a style per module; tp_forward.py holds the forward
collectives. Every layer
makes one small collective at load (a failure flag, plus the amax where a scale group spans the
split), so all ranks stay in step and a rank that fails stops the others with the layer's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import numerics
from ..config import Scheme
from ..hf.modules import set_submodule, tied_names
from ..layers.linear import Fp8Linear
from ..layers.weights import check_float_weight
from .plan import STYLES, Style, check_heads, resolve_plan
from .slices import Slice, check_block, split_ranges
from .forward import check_invariant_backend, install
from .experts import experts_names, shard_experts


@dataclass
class TpState:
    """One rank's view of a tensor-parallel model: its slices, the group, the counters of what it read."""

    group: object
    rank: int
    size: int
    invariant: bool
    slices: dict[str, Slice] = field(default_factory=dict)        # tensor name -> this rank's slice
    styles: dict[str, Style] = field(default_factory=dict)        # module name -> style
    global_amax: dict[str, bool] = field(default_factory=dict)    # Fp8Linear name -> scale spans the split
    replicated: list[tuple[str, str]] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)                   # checkpoint keys of other ranks' experts
    moe: object = None                                            # tp_moe.ExpertsTp
    read_bytes: int = 0

    @property
    def comm_device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def full_shapes_into(self, slots: dict) -> None:
        """Checkpoint shapes for the header checks: a sliced tensor's slot holds its local shape."""
        for name, sl in self.slices.items():
            if name in slots:
                slots[name].shape = sl.full_shape

    def local(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's slice of a full tensor given by name (reload_weights)."""
        sl = self.slices.get(name)
        return t if t is None or sl is None else sl.of(t)

    def reload_layer(self, layer: Fp8Linear, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        """reload_weights: slice the full tensors, then load like at load time (same collective)."""
        self.load_layer(layer, self.local(f"{layer.name}.weight", w), self.local(f"{layer.name}.bias", bias))

    def collective(self, fn, what: str) -> None:
        """Run one collective; a failure or timeout names what this rank was doing."""
        try:
            fn()
        except Exception as e:  # gloo / NCCL raise RuntimeError or DistError subclasses
            raise RuntimeError(f"tensor-parallel rank {self.rank}: the collective for {what} failed ({e}); "
                               "another rank probably stopped earlier: its own error names the cause") from e

    def agree(self, what: str, error: Exception | None, amax: torch.Tensor | None, numel: int
              ) -> torch.Tensor | None:
        """All-reduce MAX of [failed?, amax...]; every rank raises if any failed; -> the global amax."""
        payload = torch.zeros(1 + numel, dtype=torch.float32, device=self.comm_device)
        payload[0] = float(error is not None)
        if error is None and amax is not None:
            payload[1:] = amax.reshape(-1).to(payload.device)
        self.collective(lambda: dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=self.group), what)
        if payload[0] > 0:
            messages: list = [None] * self.size
            self.collective(lambda: dist.all_gather_object(messages, None if error is None else str(error),
                                                           group=self.group), what)
            if error is not None:
                raise error
            rank, msg = next((r, m) for r, m in enumerate(messages) if m is not None)
            raise RuntimeError(f"tensor-parallel load stopped at {what}: rank {rank} failed: {msg}")
        return None if amax is None else payload[1:].reshape(amax.shape).to(amax.device)

    def load_layer(self, layer: Fp8Linear, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize this rank's slice with SPEC §6's scales; one collective per layer on every rank."""
        needs = self.global_amax.get(layer.name, False)
        error, amax = None, None
        try:
            if needs:
                check_float_weight(w, layer.name, (layer.out_features, layer.in_features))
                amax = numerics.weight_amax(w, layer.scheme, layer.name)
            else:
                layer.load_(w, bias)
        except ValueError as e:
            error = e
        numel = (1 if layer.scheme is Scheme.TENSOR else layer.out_features) if needs else 0
        amax = self.agree(f"layer {layer.name}", error, amax, numel)
        if needs:
            layer.load_(w, bias, amax=amax)
        if self.invariant and self.styles.get(layer.name, Style("none")).split == "in":
            check_invariant_backend(layer)


def _scale_spans_split(scheme: Scheme, split: str) -> bool:
    """SPEC §6: tensor scales span any split, channel scales span a row-parallel (input) split."""
    return scheme is Scheme.TENSOR or (scheme is Scheme.CHANNEL and split == "in")


def shard(model: nn.Module, tp_plan: str | dict[str, str], invariant: bool = False, group=None,
          experts: dict | None = None, moe_parallel: str | None = None) -> TpState:
    """Give each planned module and each FP8 experts layer of `experts` ({name: (layer, layout)},
    updated in place; tp_moe.py) this rank's local shape (still on meta) and install the forward
    collectives; -> the TpState the loader reads through. Raises before any data is read."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_plan needs torch.distributed initialised: launch with torchrun and call "
                           "torch.distributed.init_process_group('nccl' or 'gloo') before fp8now.load")
    group = group or dist.group.WORLD
    state = TpState(group, dist.get_rank(group), dist.get_world_size(group), invariant)
    plan = resolve_plan(model, tp_plan, experts_names(model))
    check_heads(model, plan, state.size)
    modules = dict(model.named_modules())
    for name, style_name in plan.items():
        style, module = STYLES[style_name], modules[name]
        if style.split == "none":
            continue
        if not isinstance(module, (Fp8Linear, nn.Linear, nn.Embedding)):
            raise ValueError(f"{name}: tensor-parallel style {style_name!r} on a {type(module).__name__}; "
                             "fp8now shards linear and embedding layers")
        state.styles[name] = style
        for leaf, sl in _module_slices(name, module, style, state).items():
            state.slices[f"{name}.{leaf}"] = sl
    _untie_mismatched(model, state)
    for name, style in state.styles.items():
        _resize(model, name, modules[name], state)
        install(model.get_submodule(name), name, style, state)
    state.moe = shard_experts(model, tp_plan, experts if experts is not None else {}, moe_parallel, state)
    return state


def _module_slices(name: str, module: nn.Module, style: Style, state: TpState) -> dict[str, Slice]:
    """Tensor leaf -> slice for one module; block-scheme alignment checked here, before any read."""
    shape = tuple(module.weight.shape)
    dim = 1 if style.split == "in" else 0
    parts = style.packed if style.split == "out" else 1
    out = {"weight": Slice(dim, split_ranges(shape[dim], state.size, state.rank, parts, name), shape)}
    bias = getattr(module, "bias", None)
    if bias is not None and style.split == "out":
        out["bias"] = Slice(0, out["weight"].ranges, (shape[0],))
    if isinstance(module, Fp8Linear):
        if module.scheme is Scheme.BLOCK:
            check_block(name, out["weight"])
        state.global_amax[name] = _scale_spans_split(module.scheme, style.split)
    return out


def _untie_mismatched(model: nn.Module, state: TpState) -> None:
    """A weight tied across modules (embeddings and lm_head) is sliced only if every owner slices it alike."""
    for name, others in tied_names(model).items():
        group = [name, *others]
        specs = {state.slices.get(n) for n in group}
        if len(specs) > 1:
            for n in group:
                state.slices.pop(n, None)
                module = n.rsplit(".", 1)[0]
                if state.styles.pop(module, None) is not None:
                    state.replicated.append((module, f"weight tied to {', '.join(m for m in group if m != n)}, "
                                                     "which the plan does not split alike: kept whole"))


def _resize(model: nn.Module, name: str, module: nn.Module, state: TpState) -> None:
    """Replace the module's meta tensors by meta tensors of this rank's local shapes."""
    local = {leaf: state.slices[f"{name}.{leaf}"] for leaf in ("weight", "bias")
             if f"{name}.{leaf}" in state.slices}
    shape = list(module.weight.shape)
    sl = local["weight"]
    shape[sl.dim] = sum(b - a for a, b in sl.ranges)
    if isinstance(module, Fp8Linear):
        layer = Fp8Linear(shape[1], shape[0], module.bias is not None, module.config, device="meta",
                          dtype=module.bias.dtype if module.bias is not None else torch.bfloat16, name=name)
        set_submodule(model, name, layer)
        return
    tied = tied_names(model)
    for leaf, sl in local.items():
        old = module._parameters[leaf]
        new_shape = list(old.shape)
        new_shape[sl.dim] = sum(b - a for a, b in sl.ranges)
        param = nn.Parameter(torch.empty(new_shape, dtype=old.dtype, device="meta"), requires_grad=False)
        for alias in [f"{name}.{leaf}", *tied.get(f"{name}.{leaf}", [])]:
            owner, _, attr = alias.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = param
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = shape[0], shape[1]
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = shape[0]
