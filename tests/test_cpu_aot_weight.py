"""The compiled CPU weight quantizer (kernels.cpu_aot_weight, built by AOTInductor with this machine's C++
compiler): its values against the group-by-group oracle, its bytes against numerics' on fresh weights of
odd sizes, its working copy and error sums against their definitions, NaN/Inf refused by name, whole loads
and reloads that give the same model as the torch-ops quantizer, and when `auto` builds it."""

from __future__ import annotations

import math

import pytest
import torch

from fp8now import Fp8Config, load, reload_weights
from fp8now.cache import cache_root
from fp8now.config import Scheme
from fp8now.kernels import cpu_aot_weight
from fp8now.layers import cpu_quantizer
from fp8now.layers.linear import Fp8Linear
from fp8now.numerics import quantize_weight
from fp8_oracle import quantize_loops, varied
from tiny import write_tiny_checkpoint

GROUPS = {"tensor": (-1, -1, "tensor"), "channel": (1, -1, "row"), "block": (128, 128, "block")}


def compiled(scheme: str, dtype: torch.dtype = torch.bfloat16) -> cpu_aot_weight.Quantizer:
    """The quantizer from the real cache folder (built there on first use, then shared by the tests)."""
    quantizer, note = cpu_quantizer.library("weight", Scheme(scheme), dtype, str(cache_root() / cpu_quantizer.SUBDIR))
    assert quantizer is not None, note
    return quantizer


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 300), (130, 257), (256, 384)])
def test_values_bytes_working_copy_and_sums(scheme, n, k):
    """Fresh varied weights (zero rows, zero values, sizes off multiples of 128): values and scales of the
    group-by-group oracle, numerics' bytes (the sign of zeros too), bf16(q * s), and the seven sums from
    their definitions in float64."""
    w = varied((n, k), seed=n * k + len(scheme), spread=10)
    w[n // 2] = 0
    w[0, : k // 3] = 0
    q, s, work, stats = compiled(scheme)(w)
    gr, gc, rule = GROUPS[scheme]
    want_q, want_s = quantize_loops(w, gr, gc, rule)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k) and torch.equal(q.double(), want_q)
    assert torch.equal(s.reshape(want_s.shape), want_s)
    ref_q, ref_s = quantize_weight(w, scheme)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    spread = want_s.double().repeat_interleave(n if gr == -1 else gr, 0)[:n]
    spread = spread.repeat_interleave(k if gc == -1 else gc, 1)[:, :k]
    b = want_q * spread                                    # the dequantized weight, exact in float64
    assert torch.equal(work, (want_q.float() * spread.float()).to(torch.bfloat16))
    a = w.double()
    nonzero, flushed = a != 0, (a != 0) & (want_q == 0)
    groups = [(slice(i, i + (n if gr == -1 else gr)), slice(j, j + (k if gc == -1 else gc)))
              for i in range(0, n, n if gr == -1 else gr) for j in range(0, k, k if gc == -1 else gc)]
    worst = max(float(flushed[g].sum()) / max(float(nonzero[g].sum()), 1.0) for g in groups)
    want = torch.tensor([(a * a).sum(), (b * b).sum(), (a * b).sum(), ((b - a) ** 2).sum(), flushed.sum(),
                         nonzero.sum(), worst], dtype=torch.float64)
    assert torch.allclose(stats, want, rtol=1e-12, atol=1e-300)


def test_fp16_weights_and_the_check():
    """fp16 weights get their own library (the check covers every fp16 value up to 448); a quantizer that
    differs in one byte is refused, naming what differed."""
    w = varied((70, 200), torch.float16, seed=3, spread=4)
    q, s, work, _ = compiled("channel", torch.float16)(w)
    ref_q, ref_s = quantize_weight(w, "channel")
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)

    real = compiled("channel")

    def one_byte_off(w, name=None):
        q, s, work, stats = real(w, name)
        q = q.clone()
        q.view(torch.uint8)[0, 0] ^= 1
        return q, s, work, stats
    why = cpu_aot_weight.check(one_byte_off, "channel", torch.bfloat16)
    assert why is not None and "the bytes differ" in why


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_nonfinite_weight_is_refused_by_name(bad, scheme):
    w = varied((130, 140), seed=1)
    w[129, 139] = bad
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj'.*NaN or Inf"):
        compiled(scheme)(w, "model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_load_and_reload_match_the_torch_ops(tmp_path, monkeypatch, scheme):
    """A real tiny Llama loaded with the compiled weight quantizer and with torch ops: the same bytes, scales
    and working copies in every layer, error figures equal to 1e-7 (the torch path rounds block weights'
    products to float32 before its float64 sums; the compiled one does not); then a reload of other weights through
    the compiled quantizer gives the bytes of a fresh load of those weights."""
    folder = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=0)
    other = write_tiny_checkpoint(tmp_path / "other", "llama", seed=1)
    compiled(scheme)                                        # built before the load (auto builds big loads only)
    models = {}
    for how in ("auto", "torch"):
        monkeypatch.setenv(cpu_quantizer.ENV, how)
        models[how] = load(folder, Fp8Config(scheme=scheme), device="cpu")
    (fast, fast_report), (slow, slow_report) = models["auto"], models["torch"]
    assert fast_report.cpu_weight_quantizer.startswith("bfloat16: compiled")
    assert slow_report.cpu_weight_quantizer.startswith("bfloat16: torch ops")
    _same_layers(fast, slow)
    for a, b in zip(fast_report.layers, slow_report.layers):
        assert math.isclose(a.sqnr_db, b.sqnr_db, rel_tol=1e-7) and math.isclose(a.rel_diff, b.rel_diff, rel_tol=1e-5)
        assert (a.zero_flushed, a.worst_group_flushed) == (b.zero_flushed, b.worst_group_flushed)
    monkeypatch.setenv(cpu_quantizer.ENV, "auto")
    from safetensors.torch import load_file
    reload_weights(fast, load_file(str(other / "model.safetensors")))
    monkeypatch.setenv(cpu_quantizer.ENV, "torch")
    _same_layers(fast, load(other, Fp8Config(scheme=scheme), device="cpu")[0])


