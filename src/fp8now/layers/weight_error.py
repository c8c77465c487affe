"""How far a quantized weight is from its float original: SQNR, rel_diff, and the nonzero weights that
quantized to zero (overall and in the worst scale group), for the load report."""

from __future__ import annotations

import math

import torch

from ..config import WEIGHT_GROUP, Scheme
from ..kernels import triton_weights
from ..numerics import dequantize

_STATS_CHUNK_BYTES = 4 << 20      # float64 bytes per chunk when measuring the weight error on a CPU
_DEVICE_CHUNK_BYTES = 256 << 20   # ... and on a GPU
# Same-size integer views and sign masks: `x & mask == 0` finds +0 and -0 of any float without a cast.
_INT_VIEW = {1: (torch.uint8, 0x7F), 2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}


def _is_zero(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of the zeros (either sign) of a float tensor, read from its bits."""
    if t.element_size() not in _INT_VIEW:
        return t == 0
    dtype, mask = _INT_VIEW[t.element_size()]
    return (t.view(dtype) & mask) == 0


def _group_counts(mask: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Count of True per scale group of the rows `mask` [r, K] covers (block rows start on a tile)."""
    match scheme:
        case Scheme.TENSOR:
            return torch.count_nonzero(mask).reshape(1)
        case Scheme.CHANNEL:
            return torch.count_nonzero(mask, dim=1)
    m = torch.nn.functional.pad(mask.to(torch.int32), (0, -mask.shape[1] % 128, 0, -mask.shape[0] % 128))
    return m.reshape(m.shape[0] // 128, 128, m.shape[1] // 128, 128).sum((1, 3)).flatten()


def _one_pass(w: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the Triton pass (kernels.triton_error) measures this weight: an FP8 GPU with Triton."""
    return w.stride(-1) == 1 and q.stride(-1) == 1 and triton_weights(w.device)


def error_stats(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme,
                chunk_bytes: int | None = None) -> torch.Tensor:
    """float64 [7] on w's device (stacked experts `[E, N, K]`: [E, 7]), no host sync: |a|², |b|², <a,b>,
    |a-b|², flushed, nonzero, worst group fraction of `dequantize(q, scale)` (b) against `w` (a) `[N, K]`.
    Sums in float64 (float32 squares overflow past 1.8e19). On an FP8 GPU one Triton pass reads w and q
    once (kernels.triton_error, no temporaries); elsewhere (or with `chunk_bytes`) torch ops in row chunks
    (~4 MiB on a CPU, where they stay in cache; 256 MiB on a GPU) so the temporaries stay bounded."""
    if w.dim() == 3:
        if chunk_bytes is None and _one_pass(w, q) and w.is_contiguous() and q.is_contiguous():
            from ..kernels import triton_error

            if triton_error.stacked(w.shape[1], scheme):   # all experts in one launch
                return triton_error.error_stats_stacked(w, q, scale, scheme)
        return torch.stack([error_stats(w[e], q[e], scale[e], scheme, chunk_bytes) for e in range(w.shape[0])])
    if chunk_bytes is None and _one_pass(w, q):
        from ..kernels import triton_error

        return triton_error.error_stats(w, q, scale, scheme)
    rows, cols = w.shape
    group = WEIGHT_GROUP[scheme]
    align = 128 if scheme is Scheme.BLOCK else 1
    chunk = chunk_bytes or (_STATS_CHUNK_BYTES if w.device.type == "cpu" else _DEVICE_CHUNK_BYTES)
    step = max(chunk // (8 * max(cols, 1)) // align * align, align)
    acc = torch.zeros(7, dtype=torch.float64, device=w.device)
    for r in range(0, rows, step):
        wc, qc = w[r:r + step], q[r:r + step]
        a = wc.double().reshape(-1)
        match scheme:
            case Scheme.TENSOR:
                b = qc.double() * scale.double().reshape(1, 1)
            case Scheme.CHANNEL:
                b = qc.double() * scale.double().reshape(-1, 1)[r:r + step]
            case Scheme.BLOCK:
                b = dequantize(qc, scale[r // 128:(r + step + 127) // 128], group).double()
        b = b.reshape(-1)
        acc[0] += a @ a
        acc[1] += b @ b
        acc[2] += a @ b
        b.sub_(a)
        acc[3] += b @ b
        nonzero = ~_is_zero(wc)
        f, n = _group_counts(nonzero & _is_zero(qc), scheme), _group_counts(nonzero, scheme)
        acc[4] += f.sum()
        acc[5] += n.sum()
        acc[6] = torch.maximum(acc[6], (f.double() / n.clamp(min=1)).max())
        del a, b, nonzero
    if scheme is Scheme.TENSOR:   # one group: the whole weight (not the largest chunk's fraction)
        acc[6] = acc[4] / acc[5].clamp(min=1)
    return acc


def error_figures(stats: list[float], scheme: Scheme) -> tuple[float, float, float, float]:
    """(SQNR dB, rel_diff, zero_flushed, worst_group_flushed) from `error_stats`' seven sums."""
    aa, bb, ab, noise, n_flushed, n_nonzero, worst = stats
    frac = n_flushed / n_nonzero if n_nonzero else 0.0
    worst = frac if scheme is Scheme.TENSOR else worst
    rel = 0.0 if aa + bb == 0 else 1.0 - 2.0 * ab / (aa + bb)
    if noise == 0.0:
        return math.inf, rel, frac, worst
    return (10.0 * math.log10(aa / noise) if aa > 0 else -math.inf), rel, frac, worst


def weight_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme
                 ) -> tuple[float, float, float, float]:
    """(SQNR dB, rel_diff, zero_flushed, worst_group_flushed) of `dequantize(q, scale)` against `w`
    `[N, K]`; one host sync (a load defers these: `error_stats` now, the figures at its end)."""
    return error_figures(error_stats(w, q, scale, scheme).tolist(), scheme)
