"""Bit-exact FP8 quantization rules (SPEC §2, §4). Imports nothing of fp8now but config's tables.

Every backend must reproduce these bytes. The scale is always the dequantization multiplier:
`x ≈ q.float() * scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ACT_GROUP, WEIGHT_GROUP, Scheme


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 dtype and the clamp range used with it (a policy value, not always the format's max)."""

    dtype: torch.dtype
    fmax: float

    @property
    def min_scale(self) -> float:
        """Scale floor for per-row quantization and for all-zero tensors: 1 / (FMAX * 512)."""
        return 1.0 / (self.fmax * 512.0)


E4M3FN = Fp8Format(torch.float8_e4m3fn, 448.0)
# MI300-class GPUs: the format's max is 240, but 224 measurably keeps accuracy better (SPEC §2). The policy
# value a ROCm path would pass as `fmt`; no path selects it yet (nothing here runs on ROCm).
E4M3FNUZ = Fp8Format(torch.float8_e4m3fnuz, 224.0)

BLOCK_AMAX_FLOOR = 1e-4   # block weights: a = max(amax, 1e-4)
GROUP_AMAX_FLOOR = 1e-10  # 1x128 activation groups: s = max(amax, 1e-10) / FMAX
CHUNK_BYTES = 64 << 20    # float32 temporary per weight chunk


# How each kind of group turns amax into a scale and divides by it.
#   "tensor":  s = amax / FMAX (amax == 0 -> floor);           q = x * (1/s)
#   "row":     s = max(amax / FMAX, floor);                    q = x / s
#   "block":   s = max(amax, 1e-4) / FMAX;                     q = x * (1/s)
#   "group":   s = max(amax, 1e-10) / FMAX;                    q = x / s
WEIGHT_RULE = {Scheme.TENSOR: "tensor", Scheme.CHANNEL: "row", Scheme.BLOCK: "block"}
ACT_RULE = {"token": "row", "tensor": "tensor", "group": "group"}


