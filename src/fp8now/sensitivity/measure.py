"""The measurement of every quantizable layer (the core of the sensitivity pass).

For every quantizable layer (the dense linears and MoE experts modules `fp8now.load` would quantize):
`alone`, KL(bf16 || model) in nats per token on the bf16 model's own continuations of a few fixed openings
(text.py) with only this layer in FP8, its FP8 error magnified 8 times and the KL divided by 64 (kl.py says
why), with its standard error over the tokens; and `score` = alone per MiB of the layer's bf16 weight, the
KL that keeping it in bf16 is expected to save per byte kept, by which select.py ranks (the budget is bytes).
Why not also "all but this one in FP8": see kl.py.

Every target is quantized once (fp8now.quantize_: the bytes of a load); both versions of each layer stay in
memory and a measurement swaps one of them in. A measurement of a layer in block i runs blocks i..end only,
and only the logits of generated tokens are computed (passes.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Fp8Config
from ..hf.experts import FUSED_LEAVES, target_experts
from ..hf.modules import set_submodule, target_linears
from ..loading.quantize import quantize_
from .kl import MAGNIFY, Magnified, Reference, stats
from .passes import Pass, Unit
from .replay import block_of
from .text import Sample


def quantize_all(model: nn.Module, config: Fp8Config) -> tuple[list[Unit], dict]:
    """Quantize every target of `model` in place (all in FP8 afterwards), keeping each bf16 module beside
    its FP8 one; -> (units in model order, the LoadReport as a dict)."""
    linears, _ = target_linears(model, config)
    experts, _ = target_experts(model, config)
    report = quantize_(model, config, measure_error=False)
    blocks = {name: block_of(model, name) for name in [*linears, *experts]}
    lists = {b[0] for b in blocks.values() if b is not None}
    units = []
    for name, module in model.named_modules():
        if name in linears:
            units.append(Unit(name, "linear", linears[name], module, 2 * linears[name].weight.numel(), None))
        elif name in experts:
            size = sum(getattr(experts[name], leaf).numel() for leaf in FUSED_LEAVES)
            units.append(Unit(name, "experts", experts[name], module, 2 * size, None))
        else:
            continue
        if len(lists) == 1 and blocks[name] is not None:
            units[-1].block = blocks[name][1]
    return units, report.to_dict()


def put(model: nn.Module, units: list[Unit], fp8: bool) -> None:
    """Each unit's FP8 module (fp8=True) or bf16 module into the model."""
    for unit in units:
        set_submodule(model, unit.name, unit.fp8 if fp8 else unit.bf16)


@torch.inference_mode()
def measure(model: nn.Module, sample: Sample, units: list[Unit], progress: bool = False) -> dict:
    """The measurement of every unit; the model ends with every unit in bf16.

    Returns {"baseline": KL with all in FP8, "baseline_se", "layers": [{"name", "kind", "bytes", "alone",
    "alone_se", "score"}] in model order, "forwards": how they ran, "magnify": the single-layer error's
    magnification}. KL in nats per token, SE its standard error, score in nats per token per MiB."""
    from tqdm.auto import tqdm

    run = Pass(model, sample, units)
    put(model, units, fp8=True)
    fp8 = run.full()
    put(model, units, fp8=False)
    bf16 = run.full()
    ref = Reference(bf16.logits)
    baseline, baseline_se = stats(ref.kl(fp8.logits))
    run.check(bf16)
    rows = []
    for unit in tqdm(units, desc="fp8now sensitivity", unit="layer", disable=not progress, leave=False):
        alone, alone_se = stats(run.measure(ref, unit, Magnified(unit.bf16, unit.fp8), unit.bf16, bf16),
                                1.0 / MAGNIFY ** 2)
        rows.append({"name": unit.name, "kind": unit.kind, "bytes": unit.bytes, "alone": alone,
                     "alone_se": alone_se, "score": alone / (unit.bytes / 2**20)})
    how = "; ".join(run.notes) or "each from the swapped layer's block on (earlier blocks replayed)"
    return {"baseline": baseline, "baseline_se": baseline_se, "layers": rows, "forwards": how, "magnify": MAGNIFY}
