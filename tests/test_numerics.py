"""numerics.py against the independent loop oracle: FP8 bytes and scales must match exactly."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8now.config import WEIGHT_GROUP, Scheme
from fp8now.numerics import (dequantize, quantize_activation, quantize_weight, rel_diff,
                             scale_from_amax, sqnr)
from fp8_oracle import FMAX, quantize_loops, round_fp8, varied

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHT_RULES = {Scheme.TENSOR: (-1, -1, "tensor"), Scheme.CHANNEL: (1, -1, "row"),
                Scheme.BLOCK: (128, 128, "block")}
ACT_RULES = {"token": (1, -1, "row"), "tensor": (-1, -1, "tensor"), "group": (1, 128, "group")}


def hard_cases(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Varied magnitudes plus the awkward cases: outliers, a zero row, a zero tile, huge and tiny values."""
    x = varied((rows, cols), torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    big = 6e4 if dtype == torch.float16 else 3e5  # beyond FMAX, inside the dtype
    if rows >= 4 and cols >= 4:
        x[0, :] = 0.0                                       # all-zero row
        x[1, 3] = big                                       # outlier
        x[2, :] = torch.randn(cols, generator=g) * 1e-7     # tiny, subnormal range after scaling
        x[-1, -1] = -big
    if rows > 130 and cols > 130:
        x[128:, 128:256] = 0.0                              # all-zero tile (and group)
    return x.to(dtype)


def as_float(q: torch.Tensor) -> torch.Tensor:
    return q.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (130, 260), (257, 384)])
def test_weight_matches_loops(scheme, dtype, shape):
    w = hard_cases(*shape, dtype, seed=sum(shape))
    q, s = quantize_weight(w, scheme)
    gr, gc, rule = WEIGHT_RULES[scheme]
    q_ref, s_ref = quantize_loops(w, gr, gc, rule)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    expected_shape = {Scheme.TENSOR: (), Scheme.CHANNEL: (shape[0], 1),
                      Scheme.BLOCK: (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))}[scheme]
    assert tuple(s.shape) == expected_shape and s.dtype == torch.float32
    assert torch.equal(s.reshape(s_ref.shape), s_ref)
    assert torch.equal(as_float(q), q_ref)
    assert not torch.isnan(q.float()).any() and not torch.isnan(s).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["token", "tensor", "group"])
@pytest.mark.parametrize("shape", [(7,), (2, 3, 200), (5, 384), (4, 1, 130)])
def test_activation_matches_loops(kind, dtype, shape):
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    x = hard_cases(max(rows, 3), cols, dtype, seed=cols)[:rows].reshape(shape)
    q, s = quantize_activation(x, kind)
    gr, gc, rule = ACT_RULES[kind]
    q_ref, s_ref = quantize_loops(x.reshape(rows, cols), gr, gc, rule)
    expected_shape = {"token": (rows, 1), "tensor": (), "group": (rows, math.ceil(cols / 128))}[kind]
    assert tuple(s.shape) == expected_shape
    assert q.shape == (rows, cols)
    assert torch.equal(s.reshape(s_ref.shape), s_ref)
    assert torch.equal(as_float(q), q_ref)


def test_torch_cast_is_round_to_nearest_even():
    """The cast numerics relies on equals an independent table rounding, ties and subnormals included."""
    table = torch.tensor([0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9 * 1.5, 1.0625, 1.1875, 17.0, 19.0,
                          440.0, 447.9, 448.0], dtype=torch.float32)
    rand = varied((64, 64), torch.float32, seed=3).clamp(-FMAX, FMAX).flatten()
    x = torch.cat([table, -table, rand])
    assert torch.equal(x.to(torch.float8_e4m3fn).double(), round_fp8(x.double()))