def exact_div32(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """The IEEE float32 quotient `a / b` of float32 values, computed as
    `float32(float64(a) * (1 / float64(b)))`, for code that torch.compile lowers (inductor turns a
    float32 `/` into Triton's approximate division on CUDA, unless told otherwise).

    Why it is exact: the float64 product is within 2^-52 (relative) of the true quotient, while the
    true quotient of two float32 numbers is never within 2^-49 of a float32 rounding midpoint (a
    midpoint has 25 significant bits, and `a = b * midpoint` would need more than a's 24), so rounding
    the product to float32 gives the correctly rounded quotient. It needs `1 / float64(b)` rounded
    to nearest, which Python's and Triton's float64 divisions are (PTX `div.rn.f64`). It needs a normal
    float32 quotient (>= 2^-126): a subnormal one may be an exact tie that the float64 product misses
    by an ulp. No such quotient reaches an FP8 byte (all round to ±0), and a scale that small would
    need a per-tensor amax below 2^-117.
    """
    inv = 1.0 / (b.double() if isinstance(b, torch.Tensor) else float(b))
    return (a.double() * inv).float()


def _true_div(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """IEEE float32 division. On CUDA, torch turns `tensor / python_float` into a multiply by the
    rounded reciprocal, so the divisor is made a tensor to get the same bits on every device. Under
    torch.compile, `exact_div32` (same bits; inductor's float32 `/` is approximate on CUDA)."""
    if torch.compiler.is_compiling():
        return exact_div32(a, b)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return a / b


def scale_from_amax(amax: torch.Tensor, rule: str, fmt: Fp8Format = E4M3FN) -> torch.Tensor:
    """Float32 dequantization scale from a float32 amax, by one of the four rules above."""
    amax = amax.float()
    match rule:
        case "tensor":
            s = _true_div(amax, fmt.fmax)
            return torch.where(amax == 0, torch.full_like(s, fmt.min_scale), s)
        case "row":
            return _true_div(amax, fmt.fmax).clamp_min(fmt.min_scale)
        case "block":
            return _true_div(amax.clamp_min(BLOCK_AMAX_FLOOR), fmt.fmax)
        case "group":
            return _true_div(amax.clamp_min(GROUP_AMAX_FLOOR), fmt.fmax)
    raise ValueError(f"unknown scale rule {rule!r}")


def _groups(rows: int, cols: int, group: tuple[int, int]) -> tuple[int, int]:
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    return max(gr, 1), max(gc, 1)


def _tiled(x32: torch.Tensor, gr: int, gc: int) -> torch.Tensor:
    """[R, C] -> [R'/gr, gr, C'/gc, gc], zero-padded to whole groups."""
    rows, cols = x32.shape
    pr, pc = -rows % gr, -cols % gc
    if pr or pc:
        x32 = torch.nn.functional.pad(x32, (0, pc, 0, pr))
    return x32.view(x32.shape[0] // gr, gr, x32.shape[1] // gc, gc)


def _quantize_2d(x: torch.Tensor, group: tuple[int, int], rule: str, fmt: Fp8Format,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor by groups; `scale` ([R/gr, C/gc]) may be given (a global tensor scale)."""
    rows, cols = x.shape
    gr, gc = _groups(rows, cols, group)
    tiles = _tiled(x.float(), gr, gc)                       # [R/gr, gr, C/gc, gc]
    if scale is None:
        scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), rule, fmt)
    s = scale.reshape(tiles.shape[0], 1, tiles.shape[2], 1)
    if rule in ("tensor", "block"):
        y = tiles * _true_div(torch.ones_like(s), s)
    else:
        y = _true_div(tiles, s)
    q = y.clamp_(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    q = q.view(tiles.shape[0] * gr, tiles.shape[2] * gc)[:rows, :cols]
    return q.contiguous(), scale


def nonfinite_error(shape: tuple[int, ...], name: str | None) -> ValueError:
    """The error for a weight holding NaN or Inf, naming its layer and shape."""
    where = f" of layer {name!r}" if name else ""
    return ValueError(f"weight{where} with shape {tuple(shape)} contains NaN or Inf; "
                      "fix or re-export the checkpoint (FP8 cannot represent these values)")


def _check_finite(chunk: torch.Tensor, shape: torch.Size, name: str | None) -> None:
    if not bool(torch.isfinite(chunk).all()):
        raise nonfinite_error(tuple(shape), name)


def _row_chunk(rows: int, cols: int, align: int, chunk_bytes: int) -> int:
    per = max(chunk_bytes // (4 * max(cols, 1)), 1)
    per = max(per // align * align, align)
    return min(per, rows + (-rows % align))


def weight_amax(w: torch.Tensor, scheme: Scheme | str, name: str | None = None,
                chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Float32 amax of each weight-scale group of `w [N, K]`: tensor `[]`, channel `[N, 1]`, block
    `[ceil(N/128), ceil(K/128)]`, in row chunks; NaN/Inf raise. (Under TP a shard's amax is reduced
    with MAX over the group before `quantize_weight(..., amax=)`, SPEC §6.)"""
    scheme = Scheme.parse(scheme)
    rows, cols = w.shape
    group = (1, -1) if scheme is Scheme.TENSOR else WEIGHT_GROUP[scheme]
    gr, gc = _groups(rows, cols, group)
    step = _row_chunk(rows, cols, 128 if scheme is Scheme.BLOCK else 1, chunk_bytes)
    parts = []
    for r in range(0, rows, step):
        chunk = w[r:r + step].float()
        _check_finite(chunk, w.shape, name)
        parts.append(_tiled(chunk, gr, gc).abs().amax(dim=(1, 3)))
    amax = torch.cat(parts) if parts else torch.zeros((0, 1), device=w.device)
    if scheme is Scheme.TENSOR:
        return amax.amax() if amax.numel() else torch.zeros((), device=w.device)
    return amax


def _quantize_weight_2d(w: torch.Tensor, scheme: Scheme, name: str | None, fmt: Fp8Format,
                        chunk_bytes: int, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    group, rule = WEIGHT_GROUP[scheme], WEIGHT_RULE[scheme]
    align = 128 if scheme is Scheme.BLOCK else 1
    step = _row_chunk(rows, cols, align, chunk_bytes)
    checked = amax is None and scheme is Scheme.TENSOR
    if checked:
        amax = weight_amax(w, scheme, name, chunk_bytes)
    scale = None
    if amax is not None:
        scale = scale_from_amax(amax.to(w.device), rule, fmt)
        scale = scale.reshape(1, 1) if scheme is Scheme.TENSOR else scale.reshape(-1, scale.shape[-1])
    if scheme is Scheme.TENSOR:
        group = (1, -1)  # any row split works once the scale is global
    q = torch.empty((rows, cols), dtype=fmt.dtype, device=w.device)
    scales = []
    for r in range(0, rows, step):
        chunk = w[r:r + step]
        if not checked:
            _check_finite(chunk.float(), w.shape, name)
        s_in = None
        if scheme is Scheme.TENSOR:
            s_in = scale.expand(chunk.shape[0], 1)
        elif scale is not None:
            lo = r // align
            s_in = scale[lo:lo + math.ceil(chunk.shape[0] / align)]
        q[r:r + step], s = _quantize_2d(chunk, group, rule, fmt, s_in)
        scales.append(s)
    if scheme is Scheme.TENSOR:
        return q, scale.reshape(())
    if scale is not None:
        return q, scale
    return q, torch.cat(scales, dim=0) if scales else torch.empty((0, 1), device=w.device)


def quantize_weight(w: torch.Tensor, scheme: Scheme | str, name: str | None = None,
                    fmt: Fp8Format = E4M3FN, chunk_bytes: int = CHUNK_BYTES,
                    amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight `[N, K]` or stacked experts `[E, N, K]` (bf16/fp16/fp32) to FP8.

    Returns `(q, scale)`; scale shapes: tensor `[]` (stacked `[E]`), channel `[N, 1]`
    (`[E, N, 1]`), block `[ceil(N/128), ceil(K/128)]` (`[E, ...]`). Rows are processed in chunks so
    the float32 temporary stays near `chunk_bytes`; the bytes do not depend on the chunking.
    NaN/Inf raise a ValueError naming the shape and `name`. `amax` (2-D only; the shape
    `weight_amax` returns) gives each group's amax instead of measuring it, e.g. the TP group's MAX.
    """
    scheme = Scheme.parse(scheme)
    if w.dim() == 2:
        return _quantize_weight_2d(w, scheme, name, fmt, chunk_bytes, amax)
    if amax is not None:
        raise ValueError("quantize_weight: a given amax needs a 2-D weight")
    if w.dim() == 3:
        outs = [_quantize_weight_2d(w[e], scheme, f"{name or 'experts'}[{e}]", fmt, chunk_bytes, None)
                for e in range(w.shape[0])]
        q = torch.stack([o[0] for o in outs]) if outs else torch.empty(w.shape, dtype=fmt.dtype)
        return q, torch.stack([o[1] for o in outs])
    raise ValueError(f"quantize_weight expects [N, K] or [E, N, K], got shape {tuple(w.shape)}"
                     + (f" for {name!r}" if name else ""))


def quantize_activation(x: torch.Tensor, kind: str, fmt: Fp8Format = E4M3FN,
                        amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of `x [..., K]`; leading dims flatten into M tokens.

    kind "token" -> q [M, K], scale [M, 1]; "tensor" -> scale []; "group" (1x128) -> [M, ceil(K/128)].
    `amax` (the scale's shape) replaces the measured amax: a row-parallel shard's per-token amax
    reduced over the TP group (tp_invariant, SPEC §6).
    """
    if kind not in ACT_GROUP:
        raise ValueError(f"unknown activation kind {kind!r}; valid: {', '.join(ACT_GROUP)}")
    x2 = x.reshape(-1, x.shape[-1])
    group, rule = ACT_GROUP[kind], ACT_RULE[kind]
    scale = None
    if amax is not None:
        gr, gc = _groups(*x2.shape, group)
        shape = (math.ceil(x2.shape[0] / gr), math.ceil(x2.shape[1] / gc))
        scale = scale_from_amax(amax, rule, fmt).reshape(shape)
    q, s = _quantize_2d(x2, group, rule, fmt, scale)
    return q, (s.reshape(()) if kind == "tensor" else s)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """Back to float32: `q * scale` with each scale spread over its group (2-D, or stacked 3-D)."""
    if q.dim() == 3:
        return torch.stack([dequantize(q[e], scale[e], group) for e in range(q.shape[0])])
    rows, cols = q.shape
    gr, gc = _groups(rows, cols, group)
    s = scale.float().reshape(math.ceil(rows / gr), math.ceil(cols / gc))
    s = s.repeat_interleave(gr, dim=0)[:rows].repeat_interleave(gc, dim=1)[:, :cols]
    return q.float() * s


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Scale-free distance `1 - 2<a,b> / (|a|² + |b|²)` in float64 (0 = equal; NaN propagates)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    denom = (a * a).sum() + (b * b).sum()
    if float(denom) == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (a * b).sum() / denom)


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10·log10(|ref|² / |ref - test|²)."""
    ref, test = ref.detach().double(), test.detach().double()
    noise = float(((ref - test) ** 2).sum())
    signal = float((ref ** 2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
