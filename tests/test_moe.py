"""Fp8Experts on its own: per-expert bytes, routing (ragged, empty experts, top-k), padding, invariance."""

import pytest
import torch

from fp8now import Fp8Config, dequantize, quantize_activation, quantize_weight, rel_diff
from fp8now.config import WEIGHT_GROUP, Scheme
from fp8now.layers.moe import Fp8Experts

SCHEMES = ("tensor", "channel", "block")


def _weights(e, h, i, seed=0, bias=False):
    """Experts whose magnitudes differ by 40x, so a shared scale would show."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.linspace(1.0, 40.0, e).reshape(e, 1, 1) * 0.02
    w13 = (torch.randn(e, 2 * i, h, generator=g) * mag).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * mag).bfloat16()
    if not bias:
        return w13, w2, None, None
    return w13, w2, torch.randn(e, 2 * i, generator=g).bfloat16(), torch.randn(e, h, generator=g).bfloat16()


def _experts(scheme, e=6, h=128, i=192, seed=0, bias=False, gate="glu"):
    """An experts layer on the exact `reference` backend (the cpu backend's trade: test_moe_cpu.py)."""
    w13, w2, b13, b2 = _weights(e, h, i, seed, bias)
    m = Fp8Experts(e, h, i, Fp8Config(scheme=scheme, backend="reference"), bias=bias, gate=gate, act_fn=torch.nn.SiLU(),
                   limit=0.05, name="experts")
    m.load_(w13, w2, b13, b2)
    return m, (w13, w2, b13, b2)


def _pad_expert(w13e, w2e, i, ip, h, hp):
    """An independent zero-padding of one expert: gate and up halves each to ip rows, H to hp."""
    g = torch.zeros(2 * ip, hp, dtype=w13e.dtype)
    g[:i, :h], g[ip:ip + i, :h] = w13e[:i], w13e[i:]
    d = torch.zeros(hp, ip, dtype=w2e.dtype)
    d[:h, :i] = w2e
    return g, d


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_expert_equals_its_own_quantization(scheme):
    m, (w13, w2, _, _) = _experts(scheme, h=160)
    pad = 128 if scheme == "block" else 1
    ip, hp = -(-192 // pad) * pad, -(-160 // pad) * pad
    assert m.w13.shape == (6, 2 * ip, hp) and m.w2.shape == (6, hp, ip)
    scales = []
    for e in range(6):
        g, d = _pad_expert(w13[e], w2[e], 192, ip, 160, hp)
        for stored_q, stored_s, w in ((m.w13[e], m.w13_scale[e], g), (m.w2[e], m.w2_scale[e], d)):
            q, s = quantize_weight(w, scheme)
            assert torch.equal(stored_q.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(stored_s, s.reshape(stored_s.shape))
        if scheme != "block":  # padding-free schemes: the unpadded expert gives the same bytes
            assert torch.equal(m.w13[e].view(torch.uint8), quantize_weight(w13[e], scheme)[0].view(torch.uint8))
        scales.append(float(m.w13_scale[e].max()))
    assert scales[-1] > 20 * scales[0]  # per-expert scales follow the 40x magnitudes


def _reference(m, w13, w2, b13, b2, x, idx, wts, gate="glu", limit=0.05):
    """Token by token: per-token (or per-group) quantized input, dequantized weights, float64 matmuls."""
    kind = m.act_kind
    group = WEIGHT_GROUP[Scheme(m.scheme)]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    i, ip, h, hp = m.intermediate_size, m.i_pad, m.hidden_size, m.h_pad

    def mm(v, q, s, b):
        vq, vs = quantize_activation(v[None], kind)
        y = (dequantize(vq, vs, (1, 128) if kind == "group" else (1, -1)).double()
             @ dequantize(q, s, group).double().T).float()
        return (y + (0 if b is None else b.float())).to(v.dtype)[0]

    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g_w, d_w = _pad_expert(w13[e], w2[e], i, ip, h, hp)
            gq, gs = quantize_weight(g_w, m.scheme)
            dq, ds = quantize_weight(d_w, m.scheme)
            bg = None if b13 is None else torch.cat([b13[e, :i], torch.zeros(ip - i), b13[e, i:], torch.zeros(ip - i)])
            bd = None if b2 is None else torch.cat([b2[e], torch.zeros(hp - h)])
            xv = torch.cat([x[t], torch.zeros(hp - h, dtype=x.dtype)])
            hh = mm(xv, gq, gs, None if bg is None else bg.to(x.dtype))
            ga, up = hh[:ip], hh[ip:]
            if gate == "glu":
                act = torch.nn.functional.silu(ga) * up
            else:
                ga, up = ga.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * (ga * torch.sigmoid(ga * 1.702))
            y = mm(act, dq, ds, None if bd is None else bd.to(x.dtype))[:h]
            out[t] += float(wts[t, j]) * y.double()
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bias,gate", [(False, "glu"), (True, "clamped_swiglu")])
def test_forward_matches_token_by_token_reference(scheme, bias, gate):
    m, (w13, w2, b13, b2) = _experts(scheme, e=6, h=128, i=192, seed=1, bias=bias, gate=gate)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 128, generator=g).bfloat16()
    # ragged routing: expert 0 takes most tokens, experts 4 and 5 get none; top-k = 2 (one repeat)
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0], [0, 1], [2, 0], [3, 3], [0, 1], [1, 2]])
    wts = torch.rand(9, 2, generator=g)
    got = m(x, idx, wts)
    ref = _reference(m, w13, w2, b13, b2, x, idx, wts, gate)
    assert got.dtype == torch.bfloat16
    assert rel_diff(got.float(), ref.float()) < 1e-5
    assert torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_experts_without_tokens_cost_nothing(monkeypatch):
    m, _ = _experts("channel", e=8, seed=3)
    called = []
    original = m.expert_forward
    monkeypatch.setattr(m, "expert_forward", lambda e, x: called.append((e, x.shape[0])) or original(e, x))
    idx = torch.tensor([[5, 2], [5, 2], [2, 5]])
    m(torch.randn(3, 128).bfloat16(), idx, torch.rand(3, 2))
    assert sorted(called) == [(2, 3), (5, 3)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_batch_invariance(scheme):
    m, _ = _experts(scheme, e=8, seed=4)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-2, 2, 64)[:, None]).bfloat16()
    idx = torch.randint(0, 8, (64, 2), generator=g)
    wts = torch.rand(64, 2, generator=g)
    full = m(x, idx, wts)
    for rows in (slice(0, 1), slice(5, 8), slice(0, 64)):
        part = m(x[rows], idx[rows], wts[rows])
        assert torch.equal(part.view(torch.int16), full[rows].view(torch.int16))
    one = torch.stack([m(x[t:t + 1], idx[t:t + 1], wts[t:t + 1])[0] for t in (0, 17, 63)])
    assert torch.equal(one.view(torch.int16), full[[0, 17, 63]].view(torch.int16))


