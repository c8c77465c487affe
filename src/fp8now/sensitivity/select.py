"""Which layers `Fp8Config(keep_bf16="auto:F")` keeps in bf16, from the sensitivity scores: pure functions.

A layer row (measure.py) is a dict with at least "name", "bytes" (its weight at 2 bytes per element)
and "score" (the KL to bf16 that keeping it in bf16 is expected to save, per MiB kept), in model order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..hf.modules import match_ignore


def ranked(layers: list[dict]) -> list[dict]:
    """The rows most sensitive first, each with its 1-based "rank": by score, highest first; equal scores
    put the smaller layer first (more of them fit a budget), then model order. A NaN score ranks last."""
    order = sorted(range(len(layers)), key=lambda i: (_sort_score(layers[i]["score"]), layers[i]["bytes"], i))
    return [{**layers[i], "rank": r} for r, i in enumerate(order, 1)]


def _sort_score(score: float) -> float:
    return math.inf if math.isnan(score) else -score


@dataclass
class Selection:
    """The layers kept in bf16 (rank order) and the budget they came from."""

    fraction: float
    total_bytes: int            # every scored (quantizable) layer's bytes
    budget_bytes: int           # floor(fraction * total_bytes)
    kept: list[dict] = field(default_factory=list)        # ranked rows, kept in bf16
    ignored: list[tuple[str, str]] = field(default_factory=list)   # (layer, the ignore pattern that wins)
    unkeepable: list[tuple[str, str]] = field(default_factory=list)   # (layer, why it cannot stay in bf16)

    @property
    def kept_bytes(self) -> int:
        return sum(row["bytes"] for row in self.kept)

    @property
    def names(self) -> list[str]:
        return [row["name"] for row in self.kept]


def select(layers: list[dict], fraction: float, ignore: tuple[str, ...] = (),
           unkeepable: dict[str, str] | None = None) -> Selection:
    """Walk the ranking and keep each layer that still fits the budget (a layer too large for what is left
    is passed over; smaller ones below it may still fit). Layers matching an `ignore` pattern stay in bf16
    anyway: they are not chosen and spend none of the budget. A layer whose score is not above zero is
    never kept: quantizing it did not raise the KL on the generated text. `unkeepable` {layer: why}: layers
    the load cannot leave in bf16, passed over (listed with the reason when they rank within the budget)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"the bf16 fraction must be in [0, 1), got {fraction}")
    total = sum(row["bytes"] for row in layers)
    out = Selection(fraction, total, math.floor(fraction * total))
    left = out.budget_bytes
    for row in ranked(layers):
        pattern = match_ignore(row["name"], ignore)
        if pattern is not None:
            out.ignored.append((row["name"], pattern))
        elif row["score"] > 0 and row["bytes"] <= left:
            if row["name"] in (unkeepable or {}):
                out.unkeepable.append((row["name"], unkeepable[row["name"]]))
                continue
            out.kept.append(row)
            left -= row["bytes"]
    return out
