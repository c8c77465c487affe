"""In-place weight reload for RL refit (SPEC §7): re-quantize into the existing FP8 storage."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .checkpoint import ST_DTYPES
from .finite import check_finite
from .hf import Slot, model_slots, resolve_name
from .legacy import legacy_reason
from .linear import Fp8Linear, check_float_weight
from .moe_load import ExpertsLoad
from .report import ReloadReport

_ST_NAME = {dtype: name for name, dtype in ST_DTYPES.items()}
WHERE = "reload_weights"


def _reload_slot(key: str, t: torch.Tensor, slots: dict[str, Slot], alias_of: dict[str, str],
                 computed: set[str], prefix: str, known: set[str], experts: ExpertsLoad
                 ) -> tuple[str, Slot | None]:
    """The model name and slot for a reloaded tensor (None: a computed buffer); checks shape and dtype.
    One expert's tensor (`mlp.experts.3.gate_proj.weight`) gives the fused experts param it merges into."""
    name = resolve_name(key, known, prefix)
    if name is None and legacy_reason(key):
        return key, None
    if name is None and experts.layers and isinstance(t, torch.Tensor):
        name, is_part = experts.claim(key, WHERE, _ST_NAME.get(t.dtype, str(t.dtype)), known, prefix)
        if is_part:
            return name, slots[name]
    if name is None:
        example = next(iter(slots), "")
        raise ValueError(f"reload_weights: {key!r} is not a tensor of this model (names look like "
                         f"{example!r}); nothing was written for it")
    if name in computed:
        return name, None
    name = alias_of.get(name, name)
    slot = slots[name]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"reload_weights: {key!r} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != slot.shape:
        raise ValueError(f"reload_weights: {key!r} has shape {tuple(t.shape)}, the model expects "
                         f"{slot.shape}")
    if slot.is_float:
        check_float_weight(t, key, slot.shape)
    return name, slot


def _applied(report: ReloadReport) -> str:
    """What an interrupted call had already written, for its error message."""
    if not report.updated_layers and not report.copied:
        return "nothing of this call was applied"
    parts = [f"FP8 layers {', '.join(report.updated_layers)}" if report.updated_layers else "",
             f"tensors {', '.join(report.copied)}" if report.copied else ""]
    return "already applied by this call: " + "; ".join(p for p in parts if p)


def reload_weights(model: nn.Module,
                   named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                   ) -> ReloadReport:
    """Replace some or all weights of a loaded model in place (SPEC §7, RL refit).

    Names are checkpoint / parameter names. An FP8 layer is re-quantized once its weight (and bias)
    arrived, and the results are copied into its existing storage: Parameter objects and data_ptr()
    never change, so captured CUDA graphs stay valid. Other tensors are copied in place. A layer
    whose weight or bias is missing from this call is not touched and is listed in `report.partial`.
    An FP8 embedding (Fp8Config(embedding=True)) is re-quantized per row; tied to an FP8 head, its name
    (`model.embed_tokens.weight`) reloads the head, which the embedding reads.
    MoE experts take transformers' fused names (`mlp.experts.gate_up_proj`) or the per-expert names
    of checkpoints (`mlp.experts.3.gate_proj.weight`, Mixtral's `w1/w3/w2`), merged by transformers'
    own rules; an experts module is re-quantized once all of its experts arrived.
    A dict or list is all-or-nothing: names, shapes, dtypes and NaN/Inf of every tensor are checked
    before the first write. A streaming iterable is applied layer by layer, each layer whole or not
    at all; its error lists exactly what was already applied. Unknown names raise.
    """
    start = time.perf_counter()
    slots, alias_of, computed = model_slots(model)
    tp = getattr(model, "_fp8now_tp", None)  # tensor parallel: full tensors in, this rank's slices kept
    if tp is not None:
        tp.full_shapes_into(slots)
    prefix = getattr(model, "base_model_prefix", "") or ""
    experts = ExpertsLoad(model, None, None if tp is None else tp.moe)   # transformers' names, not w13/w2
    experts.add_slots(slots)
    known = set(slots) | set(alias_of) | computed
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    checked = isinstance(items, (list, tuple))
    if checked:
        for key, t in items:
            _reload_slot(key, t, slots, alias_of, computed, prefix, known, experts)
        try:
            experts.check_merges(dict(items), WHERE)
            check_finite([(t, f"tensor {key!r}") for key, t in items])
        except ValueError as e:
            raise ValueError(f"{WHERE}: {e}; nothing of this call was applied") from None
    report = ReloadReport()
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in items:
        try:
            _apply_one(key, t, slots, alias_of, computed, prefix, known, pending, report, checked, tp, experts)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e}; {_applied(report)}") from None
    for layer_name, parts in pending.items():
        needed = ("weight", "bias") if slots[f"{layer_name}.weight"].owner.bias is not None else ("weight",)
        report.partial.append((layer_name, [f"{layer_name}.{leaf}" for leaf in needed if leaf not in parts]))
    report.partial += [(name, experts.missing(name)) for name in experts.pending]
    report.seconds = time.perf_counter() - start
    return report


