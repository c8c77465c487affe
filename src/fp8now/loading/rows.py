"""The report rows of quantized layers and the load report built from them (`report.LoadReport`)."""

from __future__ import annotations

import statistics

import torch
from torch import nn

from ..config import Fp8Config
from ..layers.embedding import Fp8Embedding
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..layers.weight_error import weight_error
from ..report import ExpertsRow, LayerRow, LoadReport, peak_host_rss_bytes, plan_names, tensor_bytes


def layer_row(layer: Fp8Linear, w: torch.Tensor | None) -> LayerRow:
    """The report row of a quantized layer; with its float weight `w`, its error figures too."""
    figures = (None,) * 4 if w is None else weight_error(w, layer.weight, layer.weight_scale, layer.scheme)
    return LayerRow(layer.name, layer.scheme.value, layer.backend or "?", layer.out_features,
                    layer.in_features, layer.bias is not None, *figures[:2], plan=plan_names(layer),
                    zero_flushed=figures[2], worst_group_flushed=figures[3])


def embedding_row(layer: Fp8Embedding, w: torch.Tensor | None, head_row: LayerRow | None = None) -> LayerRow:
    """The report row of an Fp8Embedding: its weight error against the float table `w`, or, tied, its
    head's figures (the same bytes)."""
    if head_row is not None:
        figures = (head_row.sqnr_db, head_row.rel_diff, head_row.zero_flushed, head_row.worst_group_flushed)
    elif w is not None:
        figures = weight_error(w, layer.weight, layer.weight_scale, layer.scheme)
    else:
        figures = (None,) * 4
    backend = "lookup (tied)" if layer.tied_to else "lookup"   # tied: reads the head's FP8 weight
    return LayerRow(layer.name, layer.scheme.value, backend, layer.num_embeddings, layer.embedding_dim, False,
                    *figures[:2], plan={}, zero_flushed=figures[2], worst_group_flushed=figures[3])


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
                      statistics.median(per_expert) if per_expert else None, layer.act_kind)


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
        if isinstance(layer, Fp8Embedding) and layer.tied_to is not None:
            continue   # the head's bytes, counted with the head
        report.bf16_bytes += 2 * layer.weight.numel()
        report.fp8_bytes += layer.weight.numel() * layer.weight.element_size() + layer.weight_scale.nbytes
    report.model_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
    report.work_bytes = sum(w.nbytes for m in layers.values() if (w := getattr(m, "_work", None)) is not None) + sum(
        t.nbytes for m in model.modules() if isinstance(m, Fp8Experts) for t in (m.w13_work, m.w2_work) if t is not None)
    report.peak_host_rss_bytes = peak_host_rss_bytes()
    return report


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
