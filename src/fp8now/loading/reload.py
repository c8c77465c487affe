"""In-place weight reload for RL refit (SPEC §7): the load pipeline with new tensors in memory as its source
and the loaded model as its plan; the results are copied into the existing FP8 storage."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..layers.cpu_quantizer import weight_quantizer
from ..layers.finite import FiniteCheck
from ..layers.guard import guard_of
from ..report import ReloadReport
from .pipeline import route_tensors, stream_tensors
from .plan import plan_loaded
from .sinks import Sinks
from .source import TensorSource

WHERE = "reload_weights"


def _unknown(slots) -> callable:
    def refuse(key: str) -> None:
        example = next(iter(slots), "")
        raise ValueError(f"reload_weights: {key!r} is not a tensor of this model (names look like "
                         f"{example!r}); nothing was written for it")
    return refuse


def _applied(sinks: Sinks) -> str:
    """What an interrupted call had already written, for its error message."""
    if not sinks.updated and not sinks.copied:
        return "nothing of this call was applied"
    parts = [f"FP8 layers {', '.join(sinks.updated)}" if sinks.updated else "",
             f"tensors {', '.join(sinks.copied)}" if sinks.copied else ""]
    return "already applied by this call: " + "; ".join(p for p in parts if p)


def reload_weights(model: nn.Module,
                   named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                   timeout: float | None = None) -> ReloadReport:
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
    at all; its error (whatever its type: a note on an OSError of the iterable) lists exactly what was
    already applied, and forwards of the model then raise (`fp8now.guard`) until a reload completes.
    Unknown names raise. Finite values beyond fp16's range are warned about (`report.warnings`).

    Atomic for forwards (`fp8now.guard`): running forwards finish first (`timeout` seconds at most, None: no
    limit, else TimeoutError with nothing applied), new ones wait until the call returns; two calls on one
    model run one after the other.
    """
    start = time.perf_counter()
    g = guard_of(model)
    with g.writing(model, timeout):
        report = _reload(model, named_tensors, g)
    report.seconds = time.perf_counter() - start
    for text in report.warnings:
        warnings.warn(f"fp8now: {text}", stacklevel=2)
    return report


class _Watched:
    """A streaming source's iterator that remembers whether it raised (then no write of ours was cut short)."""

    def __init__(self, items: Iterable) -> None:
        self._it = iter(items)
        self.raised = False

    def __iter__(self) -> _Watched:
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self.raised = True
            raise


def _cpu_quantizers(plan):
    """The compiled CPU weight quantizers of the scheme of the plan's first CPU FP8 linear, where built (a reload
    builds none); None without such a layer. Layers of another scheme run torch ops. (From the plan's slots:
    no second walk over the model's modules.)"""
    layer = next((slot.owner for slot in plan.slots.values()
                  if slot.kind == "fp8" and slot.owner.weight.device.type == "cpu"), None)
    return None if layer is None else weight_quantizer(layer.scheme, 0, build=False)


def _reload(model: nn.Module, named_tensors, g) -> ReloadReport:
    """reload_weights under the model's write lock; marks the guard torn when a failure left a mix."""
    plan = plan_loaded(model)
    watched = None if isinstance(named_tensors, (Mapping, list, tuple)) else _Watched(named_tensors)
    source = TensorSource(named_tensors if watched is None else watched, WHERE)
    refuse = _unknown(plan.slots)
    sinks = Sinks(plan, None, None, False, plain="copy", whole=True, checked=source.known, deferred=False,
                  quantizers=_cpu_quantizers(plan))
    routed = None
    if source.known:   # all-or-nothing: every check before the first write
        routed = route_tensors(plan, source, refuse)
        check = FiniteCheck()   # every tensor's NaN/Inf and magnitude (FP8 weights' too: sinks skip their scales')
        check.add_many([(t, key, True) for key, t, _ in routed], label="tensor {!r}")
        try:
            plan.experts.check_merges(source.tensors(), WHERE)
            sinks.absurd += check.raise_if_bad()
        except ValueError as e:
            raise ValueError(f"{WHERE}: {e}; nothing of this call was applied") from None
    try:
        stream_tensors(plan, source, sinks, refuse, routed)
    except BaseException as e:
        applied = _applied(sinks)
        cut = not isinstance(e, (ValueError, TypeError)) and not (watched is not None and watched.raised)
        if sinks.updated or sinks.copied or cut:   # a mix of old and new weights: forwards refuse it
            first = (str(e).splitlines() or [""])[0]
            g.set_torn(f"reload_weights failed ({type(e).__name__}: {first}) part-way; {applied}"
                       + ("; the layer it was writing may be incomplete" if cut else ""))
        if isinstance(e, (ValueError, TypeError)):
            raise type(e)(f"{e}; {applied}") from None
        e.add_note(f"{WHERE}: {applied}" + ("; forwards of the model now raise until a reload_weights completes"
                                            if g.torn else ""))
        raise
    report = ReloadReport(updated_layers=sinks.updated, copied=sinks.copied,
                          skipped=[key for key, _ in sinks.skipped])
    for layer_name, parts in sinks.pending.items():
        layer = plan.slots[f"{layer_name}.weight"].owner
        needed = ("weight", "bias") if layer.bias is not None else ("weight",)
        report.partial.append((layer_name, [f"{layer_name}.{leaf}" for leaf in needed if leaf not in parts]))
    report.partial += [(name, plan.experts.missing(name)) for name in plan.experts.pending]
    report.warnings = sinks.absurd + sinks.finite.raise_if_bad()
    g.set_torn(None)
    return report
