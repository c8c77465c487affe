"""The torch-op activation quantizers that the `triton` backend hands to inductor under torch.compile.

They must give the bytes of `numerics.quantize_activation` (whose CPU float32 division is the spec's
true division) eagerly and compiled. The data include rows built so that x / s lands within a few
float32 ulps of an FP8 rounding midpoint: there a float32 reciprocal multiply (or Triton's approximate
`/`) rounds to the other FP8 neighbour, which the controls show happens on this data.
"""

import pytest
import torch

from fp8_oracle import fp8_values, varied
from fp8now import numerics
from fp8now.kernels import compiled_quant as cq

FMAX = numerics.E4M3FN.fmax
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")


def near_midpoints(m: int, k: int, seed: int) -> torch.Tensor:
    """float32 rows whose x / s sit 0-3 ulps from midpoints between FP8 neighbours (s = the row's
    scale, set by one element of magnitude amax per row; groups of 128 share that amax too)."""
    g = torch.Generator().manual_seed(seed)
    vals = fp8_values()
    mids = ((vals[1:] + vals[:-1]) / 2)[vals[1:] <= FMAX]
    amax = (2.0 ** torch.randint(-8, 9, (m, 1), generator=g).double()
            * (1 + torch.rand(m, 1, generator=g, dtype=torch.float64))).float()
    s = numerics.scale_from_amax(amax, "row")
    pick = mids[torch.randint(len(mids), (m, k), generator=g)]
    sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0).double()
    x = (pick * s.double() * sign).float()
    ulps = torch.randint(-3, 4, (m, k), generator=g)
    for _ in range(3):   # step each element up to 3 float32 ulps towards its offset
        step = ulps.sign()
        x = torch.where(step > 0, torch.nextafter(x, torch.tensor(float("inf"))),
                        torch.where(step < 0, torch.nextafter(x, torch.tensor(float("-inf"))), x))
        ulps = ulps - step
    x[:, ::128] = amax * torch.where(torch.rand(m, 1, generator=g) < 0.5, -1.0, 1.0)  # every group's amax
    return x


def naive_f32_token(x: torch.Tensor) -> torch.Tensor:
    """The control: float32 `x * (1/s)` instead of the true division."""
    xf = x.float()
    s = numerics.scale_from_amax(xf.abs().amax(dim=1, keepdim=True), "row")
    return (xf * (1.0 / s)).clamp(-FMAX, FMAX).to(numerics.E4M3FN.dtype)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def check(fn, kind: str, x: torch.Tensor, **kw) -> None:
    q, s = fn(x, **kw)
    q_ref, s_ref = numerics.quantize_activation(x.cpu(), kind)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(bits(q.cpu()), bits(q_ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 256), (7, 384), (33, 1024)])
def test_varied_data_matches_reference(dtype, m, k):
    x = varied((m, k), dtype, seed=m * k)
    check(cq.quantize_act_token, "token", x)
    check(cq.quantize_act_group, "group", x)
    q, s = cq.quantize_act_group(x, col_major=True)
    assert torch.equal(s, numerics.quantize_activation(x, "group")[1])
    assert m == 1 or s.stride() == (1, m)  # one row: either stride order is the same layout


def test_near_midpoint_data_matches_reference_and_defeats_float32_reciprocal():
    x = near_midpoints(64, 512, seed=3)
    check(cq.quantize_act_token, "token", x)
    check(cq.quantize_act_group, "group", x)
    q_ref = numerics.quantize_activation(x, "token")[0]
    assert (bits(naive_f32_token(x)) != bits(q_ref)).sum() > 0  # the data can tell the two apart


