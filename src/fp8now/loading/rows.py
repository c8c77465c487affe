"""The report rows of quantized layers and the load report built from them (`report.LoadReport`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from ..config import Scheme
from ..layers.embedding import Fp8Embedding
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..layers.moe_backends import expert_plan_names
from ..layers.weight_error import error_figures, error_stats
from ..report import ExpertsRow, LayerRow, LoadReport, peak_host_rss_bytes, plan_names, tensor_bytes


@dataclass
class Pending:
    """A row whose error figures wait for their sums on the device (`error_stats`): a load resolves them all at
    its end with one host sync, instead of one per layer."""

    row: LayerRow | ExpertsRow
    stats: torch.Tensor   # [7], or [E, 2, 7] for experts (w13, w2 of each expert)
    scheme: Scheme


def resolve(pending: list[Pending]) -> None:
    """Fill in the error figures of every pending row (one host sync per device)."""
    by_device: dict[torch.device, list[Pending]] = {}
    for p in pending:
        by_device.setdefault(p.stats.device, []).append(p)
    for group in by_device.values():
        values = torch.cat([p.stats.reshape(-1) for p in group]).tolist()
        at = 0
        for p in group:
            n = p.stats.numel()
            sums = [values[i:i + 7] for i in range(at, at + n, 7)]
            at += n
            figures = [error_figures(x, p.scheme) for x in sums]
            if isinstance(p.row, ExpertsRow):   # per expert, the SQNR of its worse matrix (w13 or w2)
                worst = [min(figures[2 * e][0], figures[2 * e + 1][0]) for e in range(len(figures) // 2)]
                p.row.min_sqnr_db, p.row.median_sqnr_db = min(worst), statistics.median(worst)
            else:
                row = p.row
                row.sqnr_db, row.rel_diff, row.zero_flushed, row.worst_group_flushed = figures[0]
    pending.clear()


def layer_row(layer: Fp8Linear, w: torch.Tensor | None, pending: list[Pending],
              stats: torch.Tensor | None = None) -> LayerRow:
    """The report row of a quantized layer; with its float weight `w`, its error figures too (pending): from
    `stats` when its quantizer measured them (`error_stats`' sums), else measured here."""
    row = LayerRow(layer.name, layer.scheme.value, layer.backend or "?", layer.out_features, layer.in_features,
                   layer.bias is not None, None, None, plan=plan_names(layer))
    if w is not None:
        if stats is None:
            stats = error_stats(w, layer.weight, layer.weight_scale, layer.scheme)
        pending.append(Pending(row, stats, layer.scheme))
    return row


def embedding_row(layer: Fp8Embedding, w: torch.Tensor | None, pending: list[Pending] | None = None,
                  head_row: LayerRow | None = None) -> LayerRow:
    """The report row of an Fp8Embedding: its weight error against the float table `w` (pending), or, tied,
    its head's figures (the same bytes)."""
    backend = "lookup (tied)" if layer.tied_to else "lookup"   # tied: reads the head's FP8 weight
    row = LayerRow(layer.name, layer.scheme.value, backend, layer.num_embeddings, layer.embedding_dim, False,
                   None, None, plan={})
    if head_row is not None:
        row.sqnr_db, row.rel_diff = head_row.sqnr_db, head_row.rel_diff
        row.zero_flushed, row.worst_group_flushed = head_row.zero_flushed, head_row.worst_group_flushed
    elif w is not None:
        pending.append(Pending(row, error_stats(w, layer.weight, layer.weight_scale, layer.scheme), layer.scheme))
    return row


def experts_row(layer: Fp8Experts, w13: torch.Tensor, w2: torch.Tensor, pending: list[Pending] | None,
                stats: torch.Tensor | None = None) -> ExpertsRow:
    """The report row of a loaded experts layer; with `pending`, per expert the SQNR of its worse matrix (w13 or
    w2), the minimum and the median over the experts (pending): from `stats` `[E, 2, 7]` when the quantizer
    measured them, else measured here."""
    row = ExpertsRow(layer.name, layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.scheme.value,
                     layer.backend or "?", layer.w13_bias is not None, None, None, layer.act_kind,
                     expert_plan_names(layer))
    if pending is not None:
        if stats is None:
            p13, p2 = layer.padded(w13.to(layer.w13.device), w2.to(layer.w2.device))
            stats = torch.stack([error_stats(p13, layer.w13, layer.w13_scale, layer.scheme),
                                 error_stats(p2, layer.w2, layer.w2_scale, layer.scheme)], dim=1)   # [E, 2, 7]
        pending.append(Pending(row, stats, layer.scheme))
    return row


def build_report(model: nn.Module, rows: list[LayerRow], ignored: list[tuple[str, str]], source: str,
                 device: torch.device, dtype: torch.dtype, scheme: str, weight_numerics: str = "spec") -> LoadReport:
    """The report of a load: its rows in model order (a tied FP8 embedding shows its head's figures), the
    bytes of the FP8 layers and of the whole model, the backends' working copies, the host's peak."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8Embedding))}
    order = {name: i for i, name in enumerate(layers)}
    by_name = {row.name: row for row in rows}
    rows = rows + [embedding_row(m, None, head_row=by_name[m.tied_to]) for m in layers.values()   # tied: the head's row
                   if isinstance(m, Fp8Embedding) and m.tied_to in by_name and m.name not in by_name]
    rows = sorted(rows, key=lambda row: order[row.name])
    report = LoadReport(source=source, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        scheme=scheme, layers=rows, ignored=ignored, weight_numerics=weight_numerics)
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
