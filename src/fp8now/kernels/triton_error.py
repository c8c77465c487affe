"""The load report's weight-error sums in one Triton pass over a weight and its FP8 bytes (no temporaries).

`error_stats(w, q, scale, scheme)` returns the seven float64 sums of `layers.weight_error.error_stats` for
`w [N, K]` (bf16, fp16 or float32) against `dequantize(q, scale)`: |a|², |b|², <a,b>, |a-b|², the nonzero
weights that quantized to zero, the nonzero weights, and the largest fraction of such flushed weights in one
scale group (a row for channel, a 128x128 tile for block; for tensor the whole weight). Each program reads
its rows (and, for block, a range of 128x128 tiles) once, sums in float64 and writes one row of partial sums;
torch adds the rows. The dequantized value is the reference's: q x scale in float64 for tensor and channel
(exact), in float32 for block (`numerics.dequantize`). Zeros of either sign count as zero.
"""

import torch

from ..config import Scheme
from .triton_quant import pow2
from .triton_support import tl, triton

_TENSOR, _CHANNEL, _BLOCK = 0, 1, 2
TILE = 128
ROWS = 8                  # rows per program (tensor, channel)
TILES_PER_PROGRAM = 8     # 128x128 tiles per program along K (block)


@triton.jit
def _error_kernel(w_ptr, q_ptr, s_ptr, out_ptr, N, K, stride_w, stride_q, stride_s,
                  SCHEME: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    if SCHEME == 1:
        s_row = tl.load(s_ptr + rows64 * stride_s, mask=row_ok, other=0.0).to(tl.float64)
    if SCHEME == 0:
        s_all = tl.load(s_ptr).to(tl.float64)
    aa = tl.zeros([BLOCK_N], dtype=tl.float64)
    bb = tl.zeros([BLOCK_N], dtype=tl.float64)
    ab = tl.zeros([BLOCK_N], dtype=tl.float64)
    dd = tl.zeros([BLOCK_N], dtype=tl.float64)
    flushed = tl.zeros([BLOCK_N], dtype=tl.int32)
    nonzero = tl.zeros([BLOCK_N], dtype=tl.int32)
    worst = tl.zeros([1], dtype=tl.float64)
    for step in range(K_STEPS):
        k0 = (pid_k * K_STEPS + step) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0)
        qf = tl.load(q_ptr + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCHEME == 2:
            s = tl.load(s_ptr + pid_n * stride_s + k0 // BLOCK_K, mask=k0 < K, other=0.0)
            b = (qf * s).to(tl.float64)
        elif SCHEME == 1:
            b = qf.to(tl.float64) * s_row[:, None]
        else:
            b = qf.to(tl.float64) * s_all
        wf = w.to(tl.float32)
        a = wf.to(tl.float64)
        d = b - a
        aa += tl.sum(a * a, axis=1)
        bb += tl.sum(b * b, axis=1)
        ab += tl.sum(a * b, axis=1)
        dd += tl.sum(d * d, axis=1)
        nz = (wf != 0.0) & mask
        fl = nz & (qf == 0.0)
        f_rows = tl.sum(fl.to(tl.int32), axis=1)
        n_rows = tl.sum(nz.to(tl.int32), axis=1)
        flushed += f_rows
        nonzero += n_rows
        if SCHEME == 2:   # this step is one 128x128 tile
            f_tile = tl.sum(f_rows, axis=0).to(tl.float64)
            n_tile = tl.maximum(tl.sum(n_rows, axis=0), 1).to(tl.float64)
            worst = tl.maximum(worst, f_tile / n_tile)
    if SCHEME != 2:   # channel: per row; tensor: replaced by the whole weight's fraction afterwards
        worst = tl.maximum(worst, tl.max(flushed.to(tl.float64) / tl.maximum(nonzero, 1).to(tl.float64), axis=0))
    out = out_ptr + (pid_n * tl.num_programs(1) + pid_k) * 7
    tl.store(out + 0, tl.sum(aa, axis=0))
    tl.store(out + 1, tl.sum(bb, axis=0))
    tl.store(out + 2, tl.sum(ab, axis=0))
    tl.store(out + 3, tl.sum(dd, axis=0))
    tl.store(out + 4, tl.sum(flushed, axis=0).to(tl.float64))
    tl.store(out + 5, tl.sum(nonzero, axis=0).to(tl.float64))
    tl.store(out + 6 + tl.arange(0, 1), worst)


def _partials(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, kind: int) -> torch.Tensor:
    """float64 `[programs, 7]`: each program's partial sums, in row-major program order."""
    n, k = w.shape
    if kind == _BLOCK:
        block_n, block_k = TILE, TILE
        k_tiles = triton.cdiv(k, TILE)
        grid = (triton.cdiv(n, TILE), triton.cdiv(k_tiles, TILES_PER_PROGRAM))
        steps = min(TILES_PER_PROGRAM, k_tiles)
    else:
        block_n, block_k = ROWS, min(pow2(k), 512)
        grid = (triton.cdiv(n, ROWS), 1)
        steps = triton.cdiv(k, block_k)
    out = torch.zeros(grid[0] * grid[1], 7, dtype=torch.float64, device=w.device)
    _error_kernel[grid](w, q, s, out, n, k, w.stride(0), q.stride(0), s.stride(0),
                        SCHEME=kind, BLOCK_N=block_n, BLOCK_K=block_k, K_STEPS=steps, num_warps=4)
    return out


def _check(w: torch.Tensor, q: torch.Tensor) -> None:
    if w.stride(-1) != 1 or q.stride(-1) != 1 or q.shape != w.shape:
        raise ValueError(f"error_stats expects w and q of one shape with unit column stride, got "
                         f"{tuple(w.shape)} {tuple(w.stride())} and {tuple(q.shape)} {tuple(q.stride())}")


def error_stats(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """float64 [7] on w's device, no host sync (see the module docstring); `w`, `q` `[N, K]` with unit column
    stride, `scale` of the scheme's shape (SPEC §3)."""
    _check(w, q)
    n, k = w.shape
    if n == 0 or k == 0:
        return torch.zeros(7, dtype=torch.float64, device=w.device)
    s = scale.reshape(-1, scale.shape[-1] if scale.dim() == 2 else 1) if scheme is not Scheme.TENSOR \
        else scale.reshape(1)
    kind = {Scheme.TENSOR: _TENSOR, Scheme.CHANNEL: _CHANNEL, Scheme.BLOCK: _BLOCK}[scheme]
    out = _partials(w, q, s, kind)
    stats = torch.cat([out[:, :6].sum(0), out[:, 6].amax().reshape(1)])
    if scheme is Scheme.TENSOR:
        stats[6] = stats[4] / stats[5].clamp(min=1)
    return stats


def stacked(n: int, scheme: Scheme) -> bool:
    """Can `error_stats_stacked` take experts of `n` rows (no program's rows or tile cross two experts)?"""
    return n > 0 and n % (TILE if scheme is Scheme.BLOCK else ROWS) == 0


def error_stats_stacked(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """float64 `[E, 7]`: `error_stats` of each expert of `w`, `q` `[E, N, K]` (contiguous rows, `stacked(N)`),
    `scale` `[E, ...]`, in one launch for all experts. Tensor scales go in as a per-row scale (the same
    dequantized values); its worst-group fraction is then the expert's own flushed / nonzero."""
    _check(w, q)
    e, n, k = w.shape
    if not stacked(n, scheme):
        raise ValueError(f"error_stats_stacked: {n} rows per expert do not fill whole programs for {scheme.value}")
    if k == 0:
        return torch.zeros(e, 7, dtype=torch.float64, device=w.device)
    w2, q2 = w.reshape(e * n, k), q.reshape(e * n, k)
    if scheme is Scheme.BLOCK:
        s, kind = scale.reshape(e * (n // TILE), -1), _BLOCK
    elif scheme is Scheme.CHANNEL:
        s, kind = scale.reshape(e * n, 1), _CHANNEL
    else:
        s, kind = scale.reshape(e, 1).expand(e, n).reshape(e * n, 1), _CHANNEL
    out = _partials(w2, q2, s, kind).view(e, -1, 7)
    stats = torch.cat([out[:, :, :6].sum(1), out[:, :, 6].amax(1, keepdim=True)], dim=1)
    if scheme is Scheme.TENSOR:
        stats[:, 6] = stats[:, 4] / stats[:, 5].clamp(min=1)
    return stats
