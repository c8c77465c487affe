"""The CPU load's weight quantizer as one compiled C++ kernel (AOTInductor, like `cpu_aot`'s activation
quantizer): from a float weight, in one call, the FP8 bytes and scales of `numerics.quantize_weight`, the
cpu backend's bf16 working copy `bf16(q * s)`, and the seven error sums of `layers.weight_error.error_stats`.

`QuantizeWeight(scheme)` is written as torch ops and exported with dynamic shapes; inductor fuses them
into about two passes over the weight (each scale group's amax, then everything else), where the torch-ops
quantizer (`cpu_wquant`) and the error measurement run some fifteen passes between them. Per element: the
SPEC's float32 division (the tensor rule: the product with the reciprocal), the rounding to the e4m3 grid
by Veltkamp's split (`cpu_aot.round_e4m3_split`), the FP8 byte by an exact cast of the rounded value (signed
as the value before rounding), the working copy as the float32 product rounded once to bf16, and float64 sums for the error figures. `check` compares a built
library with the torch-ops quantizer bit for bit before a load uses it.

Inputs (`args`): "channel" `w [N, K]`; "tensor" `w [N, K]` and its float32 scale `[]` (the whole weight's
amax is one pass of its own, taken first); "block" `w [R, 128, G, 128]` (whole 128x128 tiles, zero-padded).
Outputs: the FP8 bytes (w's shape), the scales (`[N, 1]`, `[]`, `[R, G]`), the working copy (w's shape),
and the sums float64 `[7]`: |a|^2, |b|^2, <a,b>, |a-b|^2, flushed, nonzero, the worst group's flushed fraction.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Scheme
from ..numerics import E4M3FN, WEIGHT_RULE, nonfinite_error, scale_from_amax
from . import cpu_wquant
from .cpu import WORK_DTYPE
from .cpu_aot import DTYPES, _all_values as _check_values, build_library, digest, round_e4m3_split


def fp8_bytes(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The e4m3 tensor of `r` (float32 values on the e4m3 grid, |r| <= 448: the cast is exact), signed as
    `y` (the value before rounding: one that rounds to zero keeps its sign, as the SPEC's cast does)."""
    return torch.copysign(r, y).to(torch.float8_e4m3fn)


def _sums(w: torch.Tensor, r: torch.Tensor, s: torch.Tensor, dims: tuple[int, ...]) -> list[torch.Tensor]:
    """Per group (the sums over `dims`): |a|^2, |b|^2, <a,b>, |a-b|^2 in float64, flushed and nonzero counts;
    a = w, b = r * s (the dequantized weight)."""
    a = w.double()
    b = r.double() * s.double()
    nonzero = w != 0
    flushed = nonzero & (r == 0)
    d = b - a
    return [(a * a).sum(dims), (b * b).sum(dims), (a * b).sum(dims), (d * d).sum(dims),
            flushed.sum(dims).double(), nonzero.sum(dims).double()]


class QuantizeWeight(nn.Module):
    """One scheme's weight quantizer (see the module's docstring for inputs and outputs)."""

    def __init__(self, scheme: Scheme | str) -> None:
        super().__init__()
        self.scheme = Scheme(scheme)
        self.rule = WEIGHT_RULE[self.scheme]

    def forward(self, w: torch.Tensor, scale: torch.Tensor | None = None):
        if self.scheme is Scheme.TENSOR:
            s = scale
            y = w.float() * (torch.ones_like(s) / s)            # numerics: x * (1/s) for this rule
            r = round_e4m3_split(y)
            sums = _sums(w, r, s, (1,))
            parts = [p.sum() for p in sums]
            worst = parts[4] / parts[5].clamp(min=1)
        elif self.scheme is Scheme.CHANNEL:
            s = scale_from_amax(w.abs().amax(dim=1, keepdim=True), self.rule)   # [N, 1]
            y = w.float() / s
            r = round_e4m3_split(y)
            sums = _sums(w, r, s, (1,))
            parts = [p.sum() for p in sums]
            worst = (sums[4] / sums[5].clamp(min=1)).amax()
        else:                                                    # [R, 128, G, 128]
            s = scale_from_amax(w.abs().amax(dim=3).amax(dim=1), self.rule)       # [R, G]
            st = s[:, None, :, None]
            y = w.float() * (torch.ones_like(st) / st)
            r = round_e4m3_split(y)
            sums = [p.sum(1) for p in _sums(w, r, st, (3,))]     # per row and group, then per tile
            parts = [p.sum() for p in sums]
            worst = (sums[4] / sums[5].clamp(min=1)).amax()
        stats = torch.stack([*parts[:6], worst.double()])
        work = (r * s if self.scheme is not Scheme.BLOCK else r * st).to(WORK_DTYPE)
        return fp8_bytes(y, r), s, work, stats


