"""The float64 reference product (`kernels.reference.exact_matmul`, the CPU backend and every GPU
check's oracle) against the test oracle's elementwise dequantize-then-matmul, over output-row chunks.

The reference widens the weight to float64 a chunk of rows at a time. A chunk that starts inside a
128-row weight tile would read the next tile's scales for part of its rows; weights whose
magnitudes vary by 128-row tile make that visible (per-row variation alone mostly hides it, since
every tile then holds a row of the largest magnitude).
"""

import math

import pytest
import torch

from fp8now import Scheme
from fp8now.config import ACT_GROUP, DEFAULT_ACT, WEIGHT_GROUP
from fp8now.kernels.reference import exact_matmul
from fp8now.numerics import quantize_activation, quantize_weight
from fp8_oracle import exact_product, varied


def tile_varied_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """varied() data times a random power of two per 128 x 128 weight tile."""
    g = torch.Generator().manual_seed(seed + 1)
    tiles = 2.0 ** torch.randint(-5, 6, (math.ceil(n / 128), math.ceil(k / 128)), generator=g).float()
    mag = tiles.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (varied((n, k), torch.float32, seed=seed, spread=2) * mag).to(torch.bfloat16)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float64 rounding of the oracle's dequantized operands (~1e-16 relative per product;
    a wrong tile scale is off by a power of two, ~1e-1)."""
    assert got.shape == want.shape and got.dtype == torch.float64
    scale = want.abs().max()
    assert scale > 0
    worst = float((got - want).abs().max() / scale)
    assert worst < 1e-12, f"max |got - want| / max |want| = {worst:.2e}"


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("n,k,temp_rows", [(600, 384, 200), (520, 256, 333), (300, 128, 1)])
def test_chunked_product_matches_oracle(scheme, n, k, temp_rows):
    """Chunks of `temp_rows` weight rows (rounded to whole tiles for block), ragged last tile."""
    w = tile_varied_weight(n, k, seed=n + k)
    x = varied((7, k), torch.bfloat16, seed=3 * k, spread=4)
    wq, ws = quantize_weight(w, scheme)
    act = DEFAULT_ACT[scheme]
    xq, xs = quantize_activation(x, act)
    got = exact_matmul(xq, xs, wq, ws, scheme, temp_bytes=8 * k * temp_rows)
    want = exact_product(xq, xs, wq, ws, ACT_GROUP[act], WEIGHT_GROUP[scheme])
    assert_matches(got, want)


def test_default_chunking_at_k_14336():
    """The default temporary at K = 14336 gives 585-row chunks: the block reference must still use
    each row's own tile scale (this shape is where a misaligned chunk first showed, on the H200)."""
    n, k = 1280, 14336
    w = tile_varied_weight(n, k, seed=5)
    x = varied((3, k), torch.bfloat16, seed=6, spread=4)
    wq, ws = quantize_weight(w, Scheme.BLOCK)
    xq, xs = quantize_activation(x, "group")
    got = exact_matmul(xq, xs, wq, ws, Scheme.BLOCK)
    want = exact_product(xq, xs, wq, ws, ACT_GROUP["group"], WEIGHT_GROUP[Scheme.BLOCK])
    assert_matches(got, want)
