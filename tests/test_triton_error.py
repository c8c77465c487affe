"""The one-pass Triton weight-error sums (kernels/triton_error.py) against independent float64 sums on the CPU.

The reference here is written from the definitions (numpy-free torch float64 on the CPU, whole tensors): the
seven figures the load report is built from. On a GPU the kernel runs there; without one, in Triton's
interpreter on tiny shapes. The FP8 bytes and scales come from `numerics.quantize_weight` (the SPEC's), with
zeros, negative zeros and values that flush to zero planted in the weight.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fp8now import numerics  # noqa: E402
from fp8now.config import Scheme  # noqa: E402
from fp8now.kernels import triton_error, triton_quant  # noqa: E402
from fp8now.layers import weight_error  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if triton_quant.available(DEVICE) is not None:
    pytest.skip(f"Triton unavailable: {triton_quant.available(DEVICE)}", allow_module_level=True)


def reference(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scheme: Scheme) -> list[float]:
    """The seven sums from their definitions, float64 on the CPU."""
    a = w.cpu().double()
    qd = q.cpu().double()
    n, k = a.shape
    if scheme is Scheme.BLOCK:   # numerics.dequantize: q x scale in float32
        full = s.cpu().float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        b = (q.cpu().float() * full).double()
    else:
        b = qd * s.cpu().double().reshape(-1, 1) if scheme is Scheme.CHANNEL else qd * s.cpu().double().reshape(())
    nonzero = a != 0
    flushed = nonzero & (qd == 0)
    if scheme is Scheme.CHANNEL:
        groups = [(flushed[r], nonzero[r]) for r in range(n)]
    elif scheme is Scheme.BLOCK:
        groups = [(flushed[i:i + 128, j:j + 128], nonzero[i:i + 128, j:j + 128])
                  for i in range(0, n, 128) for j in range(0, k, 128)]
    else:
        groups = [(flushed, nonzero)]
    worst = max(int(f.sum()) / max(int(z.sum()), 1) for f, z in groups)
    return [float((a * a).sum()), float((b * b).sum()), float((a * b).sum()), float(((b - a) ** 2).sum()),
            float(flushed.sum()), float(nonzero.sum()), worst]


def planted(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random weights with exact zeros, negative zeros and tiny values that FP8 flushes to zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    pick = torch.rand(n, k, generator=g)
    w[pick < 0.05] = 0.0
    w[(pick >= 0.05) & (pick < 0.08)] = -0.0
    w[(pick >= 0.08) & (pick < 0.15)] *= 1e-6          # below the smallest FP8 step of most groups
    w[: max(1, n // 5)] *= 1e3                         # a row band (and block tiles) with a larger scale
    return w.to(dtype)


SHAPES = [(5, 40), (130, 260), (256, 129)] if DEVICE.type == "cpu" else [(5, 40), (130, 260), (4096, 1000),
                                                                          (1024, 4096)]


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_one_pass_sums_equal_their_definitions(scheme, dtype, shape):
    w = planted(*shape, dtype, seed=hash((scheme.value, str(dtype), shape)) % 1000)
    q, s = numerics.quantize_weight(w, scheme)
    got = triton_error.error_stats(w.to(DEVICE), q.to(DEVICE), s.to(DEVICE), scheme).cpu().tolist()
    want = reference(w, q, s, scheme)
    for i, (g, r) in enumerate(zip(got, want)):
        assert g == pytest.approx(r, rel=1e-9, abs=1e-300), (i, got, want)
    assert want[4] > 0 and 0 < want[6] <= 1   # the planted values did flush


@pytest.mark.gpu   # the dispatch to the Triton pass happens on FP8 GPUs
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_gpu_load_measures_with_the_pass_and_the_figures_match_the_torch_chunks(scheme):
    w = planted(512, 384, torch.bfloat16, seed=3).to(DEVICE)
    q, s = numerics.quantize_weight(w, scheme)
    one = weight_error.error_stats(w, q, s, scheme)                     # the Triton pass
    chunked = weight_error.error_stats(w, q, s, scheme, chunk_bytes=1 << 16)   # torch ops in chunks
    assert torch.allclose(one, chunked, rtol=1e-9, atol=0)


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_torch_chunks_equal_the_definitions_too(scheme, dtype):
    """The path CPUs (and GPUs without Triton) take: torch float64 ops in row chunks small enough that this
    shape needs several."""
    w = planted(300, 260, dtype, seed=11)
    q, s = numerics.quantize_weight(w, scheme)
    got = weight_error.error_stats(w, q, s, scheme, chunk_bytes=128 * 260 * 8).tolist()
    for i, (g, r) in enumerate(zip(got, reference(w, q, s, scheme))):
        assert g == pytest.approx(r, rel=1e-9, abs=1e-300), i


@pytest.mark.parametrize("scheme", list(Scheme))
def test_stacked_experts_in_one_launch_equal_each_experts_definitions(scheme):
    """Experts [E, N, K] measured in one launch (N a multiple of the program's rows or tile): each expert's seven
    figures as its own weight's definitions give them; a row count that would cross experts is refused."""
    n = 128 if scheme is Scheme.BLOCK else 16
    w = torch.stack([planted(n, 136, torch.bfloat16, seed=20 + e) * (1 + 3 * e) for e in range(3)])
    q, s = numerics.quantize_weight(w, scheme)
    got = triton_error.error_stats_stacked(w.to(DEVICE), q.to(DEVICE), s.to(DEVICE), scheme).cpu()
    assert got.shape == (3, 7)
    for e in range(3):
        want = reference(w[e], q[e], s[e], scheme)
        for i, (g, r) in enumerate(zip(got[e].tolist(), want)):
            assert g == pytest.approx(r, rel=1e-9, abs=1e-300), (e, i, got[e], want)
    odd = w[:, : n - 8 if scheme is Scheme.BLOCK else n - 3]
    assert not triton_error.stacked(odd.shape[1], scheme)
    with pytest.raises(ValueError, match="do not fill whole programs"):
        triton_error.error_stats_stacked(odd.contiguous(), q[:, :odd.shape[1]].contiguous(), s, scheme)


@pytest.mark.gpu   # experts measured at load on an FP8 GPU take the stacked pass
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_gpu_experts_load_measures_stacked_and_matches_the_torch_chunks(scheme):
    w = torch.stack([planted(256, 384, torch.bfloat16, seed=30 + e) for e in range(4)]).to(DEVICE)
    q, s = numerics.quantize_weight(w, scheme)
    one = weight_error.error_stats(w, q, s, scheme)
    chunked = weight_error.error_stats(w, q, s, scheme, chunk_bytes=1 << 16)
    assert one.shape == (4, 7) and torch.allclose(one, chunked, rtol=1e-9, atol=0)
