"""How the sensitivity pass runs its forwards: each one from the swapped layer's block on.

Swapping layers of block i changes nothing before block i, so a measurement runs blocks i..end only: the
earlier blocks replay what a recorded forward gave (replay.py). `Pass.check` verifies that on the model at
hand (a replayed forward must give the recorded logits bit for bit) before the pass relies on it, and turns
replay off, saying why, where it cannot.

Running a block's variants in one batch (block i k times, the later blocks once on the k outputs stacked) was
tried and dropped: on the embedded SmolLM2 the CPU's bf16 kernels round differently at k times the rows, and
that alone moved the per-token KL of an unchanged model by up to 8e-3 nats (bf16) and 0.1 (FP8), far above
the effects measured; the check then turned batching off and the pass paid for the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..hf.modules import set_submodule
from .kl import Reference
from .replay import Replay, block_of
from .text import Sample

@dataclass
class Unit:
    """One quantizable layer: its bf16 module, its FP8 module, its weight bytes at 2 per element, its block."""

    name: str
    kind: str              # "linear" | "experts"
    bf16: nn.Module
    fp8: nn.Module
    bytes: int
    block: int | None


@dataclass
class Recording:
    """A whole forward: its logits and, with replay, every block's output."""

    logits: torch.Tensor
    outputs: list = field(default_factory=list)


def logits(model: nn.Module, sample: Sample) -> torch.Tensor:
    """The next-token logits that predict the generated tokens: [B, N, V] in the model dtype."""
    out = model(input_ids=sample.ids, attention_mask=sample.mask, position_ids=sample.positions,
                use_cache=False, logits_to_keep=sample.new_tokens + 1)
    return out.logits[:, :-1]


def block_list(model: nn.Module, units: list[Unit]) -> nn.ModuleList | None:
    """The one ModuleList that holds every unit's block, or None (then no replay)."""
    if not units or any(u.block is None for u in units):
        return None
    found = block_of(model, units[0].name)
    return model.get_submodule(found[0]) if found is not None else None


class Pass:
    """The forwards of one pass over `sample`."""

    def __init__(self, model: nn.Module, sample: Sample, units: list[Unit]) -> None:
        self.model, self.sample, self.units = model, sample, units
        blocks = block_list(model, units)
        self.replay = None if blocks is None else Replay(blocks)
        self.notes = [] if blocks is not None else ["no replay: the layers are not all inside one list of blocks"]

    def full(self) -> Recording:
        """A whole forward of the model as it stands."""
        if self.replay is None:
            return Recording(logits(self.model, self.sample))
        with self.replay.record() as outputs:
            out = logits(self.model, self.sample)
        return Recording(out, outputs)

    def measure(self, ref: Reference, unit: Unit, variant: nn.Module, restore: nn.Module,
                rec: Recording) -> torch.Tensor:
        """Per-token KL `[tokens]` of the model with `unit` replaced by `variant` (then put back as `restore`),
        run from the unit's block on (the earlier blocks' outputs from `rec`) where replay is on."""
        set_submodule(self.model, unit.name, variant)
        try:
            if self.replay is None or unit.block is None:
                return ref.kl(logits(self.model, self.sample))
            with self.replay.start_at(unit.block, rec.outputs):
                return ref.kl(logits(self.model, self.sample))
        finally:
            set_submodule(self.model, unit.name, restore)

    def check(self, rec: Recording) -> None:
        """Replay from the middle block must give the recorded logits bit for bit; else replay is turned off."""
        if self.replay is None:
            return
        mid = next(u for u in self.units if u.block >= self.units[-1].block // 2)
        with self.replay.start_at(mid.block, rec.outputs):
            same = torch.equal(logits(self.model, self.sample), rec.logits)
        if not same:
            self.replay = None
            self.notes.append("no replay: a replayed forward did not reproduce the full forward's logits")
