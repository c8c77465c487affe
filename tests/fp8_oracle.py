"""Independent references for the tests: straightforward per-group loops and a table-driven FP8 rounding.

Nothing here imports fp8now: the rules are written again from SPEC §4 so that a slip in
`fp8now.numerics` cannot hide behind the same slip in its oracle.
"""

from __future__ import annotations

import math

import torch

FMAX = 448.0
ROW_FLOOR = 1.0 / (448.0 * 512.0)


def fp8_values() -> torch.Tensor:
    """All finite non-negative e4m3fn values, ascending, in float64, built from the bit layout."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:  # the NaN pattern
                continue
            if e == 0:
                vals.append(m / 8 * 2.0 ** -6)
            else:
                vals.append((1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(sorted(set(vals)), dtype=torch.float64)


_TABLE = fp8_values()


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values (already clamped to ±448) to the nearest e4m3fn value, ties to even."""
    mag = x.abs().double().flatten()
    idx = torch.searchsorted(_TABLE, mag).clamp(1, len(_TABLE) - 1)
    lo, hi = _TABLE[idx - 1], _TABLE[idx]
    exact = mag == hi
    pick_hi = (mag - lo > hi - mag) | exact
    tie = (mag - lo == hi - mag) & ~exact
    # ties: choose the one with even mantissa (even index in the ascending table == even code)
    pick_hi = torch.where(tie, (idx % 2) == 0, pick_hi)
    out = torch.where(pick_hi, hi, lo)
    out = torch.where(mag == 0, torch.zeros_like(out), out)
    return (out * torch.sign(x.double().flatten())).reshape(x.shape)


def group_scale(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Scale of one group from its float32 amax (0-d), per SPEC §4."""
    a = amax.float()
    f = torch.tensor(FMAX, dtype=torch.float32)
    if rule == "tensor":
        return torch.tensor(ROW_FLOOR, dtype=torch.float32) if float(a) == 0 else a / f
    if rule == "row":
        return torch.maximum(a / f, torch.tensor(ROW_FLOOR, dtype=torch.float32))
    if rule == "block":
        return torch.maximum(a, torch.tensor(1e-4, dtype=torch.float32)) / f
    if rule == "group":
        return torch.maximum(a, torch.tensor(1e-10, dtype=torch.float32)) / f
    raise ValueError(rule)


def quantize_loops(x: torch.Tensor, gr: int, gc: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor group by group (gr/gc of -1 span the dim); q as float64 values."""
    rows, cols = x.shape
    gr = rows if gr == -1 else gr
    gc = cols if gc == -1 else gc
    x32 = x.float()
    q = torch.empty(rows, cols, dtype=torch.float64)
    scales = torch.empty(math.ceil(rows / gr), math.ceil(cols / gc), dtype=torch.float32)
    reciprocal = rule in ("tensor", "block")
    for bi, i in enumerate(range(0, rows, gr)):
        for bj, j in enumerate(range(0, cols, gc)):
            g = x32[i:i + gr, j:j + gc]
            s = group_scale(g.abs().max(), rule)
            scaled = g * (torch.tensor(1.0, dtype=torch.float32) / s) if reciprocal else g / s
            q[i:i + gr, j:j + gc] = round_fp8(scaled.clamp(-FMAX, FMAX).double())
            scales[bi, bj] = s
    return q, scales


def exact_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                  x_group: tuple[int, int], w_group: tuple[int, int]) -> torch.Tensor:
    """float64 (dequant x) @ (dequant w).T with the scales spread elementwise."""
    def spread(q, s, g):
        r, c = q.shape
        gr = r if g[0] == -1 else g[0]
        gc = c if g[1] == -1 else g[1]
        s = s.double().reshape(math.ceil(r / gr), math.ceil(c / gc))
        return q.double() * s.repeat_interleave(gr, 0)[:r].repeat_interleave(gc, 1)[:, :c]
    return spread(xq, xs, x_group) @ spread(wq, ws, w_group).T


def varied(shape, dtype=torch.bfloat16, seed=0, spread=6) -> torch.Tensor:
    """Random data whose magnitude varies by random powers of two across rows and 128-column tiles."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2], shape[-1]
    x = torch.randn(*shape, generator=g, dtype=torch.float32)
    row_mag = 2.0 ** torch.randint(-spread, spread + 1, (rows, 1), generator=g).float()
    tile_mag = 2.0 ** torch.randint(-spread, spread + 1, (1, math.ceil(cols / 128)), generator=g).float()
    tile_mag = tile_mag.repeat_interleave(128, dim=1)[:, :cols]
    return (x * row_mag * tile_mag).to(dtype)
