"""The part of a checkpoint tensor one tensor-parallel rank holds, and the rules a split must keep
(even parts; block-scheme tiles never cut), shared by dense layers (tp.py) and experts (tp_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


BLOCK = 128  # block-scheme tile: slices must start on multiples of it (SPEC §6)


@dataclass(frozen=True)
class Slice:
    """This rank's part of one checkpoint tensor: `ranges` along `dim`, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (a view when it is one range)."""
        parts = [t.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def index(self, a: int, b: int) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(a, b),)


def split_ranges(n: int, size: int, rank: int, parts: int, what: str) -> tuple[tuple[int, int], ...]:
    """Even split of each of `parts` stacked parts of a dim of length n."""
    if n % (parts * size):
        raise ValueError(f"{what}: dim of {n} does not split evenly over {size} tensor-parallel ranks"
                         + (f" in {parts} packed parts" if parts > 1 else "")
                         + "; use a TP size that divides it, or leave the module out of tp_plan")
    part, step = n // parts, n // (parts * size)
    return tuple((p * part + rank * step, p * part + (rank + 1) * step) for p in range(parts))


def check_block(name: str, sl: Slice) -> None:
    """Block scales stay local only if every slice starts on a tile and spans whole tiles (or ends the dim)."""
    full = sl.full_shape[sl.dim]
    for a, b in sl.ranges:
        if a % BLOCK or ((b - a) % BLOCK and b != full):
            what = "rows" if sl.dim == 0 else "columns"
            raise ValueError(f"{name}: block scheme under tensor parallelism needs each rank's {what} to start "
                             f"on a multiple of {BLOCK}, but this rank holds {what} {a}:{b} of {full}; choose a "
                             "TP size that keeps 128-aligned shards, the channel or tensor scheme, or ignore "
                             "the layer")
