"""kernels.llmc (llm-compressor's rules) against compressed-tensors itself on fresh random weights: its scale computation
(`calculate_qparams`, from the per-group min/max llm-compressor's observer takes) and its `quantize`, the
code llm-compressor runs for FP8_DYNAMIC and FP8_BLOCK. Edge cases: all-zero rows and tiles, magnitudes
spread over many decades, fp16 amaxes whose scale underflows, bf16/fp16/fp32 weights, partial tiles."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from fp8now import Fp8Config
from fp8now.kernels import llmc as numerics_llmc
from fp8now.config import WEIGHT_NUMERICS
from fp8now.kernels import quantize_weight as dispatched

PRESET = {"channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ct_reference(w: torch.Tensor, scheme: str, float32_division: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8 bytes and scale of `w` (the scale from llm-compressor's per-group min/max);
    `float32_division`: quantize float32 copies (its Triton kernel's arithmetic, run with its torch ops)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    args = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[PRESET[scheme]]).weights
    rows, cols = w.shape
    if scheme == "channel":
        x = w
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        x = maybe_pad_tensor_for_block_quant(w, (128, 128))
        tiles = x.reshape(x.shape[0] // 128, 128, x.shape[1] // 128, 128)
        lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    scale, _ = calculate_qparams(lo, hi, args)
    if float32_division:
        q = quantize(x.float(), scale.float(), None, args, dtype=torch.float8_e4m3fn)
    else:
        q = quantize(x, scale, None, args, dtype=torch.float8_e4m3fn)
    return q[:rows, :cols], scale


def random_weight(g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] with row magnitudes over ~e^±6, some all-zero rows and a zero tile when it has one."""
    n, k = (int(v) for v in torch.randint(1, 300, (2,), generator=g))
    w = torch.randn(n, k, generator=g) * torch.exp(2.0 * torch.randn(n, 1, generator=g))
    w[torch.rand(n, generator=g) < 0.05] = 0.0
    if n >= 128 and k >= 128:
        w[:128, :128] = 0.0
    if dtype is torch.float16:   # rows whose amax / 448 underflows fp16 (the scale then becomes eps)
        w[torch.rand(n, generator=g) < 0.1] *= 1e-6
    return w.to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numerics", ["llm-compressor", "llm-compressor-triton"])
def test_bytes_and_scales_equal_compressed_tensors(scheme, dtype, numerics):
    g = torch.Generator().manual_seed(zlib.crc32(f"{scheme} {dtype} {numerics}".encode()))
    moved = 0
    for _ in range(12):
        w = random_weight(g, dtype)
        q, s = numerics_llmc.quantize_weight(w, scheme, numerics)
        ref_q, ref_s = ct_reference(w, scheme, float32_division=numerics.endswith("triton"))
        assert same_bytes(s, ref_s) and same_bytes(q, ref_q), (tuple(w.shape), dtype)
        moved += int((q.view(torch.uint8) != ct_reference(w, scheme, not numerics.endswith("triton"))[0]
                      .view(torch.uint8)).sum())
    assert (moved > 0) == (dtype is not torch.float32)   # the paths differ where the dtype rounds the quotient


def test_zero_groups_get_the_dtype_eps_not_zero():
    w = torch.zeros(130, 260, dtype=torch.bfloat16)
    w[129, 259] = 3.0
    q, s = numerics_llmc.quantize_weight(w, "block")
    assert s.dtype == torch.bfloat16 and s.shape == (2, 3)
    assert s[0, 0].item() == 2.0 ** -7 and s[1, 2].item() == pytest.approx(3.0 / 448, rel=2 ** -8)
    assert q.float().abs().sum().item() == 448.0


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_chunking_and_stacking_do_not_change_bytes(scheme):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 300, 200, generator=g).to(torch.bfloat16)
    whole = [numerics_llmc.quantize_weight(w[e], scheme) for e in range(3)]
    stacked_q, stacked_s = numerics_llmc.quantize_weight(w, scheme, chunk_bytes=4 * 200 * 128)
    for e, (q, s) in enumerate(whole):
        assert same_bytes(stacked_q[e], q) and same_bytes(stacked_s[e], s)
        assert same_bytes(q, ct_reference(w[e], scheme)[0])


