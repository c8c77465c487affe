"""`quantize_`: a model already in memory gets its FP8 layers in place. The load pipeline with the model's own
float tensors as its source: the plan swaps the targets for empty FP8 modules, the sinks quantize each one on
its weight's device, and every other tensor stays where it is."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..config import Fp8Config
from ..hf.head import tie_embeddings
from ..hf.modules import set_submodule
from ..layers.cpu_quantizer import install as install_cpu_quantizer
from ..layers.guard import install as install_guard
from ..layers.embedding import Fp8Embedding
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..layers.shared_input import share_inputs
from ..report import LoadReport
from .pipeline import stream_tensors
from .plan import plan_quantize
from .rows import add_experts, build_report
from .sinks import Sinks
from .source import TensorSource

_FP8_MODULES = (Fp8Linear, Fp8Experts, Fp8Embedding)


def _own_tensors(model: nn.Module, where: str) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of `model` outside its FP8 modules (those are never quantized again), by name."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, _FP8_MODULES):
            continue
        for leaf, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.is_meta:
                raise ValueError(f"{where}: {mod_name or type(model).__name__} is on the meta device; load "
                                 "checkpoints with fp8now.load")
            out.append((f"{mod_name}.{leaf}" if mod_name else leaf, p.detach()))
    return out


def _not_in_model(key: str) -> None:
    raise RuntimeError(f"quantize_: {key!r} is a parameter of the model but has no place in its plan; this is a "
                       "bug in fp8now: please report it with the model's class")


def quantize_(model: nn.Module, config: Fp8Config | None = None, *,
              measure_error: bool = True) -> LoadReport:
    """Swap the block linears of an already materialized model for `Fp8Linear`s, in place; with
    `config.head` / `config.embedding` also the output head (an Fp8Linear) and the input embedding (an
    Fp8Embedding; tied word embeddings: reading the FP8 head's tensors).

    Idempotent: an existing `Fp8Linear` is skipped (listed as already FP8), never re-quantized.
    Raises when the model has nothing to quantize and nothing already quantized.
    """
    start = time.perf_counter()
    config = config or Fp8Config()
    if config.keep_bf16 is not None:
        raise ValueError(f"quantize_: keep_bf16={config.keep_bf16!r} needs the checkpoint folder (the sensitivity pass "
                         "generates text with its tokenizer and caches by its files' hash): use fp8now.load(folder, "
                         "config), or pass the layers as Fp8Config(ignore=...) (fp8now.sensitivity.keep.chosen_layers)")
    where = f"quantize_({type(model).__name__})"
    tensors = _own_tensors(model, where)
    dtype = next((t.dtype for _, t in tensors if t.is_floating_point()), torch.bfloat16)
    plan = plan_quantize(model, config, where, dtype)
    sinks = Sinks(plan, None, None, measure_error, plain="keep")
    try:
        stream_tensors(plan, TensorSource(tensors, where), sinks, _not_in_model)
        sinks.close()
    except BaseException:   # all or nothing: the model keeps every module it had
        for name, module in plan.replaced.items():
            set_submodule(model, name, module)
        raise
    del tensors
    tie_embeddings(model)
    share_inputs(model)
    install_guard(model)   # reload_weights is atomic for this model's forwards (layers.guard)
    layers = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts)) and m.is_loaded]
    device = next((p.device for m in layers for p in m.parameters()), torch.device("cpu"))
    report = build_report(model, sinks.rows, plan.ignored, type(model).__name__, device, dtype, plan.scheme,
                          plan.weight_numerics)
    report.cpu_quantizer = install_cpu_quantizer(model, dtype)
    add_experts(report, model, plan.experts.rows)
    report.notices = sinks.absurd
    report.load_s = time.perf_counter() - start
    return report