def test_exact_div32_is_the_ieee_float32_quotient():
    """On random float32 pairs over a wide exponent range, and on quotients built to sit next to
    float32 rounding midpoints, where the float32 reciprocal product (the control) is wrong."""
    g = torch.Generator().manual_seed(11)
    n = 1 << 20
    a = torch.randn(n, generator=g) * 2.0 ** torch.randint(-60, 61, (n,), generator=g).float()
    b = torch.randn(n, generator=g) * 2.0 ** torch.randint(-60, 61, (n,), generator=g).float()
    # c = b * (a float32 rounding midpoint in [1, 2)), rounded and nudged by an ulp: c / b lies
    # within about an ulp of that midpoint (the control's float32 product misses on ~27% of them)
    mid = (torch.randint(1 << 23, 1 << 24, (n,), generator=g).double() * 2 + 1) * 2.0 ** -24  # in [1, 2)
    c = torch.nextafter((b.double() * mid).float(), torch.tensor(float("inf")))
    for x in (a, c):
        want = x / b                     # CPU float32 division is IEEE
        assert torch.equal(numerics.exact_div32(x, b).view(torch.int32), want.view(torch.int32))
    assert not torch.equal((c * (1.0 / b)).view(torch.int32), (c / b).view(torch.int32))


@pytest.mark.parametrize("kind", ["token", "tensor", "group"])
def test_numerics_under_compile_keeps_its_bytes(kind):
    """`numerics.quantize_activation` (the torch and reference backends' quantizer) under torch.compile:
    its true divisions switch to `exact_div32` there (CPU here; the CUDA run is the GPU test below)."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: numerics.quantize_activation(x, kind), fullgraph=True)
    for x in (near_midpoints(32, 512, seed=8), varied((16, 384), torch.bfloat16, seed=9)):
        check(fn, kind, x)


def test_zero_rows_take_the_floor():
    x = varied((4, 256), torch.bfloat16, seed=1)
    x[1] = 0
    x[3, :128] = 0
    check(cq.quantize_act_token, "token", x)
    check(cq.quantize_act_group, "group", x)


def test_group_quantizer_rejects_ragged_k():
    with pytest.raises(ValueError, match="K divisible by 128"):
        cq.quantize_act_group(torch.ones(2, 200))


def _compiled_check(device: str) -> None:
    torch._dynamo.reset()
    token = torch.compile(cq.quantize_act_token, fullgraph=True)
    group = torch.compile(lambda x: cq.quantize_act_group(x, col_major=True), fullgraph=True)
    for x in (near_midpoints(64, 512, seed=5), varied((48, 1024), torch.bfloat16, seed=6)):
        x = x.to(device)
        check(token, "token", x)
        check(group, "group", x)


def test_compiled_on_cpu_matches_reference():
    _compiled_check("cpu")


def test_compiled_with_dynamic_m_matches_reference():
    """One graph for every M (torch.compile(dynamic=True)), col-major scales at each M."""
    torch._dynamo.reset()
    token = torch.compile(cq.quantize_act_token, dynamic=True, fullgraph=True)
    group = torch.compile(lambda x: cq.quantize_act_group(x, col_major=True), dynamic=True, fullgraph=True)
    for m in (3, 17, 64):
        x = varied((m, 256), torch.bfloat16, seed=20 + m)
        check(token, "token", x)
        check(group, "group", x)
        assert group(x)[1].stride() == (1, m)


@pytest.mark.gpu
@cuda_only
def test_compiled_on_cuda_matches_reference_where_plain_division_does_not():
    """Inductor lowers a float32 `/` to Triton's approximate division: the control (the spec's
    formula written naively in float32 torch ops) loses bytes on the near-midpoint data; the float64
    reciprocal product does not."""
    _compiled_check("cuda")

    def naive(x):
        xf = x.float()
        s = (xf.abs().amax(dim=1, keepdim=True) / torch.full_like(xf[:, :1], FMAX)).clamp_min(
            numerics.E4M3FN.min_scale)
        return (xf / s).clamp(-FMAX, FMAX).to(numerics.E4M3FN.dtype)

    x = near_midpoints(256, 1024, seed=7)
    got = torch.compile(naive, fullgraph=True)(x.cuda()).cpu()
    assert (bits(got) != bits(numerics.quantize_activation(x, "token")[0])).sum() > 0


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("kind", ["token", "tensor", "group"])
def test_numerics_compiled_on_cuda_keeps_its_bytes(kind):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: numerics.quantize_activation(x, kind), fullgraph=True)
    for x in (near_midpoints(256, 1024, seed=12), varied((64, 1024), torch.bfloat16, seed=13)):
        check(fn, kind, x.cuda())
