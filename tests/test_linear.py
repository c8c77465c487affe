"""Fp8Linear against the float64 product of its own operands and against the bf16 layer."""

import pytest
import torch

from fp8now import Fp8Config, Fp8Linear, Scheme, rel_diff, sqnr
from fp8now.config import ACT_GROUP, WEIGHT_GROUP
from fp8now.kernels import pick_backend
from fp8now.numerics import quantize_activation
from fp8_oracle import exact_product, varied

# SQNR floors (dB) against the bf16 layer, on inputs whose magnitudes vary by up to 2^±3 across rows
# and 128-tiles. One e4m3 rounding (3 mantissa bits) gives ~31 dB on such data; the product of two
# independently rounded operands adds the two noise powers (~28 dB). Per-tensor weight scales lose
# extra bits on the small rows (some fall into the subnormal range), hence a lower floor for `tensor`.
SQNR_FLOOR = {Scheme.TENSOR: 22.0, Scheme.CHANNEL: 26.0, Scheme.BLOCK: 26.0}
BACKENDS = ["reference", "cpu", "torch"]


def make_linear(n, k, bias, dtype, seed):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(varied((n, k), torch.float32, seed=seed, spread=3) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return lin.to(dtype)


def backend_fits(backend, scheme, k, n) -> bool:
    try:
        pick_backend("cpu", scheme, Fp8Config(scheme=scheme).act_kind(), n, k, forced=backend)
        return True
    except RuntimeError:
        return False


# blockwise scaled_mm is not offered on CPU (test_dispatch checks that refusal); GPU runs cover it.
CPU_PAIRS = [(b, s) for b in BACKENDS for s in Scheme if backend_fits(b, s, 384, 272)]


@pytest.mark.parametrize("backend,scheme", CPU_PAIRS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_vs_exact_product_and_bf16(backend, scheme, dtype, bias):
    n, k = 272, 384
    lin = make_linear(n, k, bias, dtype, seed=n + k)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend=backend), name="l")
    assert layer.backend == backend
    x = varied((2, 9, k), dtype, seed=3, spread=3)
    y = layer(x)
    assert y.shape == (2, 9, n) and y.dtype == dtype
    act = layer.act_kind
    xq, xs = quantize_activation(x, act)
    ref = exact_product(xq, xs, layer.weight, layer.weight_scale, ACT_GROUP[act], WEIGHT_GROUP[scheme])
    if bias:
        ref = ref + lin.bias.double()
    assert torch.isfinite(y).all()
    assert rel_diff(y.reshape(-1, n), ref) < 1e-4
    full = lin(x).double()
    assert sqnr(full, y) > SQNR_FLOOR[scheme]


@pytest.mark.parametrize("shape", [(5,), (1, 5), (2, 3, 5), (0, 5)])
def test_any_leading_shape(shape):
    lin = make_linear(16, 5 * 0 + 32, True, torch.bfloat16, seed=1)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme="channel"))
    x = torch.randn(*shape[:-1], 32, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (*shape[:-1], 16)
    assert torch.equal(y.reshape(-1, 16), layer(x.reshape(-1, 32)))


def test_per_tensor_activation_variant_is_exact():
    lin = make_linear(64, 256, False, torch.bfloat16, seed=2)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme="tensor", activation="tensor"))
    x = varied((7, 256), torch.bfloat16, seed=9, spread=2)
    xq, xs = quantize_activation(x, "tensor")
    assert xs.shape == ()
    ref = exact_product(xq, xs, layer.weight, layer.weight_scale, (-1, -1), (-1, -1))
    assert rel_diff(layer(x), ref) < 1e-4


def test_empty_on_meta_then_load_keeps_storage():
    lin = make_linear(130, 200, True, torch.bfloat16, seed=4)
    layer = Fp8Linear(200, 130, True, Fp8Config(scheme="block"), device="meta")
    assert layer.weight.is_meta and not layer.is_loaded
    with pytest.raises(RuntimeError, match="no weight yet"):
        layer(torch.randn(2, 200, dtype=torch.bfloat16))
    layer.load_(lin.weight.detach(), lin.bias.detach())
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (2, 2)
    params = [layer.weight, layer.weight_scale, layer.bias]
    ptrs = [p.data_ptr() for p in params]
    before = layer.weight.clone()
    layer.load_(lin.weight.detach() * 2, lin.bias.detach())          # new values, same storage
    assert [p.data_ptr() for p in params] == ptrs
    assert all(a is b for a, b in zip(params, [layer.weight, layer.weight_scale, layer.bias]))
    layer.load_(lin.weight.detach(), lin.bias.detach())
    assert torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))


def test_load_rejects_bad_weights():
    layer = Fp8Linear(64, 32, False, Fp8Config(), device="meta", name="model.layers.0.q_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.q_proj.*already quantized.*different path"):
        layer.load_(torch.zeros(32, 64).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"q_proj.*shape \(64, 32\), expected \(32, 64\)"):
        layer.load_(torch.randn(64, 32))
    w = torch.randn(32, 64)
    w[3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"q_proj.*NaN or Inf"):
        layer.load_(w)


def test_dtype_casts_leave_fp8_weight_alone():
    layer = Fp8Linear.from_linear(make_linear(32, 64, True, torch.bfloat16, seed=5))
    scale = layer.weight_scale.clone()
    layer.to(torch.float16)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
    assert layer.bias.dtype == torch.float16


def test_repr_shows_scheme_and_backend():
    layer = Fp8Linear.from_linear(make_linear(32, 64, False, torch.bfloat16, seed=6),
                                  Fp8Config(scheme="ptpc"))
    assert "scheme=channel" in repr(layer) and "backend=cpu" in repr(layer)


def test_batch_invariant_rows_on_cpu():
    lin = make_linear(96, 256, True, torch.bfloat16, seed=8)
    for scheme in Scheme:
        layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, batch_invariant=True))
        rows = varied((3, 256), torch.bfloat16, seed=12)
        want = layer(rows)
        for m in (1, 3, 64, 257):
            others = varied((m + 3, 256), torch.bfloat16, seed=m)
            batch = torch.cat([rows, others])[: max(m, 3)] if m >= 3 else rows[:m]
            got = layer(batch)
            assert torch.equal(got[: min(m, 3)], want[: min(m, 3)])
