"""Report rows and reports of quantized models, and `quantize_` for a model already in memory."""

from __future__ import annotations

import time

import torch
from torch import nn

from .config import Fp8Config
from .cpu_quantizer import install as install_cpu_quantizer
from .embedding import Fp8Embedding
from .hf import set_submodule, target_linears
from .hf_head import check_options, embedding_row, is_tied, quantize_embedding_, tie_embeddings
from .hf_moe import add_experts, is_experts, quantize_experts_
from .linear import Fp8Linear
from .moe import Fp8Experts
from .report import LayerRow, LoadReport, peak_host_rss_bytes, plan_names, tensor_bytes
from .weight_error import weight_error
from .shared_input import share_inputs


def layer_row(layer: Fp8Linear, w: torch.Tensor | None) -> LayerRow:
    """The report row of a quantized layer; with its float weight `w`, its error figures too."""
    figures = (None,) * 4 if w is None else weight_error(w, layer.weight, layer.weight_scale, layer.scheme)
    return LayerRow(layer.name, layer.scheme.value, layer.backend or "?", layer.out_features,
                    layer.in_features, layer.bias is not None, *figures[:2], plan=plan_names(layer),
                    zero_flushed=figures[2], worst_group_flushed=figures[3])


def build_report(model: nn.Module, rows: list[LayerRow], ignored: list[tuple[str, str]], source: str,
            device: torch.device, dtype: torch.dtype, config: Fp8Config) -> LoadReport:
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8Embedding))}
    order = {name: i for i, name in enumerate(layers)}
    by_name = {row.name: row for row in rows}
    rows = rows + [embedding_row(m, None, by_name[m.tied_to]) for m in layers.values()   # tied: the head's row
                   if isinstance(m, Fp8Embedding) and m.tied_to in by_name and m.name not in by_name]
    rows = sorted(rows, key=lambda row: order[row.name])
    report = LoadReport(source=source, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        scheme=config.scheme.value, layers=rows, ignored=ignored)
    for row in rows:
        layer = layers[row.name]
        if row.plan and isinstance(layer, Fp8Linear):   # again: a producer in front (share_inputs) shows
            row.plan = plan_names(layer)
        if isinstance(layer, Fp8Embedding) and layer.tied_to is not None:
            continue   # the head's bytes, counted with the head
        report.bf16_bytes += 2 * layer.weight.numel()
        report.fp8_bytes += layer.weight.numel() * layer.weight.element_size() + layer.weight_scale.nbytes
    report.model_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
    report.work_bytes = sum(w.nbytes for m in layers.values() if (w := getattr(m, "_work", None)) is not None) + sum(
        t.nbytes for m in model.modules() if isinstance(m, Fp8Experts) for t in (m.w13_work, m.w2_work) if t is not None)
    report.peak_host_rss_bytes = peak_host_rss_bytes()
    return report


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
    head, emb = check_options(model, config, f"quantize_({type(model).__name__})")
    tied = is_tied(model, head, emb)
    targets, ignored = target_linears(model, config)
    if not targets and not any(isinstance(m, (Fp8Linear, Fp8Experts)) or is_experts(m) for m in model.modules()):
        raise ValueError(f"quantize_: nothing to quantize in {type(model).__name__}: all {len(ignored)} "
                         "linear layers are left alone; loosen Fp8Config.ignore")
    rows: list[LayerRow] = quantize_embedding_(model, emb, head, tied, measure_error) if emb else []
    device = torch.device("cpu")
    for name, linear in targets.items():
        for p in linear.parameters():
            if p.is_meta:
                raise ValueError(f"quantize_: {name} is on the meta device; load checkpoints with "
                                 "fp8now.load")
        w = linear.weight.detach()
        device = w.device
        layer = Fp8Linear.from_linear(linear, config, name=name)
        rows.append(layer_row(layer, w if measure_error else None))
        set_submodule(model, name, layer)
    dtype = next((p.dtype for m in model.modules() if not isinstance(m, (Fp8Linear, Fp8Embedding, Fp8Experts))
                  for p in m.parameters(recurse=False) if p.is_floating_point()), torch.bfloat16)
    tie_embeddings(model)
    expert_rows, expert_ignored = quantize_experts_(model, config, measure_error)
    share_inputs(model)
    report = build_report(model, rows, ignored + expert_ignored, type(model).__name__, device, dtype, config)
    report.cpu_quantizer = install_cpu_quantizer(model, dtype)
    add_experts(report, model, expert_rows)
    report.load_s = time.perf_counter() - start
    return report