def _apply_one(key: str, t: torch.Tensor, slots: dict[str, Slot], alias_of: dict[str, str],
               computed: set[str], prefix: str, known: set[str],
               pending: dict[str, dict[str, tuple[str, torch.Tensor]]], report: ReloadReport,
               checked: bool, tp, experts: ExpertsLoad) -> None:
    """Write one tensor (or, with its last part, one whole FP8 layer or experts module); `checked`:
    NaN/Inf done already; `tp`: the model's TpState (each rank keeps its slice) or None."""
    name, slot = _reload_slot(key, t, slots, alias_of, computed, prefix, known, experts)
    if slot is None:
        report.skipped.append(key)
        return
    if slot.kind == "experts":   # Fp8Experts.load_ checks NaN/Inf of the whole module before writing
        layer = slot.owner
        bias_dtype = layer.w13_bias.dtype if layer.w13_bias is not None else layer.w13.dtype
        if tp is not None:   # this rank's part (None: another rank's expert)
            t = tp.moe.local(name, key, experts.pattern_of.get(key), t)
        with torch.no_grad():
            if experts.add(name, key, t, WHERE, layer.w13.device, bias_dtype, measure=False):
                report.updated_layers.append(layer.name)
        return
    if slot.kind == "embedding":   # Fp8Embedding: re-quantized per row into its storage (NaN/Inf raise first)
        try:
            with torch.no_grad():
                slot.owner.load_(t)   # (tensor parallel loads refuse embedding=True)
        except ValueError as e:
            raise ValueError(f"reload_weights: {key!r}: {e}") from None
        report.updated_layers.append(slot.owner.name)
        return
    if slot.kind != "fp8":
        if not checked:
            check_finite([(t, f"reload_weights: tensor {key!r}")])
        store = slot.owner._parameters if slot.kind == "param" else slot.owner._buffers
        with torch.no_grad():
            store[slot.leaf].copy_(t if tp is None else tp.local(name, t))
        report.copied.append(name)
        return
    layer = slot.owner
    assert isinstance(layer, Fp8Linear)
    layer_name = name.rsplit(".", 1)[0]
    if not checked and slot.leaf == "bias":  # the quantizer checks the weight before writing it
        check_finite([(t, f"reload_weights: tensor {key!r}")])
    parts = pending.setdefault(layer_name, {})
    parts[slot.leaf] = (key, t)
    if "weight" not in parts or (layer.bias is not None and "bias" not in parts):
        return
    wkey, w = parts["weight"]
    bias = parts["bias"][1] if "bias" in parts else None
    try:
        with torch.no_grad():
            layer.load_(w, bias) if tp is None else tp.reload_layer(layer, w, bias)
    except ValueError as e:
        raise ValueError(f"reload_weights: {wkey!r}: {e}") from None
    del pending[layer_name]
    report.updated_layers.append(layer_name)
