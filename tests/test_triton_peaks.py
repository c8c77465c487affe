"""kernels.triton_peaks (max |x| of many tensors per launch) against torch's own max of |x| on fresh random tensors:
every dtype, sizes across the chunk and block edges, NaN and infinities anywhere, empty tensors; and FiniteCheck's
batched path naming the bad tensor as the one-tensor path does. On the CPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fp8now.kernels import triton_peaks  # noqa: E402
from fp8now.layers.finite import FiniteCheck  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(t: torch.Tensor) -> float:
    """max |t| in float32 with NaN propagated (torch.max does), 0 for an empty tensor."""
    return float(t.float().abs().max()) if t.numel() else 0.0


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 blocks, so that a few thousand elements cross several programs and a ragged last chunk."""
    monkeypatch.setattr(triton_peaks, "CHUNK", 3 * triton_peaks.BLOCK)


def _same(got: torch.Tensor, want: list[float]) -> None:
    assert got.dtype == torch.float32 and got.shape == (len(want),)
    for g, w in zip(got.cpu().tolist(), want):
        assert (g != g and w != w) or g == w, (g, w)


@pytest.mark.parametrize("seed", [0, 1])
def test_peaks_equal_torchs_max_of_abs(small_chunks, seed):
    g = torch.Generator().manual_seed(seed)
    block = triton_peaks.BLOCK
    sizes = [1, block - 1, block, 3 * block, 3 * block + 1, 7 * block + 5, int(torch.randint(1, 20000, (1,), generator=g))]
    tensors = []
    for i, n in enumerate(sizes):
        dtype = triton_peaks.DTYPES[i % 3]
        tensors.append((torch.randn(n, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))).to(dtype))
    tensors.append(torch.empty(0, dtype=torch.bfloat16))
    tensors.append(torch.randn(3, 5, 7, generator=g).to(torch.float16))   # any shape: its elements
    tensors = [t.to(DEVICE) for t in tensors]
    _same(triton_peaks.peaks(tensors), [_reference(t) for t in tensors])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinities_are_found_in_any_chunk(small_chunks, bad):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5 * triton_peaks.BLOCK + 3, generator=g).to(dt).to(DEVICE) for dt in triton_peaks.DTYPES]
    for t in tensors:
        t[int(torch.randint(0, t.numel(), (1,), generator=g))] = bad   # NaN in the middle of finite values
    got = triton_peaks.peaks(tensors).cpu().tolist()
    for v in got:
        assert (v != v) if bad != bad else v == float("inf")


def test_refuses_a_strided_tensor():
    t = torch.randn(8, 8, device=DEVICE).t()
    assert not triton_peaks.usable(t)
    with pytest.raises(ValueError, match="contiguous"):
        triton_peaks.peaks([torch.randn(4, device=DEVICE), t])


@pytest.mark.gpu   # FiniteCheck batches CUDA tensors only (CPU ones take aminmax)
def test_finite_check_batched_names_the_bad_tensor_and_warns_beyond_fp16():
    tensors = [(torch.randn(1000, device=DEVICE, dtype=torch.bfloat16), f"t{i}", True) for i in range(5)]
    tensors[3][0][17] = 1e30
    check = FiniteCheck()
    check.add_many(tensors, label="tensor {!r}")   # names go into their messages only there
    warnings = check.raise_if_bad()
    assert len(warnings) == 1 and warnings[0].startswith("tensor 't3' holds a value of magnitude 1e+30")
    tensors[1][0][5] = float("nan")
    check.add_many(tensors, label="tensor {!r}")
    with pytest.raises(ValueError, match="^tensor 't1' contains NaN or Inf"):
        check.raise_if_bad()


def test_finite_check_many_on_the_cpu_as_one_by_one():
    g = torch.Generator().manual_seed(5)
    tensors = [(torch.randn(300, generator=g).to(dt), f"x{i}", i != 2)
               for i, dt in enumerate([torch.bfloat16, torch.float16, torch.bfloat16, torch.float32])]
    tensors[2][0][7] = 7e4   # beyond fp16's largest value but warn=False: not warned
    tensors[3][0][0] = -7e4
    check = FiniteCheck()
    check.add_many([*tensors, (torch.arange(4), "ints", True)], label="tensor {!r}")   # integers: not checked
    warnings = check.raise_if_bad()
    assert len(warnings) == 1 and warnings[0].startswith("tensor 'x3' holds a value of magnitude 7e+04")


@pytest.mark.gpu   # the batched path of nonfinite_slices (CUDA tensors); the CPU's isfinite path is the reference
def test_nonfinite_slices_on_the_gpu_name_the_expert_and_half_as_on_the_cpu():
    from fp8now.layers.finite import nonfinite_slices

    g = torch.Generator().manual_seed(11)
    w13 = torch.randn(6, 2 * 40, 32, generator=g).to(torch.bfloat16)
    w2 = torch.randn(6, 32, 40, generator=g).to(torch.bfloat16)
    w13[2, 45, 3] = float("nan")    # expert 2, up half
    w13[4, 1, 0] = float("inf")     # expert 4, gate half
    w2[5, 31, 39] = -float("inf")
    given = {"w13": w13, "w2": w2}
    want = nonfinite_slices(given, {"w13": 2})
    assert want == [("w13", 2, 1), ("w13", 4, 0), ("w2", 5, 0)]
    assert nonfinite_slices({k: t.to(DEVICE) for k, t in given.items()}, {"w13": 2}) == want