def _same_layers(a: torch.nn.Module, b: torch.nn.Module) -> None:
    layers_b = dict(b.named_modules())
    for name, layer in a.named_modules():
        if isinstance(layer, Fp8Linear):
            other = layers_b[name]
            assert torch.equal(layer.weight.view(torch.uint8), other.weight.view(torch.uint8)), name
            assert torch.equal(layer.weight_scale, other.weight_scale), name
            assert layer.backend == "cpu" and torch.equal(layer._work, other._work), name   # the working copies


def test_auto_builds_only_for_big_loads(tmp_path, monkeypatch):
    """`auto` in an empty cache: a small load runs torch ops and says why (nothing built); the threshold and
    `compiled` build it."""
    monkeypatch.setenv("FP8NOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_quantizer.ENV, "auto")
    get = cpu_quantizer.weight_quantizer("tensor", 10 << 20)
    quantizer, note = get(torch.bfloat16)
    assert quantizer is None and "not built" in note and "FP8NOW_CPU_QUANTIZER=compiled builds it" in note
    assert not (tmp_path / "cache" / cpu_quantizer.SUBDIR).exists()
    monkeypatch.setenv(cpu_quantizer.ENV, "torch")
    assert cpu_quantizer.weight_quantizer("tensor", 1 << 40)(torch.bfloat16)[0] is None


def test_moe_experts_load_matches_the_torch_ops(tmp_path, monkeypatch):
    """A real tiny Qwen3-MoE (per-expert tensors on disk): the compiled quantizer gives every expert's bytes,
    scales and working copies of the torch ops, and the experts' SQNR figures to 1e-7."""
    from fp8now.layers.moe import Fp8Experts

    from moe_tiny import save_moe

    folder = save_moe("qwen3_moe", tmp_path / "moe")
    compiled("channel")
    out = {}
    for how in ("auto", "torch"):
        monkeypatch.setenv(cpu_quantizer.ENV, how)
        out[how] = load(folder, Fp8Config(), device="cpu")
    (fast, fast_report), (slow, slow_report) = out["auto"], out["torch"]
    assert fast_report.cpu_weight_quantizer.startswith("bfloat16: compiled")
    layers = [(a, b) for a, b in zip(fast.modules(), slow.modules()) if isinstance(a, Fp8Experts)]
    assert layers
    for a, b in layers:
        for leaf in ("w13", "w2"):
            assert torch.equal(getattr(a, leaf).view(torch.uint8), getattr(b, leaf).view(torch.uint8))
            assert torch.equal(getattr(a, leaf + "_scale"), getattr(b, leaf + "_scale"))
            assert torch.equal(getattr(a, leaf + "_work"), getattr(b, leaf + "_work"))
    for a, b in zip(fast_report.experts, slow_report.experts):
        assert math.isclose(a.min_sqnr_db, b.min_sqnr_db, rel_tol=1e-7)
        assert math.isclose(a.median_sqnr_db, b.median_sqnr_db, rel_tol=1e-7)
