"""Activation quantizers in plain torch ops, for the `triton` backend under `torch.compile`.

Inductor cannot fuse a hand-written Triton kernel into its own, but it fuses these ops into the kernel
that produces the activation (RMSNorm, SiLU x up) and quantizes an input shared by several layers
(q/k/v, gate/up) once. The bytes are those of `numerics.quantize_activation` ("token" and "group")
on any backend: each true float32 division of SPEC §4 is `numerics.exact_div32`, a float64
reciprocal product that is exact for float32 operands (normal quotients; see there), since inductor
lowers a float32 `/` to an approximate division in Triton. One float64 multiply per element, no
float64 division. The scales come from `numerics.scale_from_amax`, whose divisions switch to
`exact_div32` while torch.compile traces them.
"""

from __future__ import annotations

import torch

from ..config import ACT_GROUP
from ..numerics import ACT_RULE, E4M3FN, Fp8Format, exact_div32, scale_from_amax

GROUP = ACT_GROUP["group"][1]   # 128


def quantize_act_token(x: torch.Tensor, fmt: Fp8Format = E4M3FN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (rule "row"): q [M, K] and s [M, 1] float32, for x [M, K]."""
    xf = x.float()
    s = scale_from_amax(xf.abs().amax(dim=1, keepdim=True), ACT_RULE["token"], fmt)
    q = exact_div32(xf, s).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    return q, s


def quantize_act_group(x: torch.Tensor, col_major: bool = False, fmt: Fp8Format = E4M3FN
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 1x128 group (rule "group"): q [M, K] and s [M, K/128] float32, for x [M, K] with K % 128
    == 0; `col_major=True` gives s strides (1, M), the layout cuBLAS blockwise wants."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"the compiled group quantizer needs K divisible by {GROUP}, got K={k}")
    xf = x.float().reshape(m, k // GROUP, GROUP)
    s = scale_from_amax(xf.abs().amax(dim=2, keepdim=True), ACT_RULE["group"], fmt)
    q = exact_div32(xf, s).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).reshape(m, k)
    s = s.reshape(m, k // GROUP)
    return q, (s.t().contiguous().t() if col_major else s)