def test_dense_input_layout_skips_zero_rows_exactly():
    """Llama4 layout: x [E*T, H] with router-scaled rows; rows of unrouted tokens are zero."""
    e, t = 4, 5
    w13, w2, _, _ = _weights(e, 128, 128, seed=6)
    m = Fp8Experts(e, 128, 128, Fp8Config(scheme="block"), act_fn=torch.nn.SiLU(), dense_input=True)
    m.load_(w13, w2)
    x = torch.randn(e, t, 128).bfloat16()
    x[torch.rand(e, t) < 0.5] = 0
    y = m(x.reshape(e * t, 128)).reshape(e, t, 128)
    for ex in range(e):
        for r in range(t):
            one = m.expert_forward(ex, x[ex, r:r + 1])[0]
            assert torch.equal(y[ex, r], torch.zeros_like(one) if not x[ex, r].any() else one)


def test_bad_inputs_name_the_layer():
    m = Fp8Experts(4, 128, 128, Fp8Config(), act_fn=torch.nn.SiLU(), name="model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="mlp.experts.w13.*shape"):
        m.load_(torch.zeros(4, 200, 128), torch.zeros(4, 128, 128))
    m.load_(torch.zeros(4, 256, 128), torch.zeros(4, 128, 128))
    with pytest.raises(ValueError, match="expert index out of range"):
        m(torch.zeros(2, 128), torch.tensor([[0], [4]]), torch.ones(2, 1))
    per_tensor = Fp8Experts(4, 128, 128, Fp8Config(scheme="tensor", activation="tensor"), act_fn=torch.nn.SiLU())
    assert per_tensor.act_kind == "token"   # experts never share one scale over their tokens
    with pytest.raises(ValueError, match="no MoE experts kernel"):
        Fp8Experts(4, 128, 128, Fp8Config(backend="torch"), act_fn=torch.nn.SiLU())


def test_the_cpu_default_and_what_a_tensor_parallel_split_runs():
    """On CPU `auto` picks the cpu experts backend; a split layer (tp_moe) refuses the Triton kernels,
    naming the layer and the split, and runs the exact reference backend when forced to."""
    w13, w2 = torch.randn(4, 256, 128).bfloat16(), torch.randn(4, 128, 128).bfloat16()
    m = Fp8Experts(4, 128, 128, Fp8Config(), act_fn=torch.nn.SiLU(), device="cpu")
    m.load_(w13, w2)
    assert m.backend == "cpu" and m.w13_work is not None
    forced = Fp8Experts(4, 128, 128, Fp8Config(backend="triton"), act_fn=torch.nn.SiLU(), split=True,
                        name="model.layers.3.mlp.experts")
    with pytest.raises(RuntimeError, match="model.layers.3.mlp.experts: no experts backend fits on cpu; "
                                           "rejected: triton: a tensor-parallel split of the experts runs "
                                           "on cpu or reference only"):
        forced.load_(w13, w2)
    m = Fp8Experts(4, 128, 128, Fp8Config(backend="reference"), act_fn=torch.nn.SiLU(), split=True)
    m.load_(w13, w2)
    assert m.backend == "reference" and m.w13_work is None


def test_load_again_writes_in_place():
    """A second load_ (e.g. an RL weight refit) keeps every tensor object and address."""
    m, _ = _experts("block", seed=7)
    tensors = [m.w13, m.w2, m.w13_scale, m.w2_scale]
    ptrs = [t.data_ptr() for t in tensors]
    w13, w2, _, _ = _weights(6, 128, 192, seed=8)
    m.load_(w13, w2)
    assert [t.data_ptr() for t in (m.w13, m.w2, m.w13_scale, m.w2_scale)] == ptrs
    assert all(a is b for a, b in zip(tensors, (m.w13, m.w2, m.w13_scale, m.w2_scale)))
    fresh, _ = _experts("block", seed=8)
    assert torch.equal(m.w13.view(torch.uint8), fresh.w13.view(torch.uint8))
    assert torch.equal(m.w2_scale, fresh.w2_scale)
