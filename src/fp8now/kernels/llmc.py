"""llm-compressor's FP8 weight rules, for `Fp8Config(weight_numerics="llm-compressor")` (issue 40).

What llm-compressor 0.14 and compressed-tensors 0.19 compute for a weight `w [N, K]` under their data-free
FP8_DYNAMIC (per-channel) and FP8_BLOCK (128x128) presets, read from their source and checked byte for
byte against their output (tests/fixtures/llmc). `dt` is the weight's own dtype (the model's: bf16 or fp16):
- amax per group (row; zero-padded 128x128 tile), exact in any dtype;
- `s = dt(amax / 448)`: the scale is computed and stored in `dt` (the observer divides a `dt` tensor by
  448), and an all-zero group gets `s = finfo(dt).eps` (2^-7 in bf16) instead of 0;
- `q = fp8(clamp(dt(w / s), ±448))`: the quotient is rounded to `dt` first, then to FP8 (a double
  rounding: about 3% of bf16 elements land one FP8 step away from the float32 quotient's rounding).
  That is compressed-tensors' torch implementation, used on a CPU and on GPUs before Hopper. On a CUDA
  GPU of compute capability >= 9 with Triton installed it quantizes with a Triton kernel that divides in
  float32 instead: `q = fp8(clamp(float32(w) / float32(s), ±448))`, the same scales, other bytes. The
  numerics name "llm-compressor-triton" gives those.
fp8now computes both with torch ops on every device (this module is not a Triton kernel), so the bytes do
not depend on where fp8now runs. Scales are returned in `dt`; every value is exact in float32, which is how
the layers keep them.
"""

from __future__ import annotations

import torch

from ..config import LLMC_SCHEMES, Scheme
from ..numerics import CHUNK_BYTES, E4M3FN, weight_amax

BLOCK = 128
# Numerics name -> dtype the quotient w / s is rounded to before the FP8 cast (None: the weight's own).
DIVISION: dict[str, torch.dtype | None] = {
    "llm-compressor": None,                  # compressed-tensors' torch ops
    "llm-compressor-triton": torch.float32,  # its Triton kernel (CUDA, compute capability >= 9)
}


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """llm-compressor's weight scale in `dtype`: `dtype(amax / 448)`, all-zero groups `finfo(dtype).eps`."""
    a = amax.to(dtype)                                       # exact: amax is one of the weight's values
    s = a / torch.full_like(a, E4M3FN.fmax)                  # a true division on every device
    return torch.where(s == 0, torch.full_like(s, torch.finfo(dtype).eps), s)


def _spread(scale: torch.Tensor, rows: int, cols: int, scheme: Scheme) -> torch.Tensor:
    """Each element's scale: channel `[rows, 1]` broadcasts; block tiles repeat over their 128x128 elements."""
    if scheme is Scheme.CHANNEL:
        return scale
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def _quantize_2d(w: torch.Tensor, scheme: Scheme, numerics: str, name: str | None,
                 amax: torch.Tensor | None, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = w.dtype
    if amax is None:
        amax = weight_amax(w, scheme, name)                 # float32; NaN/Inf raise, naming the layer
    scale = scale_from_amax(amax.to(w.device), dtype)       # channel [N, 1], block [ceil(N/128), ceil(K/128)]
    div = DIVISION[numerics] or dtype
    rows, cols = w.shape
    step = max(chunk_bytes // (4 * max(cols, 1)) // BLOCK * BLOCK, BLOCK)   # whole tiles per chunk
    q = torch.empty((rows, cols), dtype=E4M3FN.dtype, device=w.device)
    for r in range(0, rows, step):
        s = scale[r:r + step] if scheme is Scheme.CHANNEL else scale[r // BLOCK:(r + step) // BLOCK]
        chunk = w[r:r + step]
        y = chunk.to(div) / _spread(s, chunk.shape[0], cols, scheme).to(div)
        q[r:r + step] = y.clamp(-E4M3FN.fmax, E4M3FN.fmax).to(E4M3FN.dtype)
    return q, scale


def quantize_weight(w: torch.Tensor, scheme: Scheme | str, numerics: str = "llm-compressor",
                    name: str | None = None, amax: torch.Tensor | None = None, chunk_bytes: int = CHUNK_BYTES
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's FP8 bytes and scales of a weight `[N, K]` or stacked experts `[E, N, K]`.

    Returns `(q, scale)` with the scale in w's dtype: channel `[N, 1]`, block `[ceil(N/128), ceil(K/128)]`
    (`[E, ...]` stacked). `amax` (2-D only; numerics.weight_amax's shape): the groups' amax to use instead
    of measuring it (a tensor-parallel group's MAX, SPEC §6). NaN/Inf raise a ValueError naming `name`.
    Rows go in chunks of whole 128-row tiles whose float32 size stays near `chunk_bytes`; the bytes do not
    depend on the chunking.
    """
    scheme = Scheme.parse(scheme)
    if numerics not in DIVISION:
        raise ValueError(f"unknown llm-compressor numerics {numerics!r}; valid: {', '.join(DIVISION)}")
    if scheme not in LLMC_SCHEMES:
        raise ValueError(f"llm-compressor numerics cover the schemes {', '.join(s.value for s in LLMC_SCHEMES)} "
                         f"(its FP8_DYNAMIC and FP8_BLOCK), not {scheme.value!r}")
    if w.dim() == 2:
        return _quantize_2d(w, scheme, numerics, name, amax, chunk_bytes)
    if amax is not None or w.dim() != 3:
        raise ValueError(f"llm-compressor numerics quantize [N, K] weights (with amax) or [E, N, K] stacked "
                         f"experts (without), got shape {tuple(w.shape)}" + (f" for {name!r}" if name else ""))
    outs = [_quantize_2d(w[e], scheme, numerics, f"{name or 'experts'}[{e}]", None, chunk_bytes)
            for e in range(w.shape[0])]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