@pytest.mark.parametrize("scheme, split", [("channel", 70), ("block", 128)])
def test_a_shard_with_the_groups_amax_gives_the_slice_of_the_whole(scheme, split):
    """Tensor parallelism (SPEC §6): a row-parallel shard quantized with the full weight's group amax."""
    from fp8now.numerics import weight_amax

    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=g).to(torch.bfloat16)
    q, s = numerics_llmc.quantize_weight(w, scheme)
    amax = weight_amax(w, scheme)
    if scheme == "channel":
        part_q, part_s = numerics_llmc.quantize_weight(w[:, split:], scheme, amax=amax)
        assert same_bytes(part_s, s)
    else:
        part_q, part_s = numerics_llmc.quantize_weight(w[:, split:], scheme, amax=amax[:, split // 128:])
        assert same_bytes(part_s, s[:, split // 128:])
    assert same_bytes(part_q, q[:, split:])


def test_the_load_time_dispatch_runs_the_chosen_numerics():
    w = (torch.randn(64, 96) * 0.1).to(torch.bfloat16)
    q, s = dispatched(w, Fp8Config().scheme, "layer", "llm-compressor")
    assert same_bytes(q, ct_reference(w, "channel")[0]) and s.dtype == torch.bfloat16
    q_spec, s_spec = dispatched(w, Fp8Config().scheme, "layer")
    assert s_spec.dtype == torch.float32 and not torch.equal(s_spec, s.float())


def test_bad_input_is_named():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    w[3, 4] = math.nan
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.up_proj'.*NaN or Inf"):
        numerics_llmc.quantize_weight(w, "channel", name="model.layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="FP8_DYNAMIC.*FP8_BLOCK.*not 'tensor'"):
        numerics_llmc.quantize_weight(w.nan_to_num(), "tensor")
    with pytest.raises(ValueError, match="scheme 'tensor'.*weight_numerics='spec'"):
        Fp8Config(scheme="tensor", weight_numerics="llm-compressor")
    with pytest.raises(ValueError, match="moe_scheme 'tensor'"):
        Fp8Config(scheme="channel", moe_scheme="tensor", weight_numerics="llm-compressor")
    with pytest.raises(ValueError, match="unknown weight_numerics 'llmc'; valid: spec, llm-compressor"):
        Fp8Config(weight_numerics="llmc")
    assert set(WEIGHT_NUMERICS) == {"spec", *numerics_llmc.DIVISION}


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_gpu_bytes_equal_compressed_tensors_on_the_gpu(scheme):
    """On CUDA, compressed-tensors itself picks its Triton kernel (compute capability >= 9, Triton
    installed) or its torch ops: fp8now's matching numerics give its bytes there, and the torch-ops
    numerics give the CPU bytes on the GPU too."""
    from compressed_tensors.utils.triton import HAS_TRITON

    kernel = HAS_TRITON and torch.cuda.get_device_capability() >= (9, 0)
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        for _ in range(6):
            w = random_weight(g, dtype)
            cpu_q, cpu_s = numerics_llmc.quantize_weight(w, scheme)
            ref_q, ref_s = ct_reference(w.cuda(), scheme)   # its own dispatch, on the GPU
            q, s = dispatched(w.cuda(), Fp8Config(scheme=scheme).scheme, "w",
                              "llm-compressor-triton" if kernel else "llm-compressor")
            assert same_bytes(s.cpu(), ref_s.cpu()) and same_bytes(q.cpu(), ref_q.cpu()), (tuple(w.shape), dtype)
            q, s = dispatched(w.cuda(), Fp8Config(scheme=scheme).scheme, "w", "llm-compressor")
            assert same_bytes(q.cpu(), cpu_q) and same_bytes(s.cpu(), cpu_s)
