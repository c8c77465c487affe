"""The weight quantizer of a CPU load: `numerics.quantize_weight`'s bytes and scales and the cpu backend's bf16
working copy `bf16(q * s)`, in one pass over row chunks small enough to stay in cache.

Per chunk: the float32 values once, each group's amax (NaN or Inf make it non-finite: that is the finiteness
check, no pass of its own), the SPEC's float32 division (or reciprocal product), the rounding to the e4m3 grid
by `cpu.round_e4m3_` (exact, vectorised; a clamp is not needed after a scale from the amax, see there), the FP8
bytes by an exact cast of those values, and the working copy from the same float32 values times the scale,
rounded once to bf16. The widening of FP8 bytes back to float on a CPU is a scalar loop, which this never runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import Scheme
from ..numerics import E4M3FN, WEIGHT_RULE, nonfinite_error, scale_from_amax
from .cpu import WORK_DTYPE, round_e4m3_

_SIGN = -0x80000000          # float32 sign bit, as an int32
CHUNK_ELEMENTS = 1 << 17   # float32 elements per chunk (512 KiB: the temporaries stay in cache)


def _rows_per_chunk(rows: int, cols: int, align: int) -> int:
    per = max(CHUNK_ELEMENTS // max(cols, 1), 1)
    return min(max(per // align * align, align), rows + (-rows % align))


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """The float32 amax of a whole weight (exact in w's own dtype; NaN propagates): one `aminmax` pass, no
    |w| temporary."""
    if not w.numel():
        return torch.zeros(())
    lo, hi = torch.aminmax(w)
    return torch.maximum(-lo, hi).float()


def quantize_weight(w: torch.Tensor, scheme: Scheme, name: str | None = None, work: bool = True,
                    q_out: torch.Tensor | None = None, work_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`w [N, K]` (bf16/fp16/fp32 on the CPU) -> (FP8 bytes [N, K], float32 scales of `numerics.quantize_weight`'s
    shape, the bf16 working copy [N, K] or None), written into `q_out` / `work_out` when given. NaN/Inf raise
    naming `name` (the outputs may then hold the chunks before it: pass scratch, not live storage)."""
    rows, cols = w.shape
    rule = WEIGHT_RULE[scheme]
    align = 128 if scheme is Scheme.BLOCK else 1
    step = _rows_per_chunk(rows, cols, align)
    q = torch.empty((rows, cols), dtype=E4M3FN.dtype) if q_out is None else q_out
    out = work_out if work_out is not None else torch.empty((rows, cols), dtype=WORK_DTYPE) if work else None
    pad = -cols % 128 if scheme is Scheme.BLOCK else 0
    scales = []
    if scheme is Scheme.TENSOR:
        amax = tensor_amax(w)
        if not bool(torch.isfinite(amax)):
            raise nonfinite_error(tuple(w.shape), name)
        tensor_scale = scale_from_amax(amax, rule)
        inv = torch.ones_like(tensor_scale) / tensor_scale
    buf = torch.empty(step * (cols + pad), dtype=torch.float32)
    for r in range(0, rows, step):
        chunk = w[r:r + step]
        n = chunk.shape[0]
        y = buf[:n * (cols + pad)].view(n, cols + pad)
        if pad:
            y[:, cols:] = 0
        y[:, :cols].copy_(chunk)
        if scheme is Scheme.TENSOR:
            y.mul_(inv)
            s = tensor_scale
        elif scheme is Scheme.CHANNEL:
            s = scale_from_amax(y.abs().amax(dim=1, keepdim=True), rule)            # [n, 1]
            if not bool(torch.isfinite(s).all()):
                raise nonfinite_error(tuple(w.shape), name)
            y.div_(s)
            scales.append(s)
        else:
            tiles = F.pad(y, (0, 0, 0, -n % 128)) if n % 128 else y
            tr = tiles.shape[0] // 128
            t4 = tiles.view(tr, 128, (cols + pad) // 128, 128)
            s = scale_from_amax(t4.abs().amax(dim=(1, 3)), rule)                    # [n/128, K/128]
            if not bool(torch.isfinite(s).all()):
                raise nonfinite_error(tuple(w.shape), name)
            t4.mul_((torch.ones_like(s) / s)[:, None, :, None])
            if tiles is not y:
                y.copy_(tiles[:n])
            scales.append(s)
        sign = y.view(torch.int32) & _SIGN   # the rounding below turns a negative value that rounds to 0 into +0
        round_e4m3_(y).view(torch.int32).bitwise_or_(sign)
        q[r:r + n] = y[:, :cols]
        if out is not None:
            if scheme is Scheme.BLOCK:
                s_rows = s.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)
                out[r:r + n] = y.mul_(s_rows)[:, :cols]
            else:
                out[r:r + n] = y.mul_(s)[:, :cols]
    if scheme is Scheme.TENSOR:
        return q, tensor_scale.reshape(()), out
    return q, torch.cat(scales) if scales else torch.empty((0, 1 if scheme is Scheme.CHANNEL else
                                                             math.ceil(cols / 128))), out
