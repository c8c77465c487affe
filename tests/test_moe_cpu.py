"""The `cpu` experts backend (Fp8Config(backend="cpu")): bf16 working copies equal to the FP8 bytes
dequantized, every expert GEMM within rel_diff 1e-4 of the exact product, whole layers and real tiny
MoE models close to the `reference` backend, reloads that rebuild the copies in place, batch invariance,
and the compiled activation quantizer giving the same logits as the torch ops."""

from __future__ import annotations

import pytest
import torch

import fp8now
from fp8now import Fp8Config, dequantize, rel_diff
from fp8now.layers import cpu_quantizer
from fp8now.config import WEIGHT_GROUP, Scheme
from fp8now.layers.moe import Fp8Experts
from fp8now.layers.moe_cpu import gemm
from fp8_oracle import varied
from moe_tiny import save_moe
from test_moe import SCHEMES, _weights


def _pair(scheme, bias=False, gate="glu", e=6, h=160, i=192, invariant=False):
    """The same weights loaded into a `cpu` and a `reference` experts layer (same FP8 bytes)."""
    w = _weights(e, h, i, seed=3, bias=bias)
    layers = {}
    for backend in ("cpu", "reference"):
        m = Fp8Experts(e, h, i, Fp8Config(scheme=scheme, backend=backend, batch_invariant=invariant), bias=bias,
                       gate=gate, act_fn=torch.nn.SiLU(), limit=0.05, name="experts")
        m.load_(*w)
        layers[backend] = m
    return layers["cpu"], layers["reference"], w


@pytest.mark.parametrize("scheme", SCHEMES)
def test_working_copies_are_the_fp8_bytes_dequantized_and_each_gemm_is_within_1e4(scheme):
    m, ref, _ = _pair(scheme)
    assert m.backend == "cpu" and ref.backend == "reference" and torch.equal(m.w13, ref.w13)
    group = WEIGHT_GROUP[Scheme(scheme)]
    for e in range(m.num_experts):
        for q, s, work in ((m.w13[e], m.w13_scale[e], m.w13_work[e]), (m.w2[e], m.w2_scale[e], m.w2_work[e])):
            assert work.dtype == torch.bfloat16 and torch.equal(work, dequantize(q, s, group).to(torch.bfloat16))
        for rows in (1, 7, 40):
            x = varied((rows, m.h_pad), torch.bfloat16, seed=e * 100 + rows, spread=3)
            got = gemm(m, x, m.w13_work[e], None)
            assert rel_diff(got, ref._gemm(x, m.w13[e], m.w13_scale[e], None)) < 1e-4
            g = varied((rows, m.i_pad), torch.bfloat16, seed=e * 100 + rows + 1, spread=3)
            assert rel_diff(gemm(m, g, m.w2_work[e], None), ref._gemm(g, m.w2[e], m.w2_scale[e], None)) < 1e-4


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bias,gate", [(False, "glu"), (True, "clamped_swiglu")])
def test_layer_is_close_to_the_reference_backend(scheme, bias, gate):
    """Ragged routing with two idle experts: the layer's output within rel_diff 1e-3 of the exact backend
    (two chained GEMMs, each within 1e-4; the second quantizes the first's bf16 output)."""
    m, ref, _ = _pair(scheme, bias, gate)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 160, generator=g).bfloat16()
    idx = torch.randint(0, 4, (12, 2), generator=g)
    wts = torch.rand(12, 2, generator=g)
    got, want = m(x, idx, wts), ref(x, idx, wts)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel_diff(got, want) < 1e-3


def test_reload_rebuilds_the_copies_in_place():
    m, _, (w13, w2, _, _) = _pair("channel")
    ptrs = (m.w13_work.data_ptr(), m.w2_work.data_ptr())
    m.load_(w13 * 2, w2 * 3)
    assert (m.w13_work.data_ptr(), m.w2_work.data_ptr()) == ptrs
    group = WEIGHT_GROUP[Scheme.CHANNEL]
    assert torch.equal(m.w13_work[2], dequantize(m.w13[2], m.w13_scale[2], group).to(torch.bfloat16))
    fresh, _, _ = _pair("channel")
    assert not torch.equal(m.w13_work, fresh.w13_work)


def test_batch_invariant_rows_whatever_the_batch():
    """A token's output is bit-identical whether its experts got one token or many."""
    m, _, _ = _pair("channel", invariant=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 160, generator=g).bfloat16()
    idx = torch.randint(0, 6, (40, 2), generator=g)
    wts = torch.rand(40, 2, generator=g)
    full = m(x, idx, wts)
    for t in (0, 17, 39):
        assert torch.equal(m(x[t:t + 1], idx[t:t + 1], wts[t:t + 1]), full[t:t + 1])


def test_a_real_moe_model_on_the_cpu_experts_backend(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE from disk: experts on the cpu backend by default and when forced (in the report),
    logits close to the exact reference backend's, the same with the compiled quantizer as with torch ops."""
    folder = save_moe("qwen3_moe", tmp_path / "q")
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    logits = {}
    for name, backend, how in (("ref", "reference", "torch"), ("torch", "auto", "torch"), ("compiled", "cpu", "compiled")):
        monkeypatch.setenv(cpu_quantizer.ENV, how)
        model, report = fp8now.load(folder, Fp8Config(scheme="channel", backend=backend), device="cpu",
                                    measure_error=False)
        assert {r.backend for r in report.experts} == {"reference" if backend == "reference" else "cpu"}
        with torch.inference_mode():
            logits[name] = model(input_ids=ids).logits.float()
    assert torch.equal(logits["compiled"], logits["torch"])
    assert rel_diff(logits["torch"], logits["ref"]) < 1e-2
    assert (logits["torch"].argmax(-1) == logits["ref"].argmax(-1)).float().mean() > 0.9
