"""Activation quantizers in plain torch ops, for the `triton` backend under `torch.compile`.

Inductor cannot fuse a hand-written Triton kernel into its own, but it fuses these ops into the kernel
that produces the activation (RMSNorm, SiLU x up) and quantizes an input shared by several layers
(q/k/v, gate/up) once. The bytes are those of `numerics.quantize_activation` ("token" and "group")
on any backend, although inductor lowers a float32 `/` to an approximate division in Triton:

Each true float32 division `x / y` of SPEC §4 is computed as `float32(float64(x) * (1 / float64(y)))`.
The float64 product is within 2^-52 (relative) of the exact quotient, while the exact quotient of two
float32 numbers is never closer than 2^-48 to a float32 rounding midpoint (a midpoint has 25
significant bits; `x = y * midpoint` would need more than x's 24), so rounding the product to float32
gives the correctly rounded quotient, whether inductor keeps the division by the constant FMAX or
multiplies by its reciprocal. One float64 multiply per element, no float64 division.
"""

from __future__ import annotations

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR, Fp8Format

GROUP = 128


def _div32(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 `a / b` for float32 `a` and `b` (see the module docstring)."""
    inv = 1.0 / (b.double() if isinstance(b, torch.Tensor) else float(b))
    return (a.double() * inv).float()


def quantize_act_token(x: torch.Tensor, fmt: Fp8Format = E4M3FN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (rule "row"): q [M, K] and s [M, 1] float32, for x [M, K]."""
    xf = x.float()
    s = _div32(xf.abs().amax(dim=1, keepdim=True), fmt.fmax).clamp_min(fmt.min_scale)
    q = _div32(xf, s).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    return q, s


def quantize_act_group(x: torch.Tensor, col_major: bool = False, fmt: Fp8Format = E4M3FN
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 1x128 group (rule "group"): q [M, K] and s [M, K/128] float32, for x [M, K] with K % 128
    == 0; `col_major=True` gives s strides (1, M), the layout cuBLAS blockwise wants."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"the compiled group quantizer needs K divisible by {GROUP}, got K={k}")
    xf = x.float().reshape(m, k // GROUP, GROUP)
    amax = xf.abs().amax(dim=2, keepdim=True).clamp_min(GROUP_AMAX_FLOOR)
    s = _div32(amax, fmt.fmax)
    q = _div32(xf, s).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).reshape(m, k)
    s = s.reshape(m, k // GROUP)
    return q, (s.t().contiguous().t() if col_major else s)
