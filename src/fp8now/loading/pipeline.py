"""The load pipeline that every entry point runs: route a source's tensors by the plan (every header checked
before the first write where the source is known whole), stream them to the sinks, then finish the model.

    fp8now.load        FileSource (bf16 files, or FP8 files as stored)  + plan_quantize / plan_prequantized
    quantize_          TensorSource (the model's own float weights)     + plan_quantize
    reload_weights     TensorSource (new tensors, dict or stream)       + plan_loaded
A tensor-parallel load differs only in its plan (this rank's slices) and the file reader (slices only)."""

from __future__ import annotations

import torch
from torch import nn

from ..hf.head import tie_embeddings
from ..hf.modules import freeze_fp8
from .plan import Plan
from .route import Dest, route_files
from .sinks import Sinks
from .source import FileSource, TensorSource, header_of


def stream_files(plan: Plan, source: FileSource, sinks: Sinks) -> None:
    """A whole checkpoint: every header routed and checked, then the data read file by file into the sinks."""
    reads, skipped = route_files(plan.router(), source)
    sinks.skipped += skipped
    names = {where: {key: d.name for key, d in dests.items()} for where, dests in reads.items()}
    for key, t, where in source.read(names, sinks.device, plan.tp):
        sinks.add(reads[where][key], key, t, where)
        del t
    sinks.close()


def route_tensors(plan: Plan, source: TensorSource, on_unknown) -> list[tuple[str, torch.Tensor, Dest]]:
    """Route every tensor of a known in-memory source (shapes and dtypes checked) before anything is written;
    `on_unknown(key)` raises for a name the model does not have."""
    router = plan.router()
    routed = []
    for h, (key, t) in zip(source.headers(), source.items):
        d = router.route(h)
        if d.kind == "unknown":
            on_unknown(key)
        routed.append((key, t, d))
    return routed


def stream_tensors(plan: Plan, source: TensorSource, sinks: Sinks, on_unknown,
                   routed: list[tuple[str, torch.Tensor, Dest]] | None = None) -> None:
    """An in-memory source: routed whole first where it is known (a dict or list; `routed`: done already),
    else tensor by tensor."""
    if source.known:
        for key, t, d in routed if routed is not None else route_tensors(plan, source, on_unknown):
            sinks.add(d, key, t, source.where)
        return
    router = plan.router()
    for key, t in source:
        d = router.route(header_of(key, t, source.where))
        if d.kind == "unknown":
            on_unknown(key)
        sinks.add(d, key, t, source.where)


def finish(model: nn.Module, device: torch.device, source: str) -> None:
    """After a load: tied FP8 embeddings read their head; buffers to the device; nothing may remain on meta;
    FP8 layers frozen; eval mode."""
    tie_embeddings(model)
    for module in model.modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[leaf] = buf.to(device)
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t.is_meta:
                raise RuntimeError(f"{kind} {name} is still on the meta device after loading {source}; "
                                   "this is a bug in fp8now: please report it with the model's config.json")
    freeze_fp8(model)
    model.eval()