def example(scheme: Scheme, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Inputs of the traced shapes and their dynamic dimensions."""
    rows, cols = torch.export.Dim("rows", min=1), torch.export.Dim("cols", min=1)
    if scheme is Scheme.BLOCK:
        return (torch.randn(2, 128, 3, 128).to(dtype),), ({0: rows, 2: cols},)
    w = torch.randn(8, 384).to(dtype)
    if scheme is Scheme.TENSOR:
        return (w, torch.tensor(0.01)), ({0: rows, 1: cols}, None)
    return (w,), ({0: rows, 1: cols},)


def file_name(scheme: Scheme, dtype: torch.dtype) -> str:
    """The library's name: scheme, input dtype, and a digest of its sources, torch and this CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"no compiled weight quantizer for {dtype} weights")
    here = Path(__file__)
    return f"wquant-{Scheme(scheme).value}-{DTYPES[dtype]}-{digest(here, here.with_name('cpu_aot.py'))}.so"


def build(scheme: Scheme, dtype: torch.dtype, target: Path) -> None:
    """Compile `QuantizeWeight(scheme)` for weights of `dtype` into the shared library `target`."""
    args, dims = example(Scheme(scheme), dtype)
    build_library(QuantizeWeight(scheme), args, dims, target)


class Quantizer:
    """A compiled weight quantizer: `(w [N, K], name)` -> (FP8 bytes [N, K], scales of
    `numerics.quantize_weight`'s shape, the bf16 working copy [N, K], the error sums float64 [7])."""

    __slots__ = ("scheme", "dtype", "_runner")

    def __init__(self, path: Path, scheme: Scheme, dtype: torch.dtype) -> None:
        self.scheme, self.dtype = Scheme(scheme), dtype
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)

    def __call__(self, w: torch.Tensor, name: str | None = None):
        rows, cols = w.shape
        w = w.contiguous()
        if self.scheme is Scheme.TENSOR:
            amax = cpu_wquant.tensor_amax(w)
            if not bool(torch.isfinite(amax)):
                raise nonfinite_error((rows, cols), name)
            s = scale_from_amax(amax, WEIGHT_RULE[self.scheme])
            q, _, work, stats = self._runner.run([w, s])
            return q, s.reshape(()), work, stats
        if self.scheme is Scheme.CHANNEL:
            q, s, work, stats = self._runner.run([w])
        else:
            pr, pc = -rows % 128, -cols % 128
            padded = F.pad(w, (0, pc, 0, pr)) if pr or pc else w
            q, s, work, stats = self._runner.run([padded.view((rows + pr) // 128, 128, (cols + pc) // 128, 128)])
            q, work = q.view(rows + pr, cols + pc), work.view(rows + pr, cols + pc)
            if pr or pc:
                q, work = q[:rows, :cols].contiguous(), work[:rows, :cols].contiguous()
        if not bool(torch.isfinite(s).all()):
            raise nonfinite_error((rows, cols), name)
        return q, s, work, stats


def check(quantizer, scheme: Scheme, dtype: torch.dtype, sums_of=None) -> str | None:
    """None if `quantizer` gives `cpu_wquant.quantize_weight`'s bytes, scales and working copy bit for bit,
    and sums within 1e-6 of `weight_error.error_stats`' (float64 in another order; the torch path rounds the
    dequantized block weights to float32 first), on weights holding
    every value of a 16-bit dtype (or float32 values around every e4m3 rounding boundary) at scale 1 and on
    random weights of varied magnitude (zero rows, sizes off multiples of 128); otherwise what differed.
    `sums_of(w, q, s, scheme)`: the reference error sums (`layers.weight_error.error_stats`; None: not compared)."""
    scheme = Scheme(scheme)
    for what, w in (("every value up to 448", _all_values(dtype)), ("random weights", _random_weight(dtype))):
        want = cpu_wquant.quantize_weight(w, scheme)
        got = quantizer(w)
        for part, a, b in (("bytes", got[0], want[0]), ("scales", got[1], want[1]), ("working copy", got[2], want[2])):
            if not _same(a, b):
                return f"{what}: the {part} differ ({a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)})"
        sums = None if sums_of is None else sums_of(w, want[0], want[1], scheme)
        if sums is not None and not torch.allclose(got[3], sums, rtol=1e-6, atol=0):
            return f"{what}: the error sums differ ({got[3].tolist()} against {sums.tolist()})"
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == E4M3FN.dtype else torch.equal(a, b)


def _all_values(dtype: torch.dtype) -> torch.Tensor:
    """The activation check's rows (`cpu_aot._all_values`: 127 values and a 448, so every row's and 128x128
    tile's amax is 448 and its scale 1): every finite value of a 16-bit dtype up to 448 and its negative, or
    float32 values around every rounding boundary; zero rows up to a whole tile."""
    v = _check_values("token", dtype)
    return torch.cat([v, v.new_zeros(-v.shape[0] % 128, v.shape[1])])


def _random_weight(dtype: torch.dtype) -> torch.Tensor:
    """A weight [300, 200] whose magnitudes span many binades, with a zero row and zero values."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.exp2(torch.randint(-20, 8, (300, 200), generator=g).float())
    w[1] = 0
    w[2, :50] = 0
    return w.to(dtype)
