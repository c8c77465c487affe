"""How the sensitivity pass runs its forwards: from a layer's block on, and the variants of one block in one batch.

Swapping layers of block i changes nothing before block i, so a measurement runs blocks i..end only: the
earlier blocks replay what a recorded forward gave (replay.py). The k variants of one block (each
of its layers swapped in turn) go further: block i runs k times on its recorded input, and the blocks after
it run once on the k outputs stacked into one batch of k x B rows, so every later kernel is k times larger
and k times fewer. `Pass.check` verifies both shortcuts on the model at hand before the pass relies on them;
either one it cannot verify is turned off, and the record says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..hf.modules import set_submodule
from .kl import Reference
from .replay import Replay, block_of
from .text import Sample

# Batched and one-by-one runs of a block's variants may round differently (larger GEMMs): the batch is used
# when its logits are within this KL (nats per token) of the unbatched ones, far below any layer's effect.
BATCH_TOLERANCE = 1e-6


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
    """A whole forward: its logits and, with replay, every block's output and (args, kwargs) input."""

    logits: torch.Tensor
    outputs: list = field(default_factory=list)
    inputs: list = field(default_factory=list)


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


def groups(units: list[Unit]) -> list[list[Unit]]:
    """Consecutive units of one block (one each where there are no blocks)."""
    out: list[list[Unit]] = []
    for unit in units:
        if out and unit.block is not None and out[-1][0].block == unit.block:
            out[-1].append(unit)
        else:
            out.append([unit])
    return out


class Pass:
    """The forwards of one pass over `sample`."""

    def __init__(self, model: nn.Module, sample: Sample, units: list[Unit]) -> None:
        self.model, self.sample, self.units = model, sample, units
        blocks = block_list(model, units)
        self.replay = None if blocks is None else Replay(blocks)
        self.batched = self.replay is not None
        self.notes = [] if blocks is not None else ["no replay: the layers are not all inside one list of blocks"]
        self._repeated: dict[int, Sample] = {}

    def full(self) -> Recording:
        """A whole forward of the model as it stands."""
        if self.replay is None:
            return Recording(logits(self.model, self.sample))
        with self.replay.record() as (outputs, inputs):
            out = logits(self.model, self.sample)
        return Recording(out, outputs, inputs)

    def measure(self, ref: Reference, group: list[Unit], variant: Callable[[Unit], nn.Module],
                restore: Callable[[Unit], nn.Module], rec: Recording) -> list[torch.Tensor]:
        """Per-token KL of the model with each unit of `group` in turn replaced by `variant(unit)` (then put
        back as `restore(unit)`), run from the group's block on: one tensor [tokens] per unit."""
        if self.batched and len(group) > 1:
            return self._batched(ref, group, variant, restore, rec)
        out = []
        for unit in group:
            set_submodule(self.model, unit.name, variant(unit))
            if self.replay is None or unit.block is None:
                out.append(ref.kl(logits(self.model, self.sample)))
            else:
                with self.replay.start_at(unit.block, rec.outputs):
                    out.append(ref.kl(logits(self.model, self.sample)))
            set_submodule(self.model, unit.name, restore(unit))
        return out

    def _batched(self, ref, group, variant, restore, rec) -> list[torch.Tensor]:
        i = group[0].block
        args, kwargs = rec.inputs[i]
        outs = []
        for unit in group:
            set_submodule(self.model, unit.name, variant(unit))
            outs.append(self.replay.blocks[i](*args, **kwargs))
            set_submodule(self.model, unit.name, restore(unit))
        stacked = [None] * i + [torch.cat(outs)]
        with self.replay.start_at(i + 1, stacked):
            big = logits(self.model, self.repeated(len(group)))
        return [ref.kl(part) for part in big.split(self.sample.ids.shape[0])]

    def repeated(self, k: int) -> Sample:
        """The sample's rows k times over (for a batch of k variants)."""
        if k not in self._repeated:
            s = self.sample
            self._repeated[k] = Sample(s.ids.repeat(k, 1), s.mask.repeat(k, 1), s.new_tokens)
        return self._repeated[k]

    def check(self, ref: Reference, rec: Recording) -> None:
        """Replay and batching on the middle block: replay must give the recorded logits bit for bit, a
        batch of the block's own modules each half the recorded logits within BATCH_TOLERANCE."""
        if self.replay is None:
            return
        mid = next(g for g in groups(self.units) if g[0].block >= self.units[-1].block // 2)
        with self.replay.start_at(mid[0].block, rec.outputs):
            same = torch.equal(logits(self.model, self.sample), rec.logits)
        if not same:
            self.replay, self.batched = None, False
            self.notes.append("no replay: a replayed forward did not reproduce the full forward's logits")
            return
        own = {u.name: self.model.get_submodule(u.name) for u in mid}
        if not isinstance(rec.outputs[mid[0].block], torch.Tensor):
            self.batched = False
            self.notes.append("no batching: a block returns more than one tensor")
            return
        kls = self._batched(ref, mid[:2], lambda u: own[u.name], lambda u: own[u.name], rec)
        base = ref.kl(rec.logits)
        worst = max(float((kl - base).abs().max()) for kl in kls)
        if worst > BATCH_TOLERANCE:
            self.batched = False
            self.notes.append(f"no batching: a batched forward moved the KL by {worst:.1e} nats/token")