def test_row_weight_equals_token_activation():
    """SPEC §4: a channel-quantized weight row is bit-identical to the per-token quantizer on that row."""
    w = varied((33, 300), seed=5)
    qw, sw = quantize_weight(w, "channel")
    qa, sa = quantize_activation(w, "token")
    assert torch.equal(qw.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(sw, sa)


@pytest.mark.parametrize("scheme", list(Scheme))
def test_chunked_equals_unchunked(scheme):
    w = hard_cases(300, 260, torch.bfloat16, seed=11)
    q1, s1 = quantize_weight(w, scheme)
    for chunk in (4 * 260, 4 * 260 * 128, 4 * 260 * 129):  # 1 row, 128 rows, odd sizes
        q2, s2 = quantize_weight(w, scheme, chunk_bytes=chunk)
        assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(s1, s2)


@pytest.mark.parametrize("scheme", list(Scheme))
def test_stacked_experts(scheme):
    w = torch.stack([varied((200, 130), seed=e) for e in range(3)])
    q, s = quantize_weight(w, scheme)
    lead = {Scheme.TENSOR: (3,), Scheme.CHANNEL: (3, 200, 1), Scheme.BLOCK: (3, 2, 2)}[scheme]
    assert tuple(s.shape) == lead
    for e in range(3):
        qe, se = quantize_weight(w[e], scheme)
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8))
        assert torch.equal(s[e], se)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("scheme", list(Scheme))
def test_nonfinite_weight_raises(scheme, bad):
    w = varied((40, 70), torch.float32, seed=1)
    w[17, 5] = bad
    with pytest.raises(ValueError, match=r"layers\.3\.mlp.*\(40, 70\).*NaN or Inf"):
        quantize_weight(w, scheme, name="layers.3.mlp")


def test_zero_tensor_scales_are_finite():
    for scheme in Scheme:
        q, s = quantize_weight(torch.zeros(130, 140), scheme)
        assert torch.isfinite(s).all() and (s > 0).all() and not q.float().any()
    for kind in ("token", "tensor", "group"):
        q, s = quantize_activation(torch.zeros(3, 140, dtype=torch.bfloat16), kind)
        assert torch.isfinite(s).all() and (s > 0).all() and not q.float().any()


@pytest.mark.parametrize("scheme", list(Scheme))
def test_dequantize_roundtrip_error(scheme):
    """Relative error of one e4m3 rounding is at most 2^-4 for values in the normal range."""
    w = varied((256, 384), torch.float32, seed=7, spread=2)
    q, s = quantize_weight(w, scheme)
    back = dequantize(q, s, WEIGHT_GROUP[scheme])
    assert back.dtype == torch.float32 and back.shape == w.shape
    normal = (q.float().abs() >= 2.0 ** -6)
    err = (back - w).abs()[normal] / w.abs()[normal]
    assert float(err.max()) <= 2.0 ** -4 + 1e-6
    assert sqnr(w, back) > 28.0


def test_scale_rules_match_spec_formulas():
    amax = torch.tensor([0.0, 1e-12, 3e-6, 1.0, 448.0, 1e5])
    f = 448.0
    assert torch.equal(scale_from_amax(amax, "row"), torch.maximum(amax / f, torch.tensor(1 / (f * 512))))
    t = scale_from_amax(amax, "tensor")
    assert float(t[0]) == pytest.approx(1 / (f * 512)) and torch.equal(t[1:], amax[1:] / f)
    assert torch.equal(scale_from_amax(amax, "block"), amax.clamp_min(1e-4) / f)
    assert torch.equal(scale_from_amax(amax, "group"), amax.clamp_min(1e-10) / f)


def test_metrics():
    a = torch.randn(1000, dtype=torch.float64)
    assert rel_diff(a, a) == pytest.approx(0.0, abs=1e-15)
    assert rel_diff(a, -a) == pytest.approx(2.0)
    noisy = a + 0.01 * torch.randn(1000, dtype=torch.float64)
    assert 0 < rel_diff(a, noisy) < 1e-3
    assert sqnr(a, noisy) == pytest.approx(40.0, abs=1.5)
    assert math.isnan(rel_diff(a, torch.full_like(a, float("nan"))))
    assert sqnr(a, a) == math.inf


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), log_mag=st.integers(-20, 20),
       kind=st.sampled_from(["token", "tensor", "group"]), seed=st.integers(0, 2 ** 16))
def test_activation_property(rows, cols, log_mag, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 2.0 ** log_mag).to(torch.bfloat16)
    q, s = quantize_activation(x, kind)
    gr, gc, rule = ACT_RULES[kind]
    q_ref, s_ref = quantize_loops(x, gr, gc, rule)
    assert torch.equal(s.reshape(s_ref.shape), s_ref)
    assert torch.equal(q.double(), q_ref)
    assert float(q.float().abs().max()) <= FMAX
