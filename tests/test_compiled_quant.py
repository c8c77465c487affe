"""Activation quantization under torch.compile: `numerics.quantize_activation` (the torch and
reference backends' quantizer, and the `triton` backend's per-token quantizer while compiling, through
`triton_fp8.quantize`) compiled must give the bytes of the eager CPU reference, whose float32
division is the spec's true division. Compiled, each true division is `numerics.exact_div32`, since
inductor lowers a float32 `/` to an approximate division in Triton. The data include rows built so
that x / s lands within a few float32 ulps of an FP8 rounding midpoint: there a float32 reciprocal
multiply (or Triton's approximate `/`) rounds to the other FP8 neighbour, which the controls show
happens on this data.
"""

import pytest
import torch

from fp8_oracle import fp8_values, varied
from fp8now import numerics
from fp8now.config import Scheme
from fp8now.kernels import triton_fp8
from fp8now.kernels.plan import Table, plan

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


def check(fn, kind: str, x: torch.Tensor) -> None:
    expect_bytes(*fn(x), kind, x)


def expect_bytes(q: torch.Tensor, s: torch.Tensor, kind: str, x: torch.Tensor) -> None:
    """q, s are the eager CPU reference's bytes and scales of `kind` for x."""
    q_ref, s_ref = numerics.quantize_activation(x.cpu(), kind)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(bits(q.cpu()), bits(q_ref))


def with_zero_rows(x: torch.Tensor) -> torch.Tensor:
    """Zero rows and a zero group take the scale floor."""
    x = x.clone()
    x[1] = 0
    x[3, :128] = 0
    return x


def test_near_midpoint_data_tells_true_division_from_the_reciprocal_product():
    x = near_midpoints(64, 512, seed=3)
    q_ref = numerics.quantize_activation(x, "token")[0]
    assert (bits(naive_f32_token(x)) != bits(q_ref)).sum() > 0


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


def compiled_data() -> list[torch.Tensor]:
    """One input per dtype: the first compiles a static graph, the next two (other shapes) dynamic ones."""
    return [near_midpoints(32, 512, seed=8), with_zero_rows(varied((16, 384), torch.bfloat16, seed=9)),
            varied((7, 256), torch.float16, seed=10)]


KINDS = ("token", "tensor", "group")


def test_numerics_under_compile_keeps_its_bytes():
    """Every kind, bf16, fp16 and float32 inputs, near-midpoint data, zero rows (CPU here; CUDA in the GPU
    test). The three kinds compile in one graph: a graph per input dtype instead of one per kind and dtype
    (each compile builds and runs the C++ compiler), every kind's bytes checked on its own."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: [numerics.quantize_activation(x, kind) for kind in KINDS], fullgraph=True)
    for x in compiled_data():
        for kind, (q, s) in zip(KINDS, fn(x)):
            expect_bytes(q, s, kind, x)


def backend_paths() -> tuple:
    """The paths a table with the torch-op quantizer switched on for both kinds plans under compile for the
    triton backend's quantizer (`triton_fp8.quantize`): token, and group with column-major scales (the
    cuBLAS blockwise path)."""
    table = Table(compiled_quant=("token", "group"))
    token_path = plan("triton", Scheme.CHANNEL, "token", 4096, 1024, 1024, "cuda-fp8", compiling=True, table=table)
    group_path = plan("triton", Scheme.BLOCK, "group", 4096, 1024, 1024, "cuda-fp8", compiling=True, table=table)
    assert (token_path.quant, group_path.quant, group_path.gemm) == ("torch", "torch", "cublas-blockwise")
    return token_path, group_path


def backend_quantizers() -> tuple:
    """The triton backend's quantizer compiled on each of backend_paths() (dynamic M: one graph for every M)."""
    token_path, group_path = backend_paths()
    torch._dynamo.reset()
    token = torch.compile(lambda x: triton_fp8.quantize(x, token_path), dynamic=True, fullgraph=True)
    group = torch.compile(lambda x: triton_fp8.quantize(x, group_path), dynamic=True, fullgraph=True)
    return token, group


def test_backend_quantizers_compile_to_the_reference_bytes():
    """Through `triton_fp8.quantize` (no Triton launch on this path), col-major scales at each M. Both paths
    compile in one graph (dynamic M: a graph per input dtype), each one's bytes checked on its own."""
    token_path, group_path = backend_paths()
    torch._dynamo.reset()
    both = torch.compile(lambda x: (triton_fp8.quantize(x, token_path), triton_fp8.quantize(x, group_path)),
                         dynamic=True, fullgraph=True)
    for x in [varied((m, 256), torch.bfloat16, seed=20 + m) for m in (3, 17, 64)] + [near_midpoints(64, 512, seed=5)]:
        token, group = both(x)
        expect_bytes(*token, "token", x)
        expect_bytes(*group, "group", x)
        assert group[1].stride() == (1, x.shape[0])


@pytest.mark.gpu
@cuda_only
def test_compiled_on_cuda_matches_reference_where_plain_division_does_not():
    """Inductor lowers a float32 `/` to Triton's approximate division: the control (the spec's
    formula written naively in float32 torch ops) loses bytes on the near-midpoint data; the float64
    reciprocal product does not."""
    token, group = backend_quantizers()
    for x in (near_midpoints(64, 512, seed=5), varied((48, 1024), torch.bfloat16, seed=6)):
        check(token, "token", x.cuda())
        check(group, "group", x.cuda())
        assert group(x.cuda())[1].stride() == (1, x.shape[0])

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
    for x in (near_midpoints(256, 1024, seed=12), varied((64, 1024), torch.bfloat16, seed=13),
              with_zero_rows(varied((8, 384), torch.float16, seed=14))):
        check(fn, kind, x.cuda())
