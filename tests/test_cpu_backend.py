"""The `cpu` backend against the exact `reference` backend on the same FP8 bytes: every scheme, odd
shapes, bias, batch invariance, and a working copy that follows the weight through reloads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp8now import Fp8Config, Fp8Linear, Scheme, rel_diff
from fp8now.kernels import cpu, pick_backend, reference
from fp8now.kernels.plan import Weights, plan
from fp8now.loading.load import load
from fp8now.numerics import quantize_activation, quantize_weight
from fp8now.loading.reload import reload_weights
from tiny import write_tiny_checkpoint
from fp8_oracle import fp8_values, round_fp8, varied

# (scheme, activation kind): the three schemes with their default activations, and per-tensor ones.
KINDS = [(Scheme.TENSOR, "token"), (Scheme.CHANNEL, "token"), (Scheme.BLOCK, "group"),
         (Scheme.TENSOR, "tensor")]
# N, K off multiples of 128 (partial block tiles and 1x128 groups), and the embedded model's shapes.
SHAPES = [(200, 300), (129, 257), (64, 128), (576, 1536), (1536, 576)]


def call(backend: str, x, w_q, w_s, b, scheme, act, invariant=False, work=None):
    """One call of `backend`'s linear along its planned path, as Fp8Linear makes it."""
    module = {"cpu": cpu, "reference": reference}[backend]
    path = plan(backend, scheme, act, x.shape[0], w_q.shape[0], w_q.shape[1], "cpu", invariant)
    return module.linear(x, Weights(w_q, w_s, b, work), path)


@pytest.mark.parametrize("scheme,act", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_exact_product(scheme, act, n, k, bias):
    w = varied((n, k), torch.bfloat16, seed=n * k, spread=3)
    b = torch.randn(n, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) if bias else None
    w_q, w_s = quantize_weight(w, scheme)
    work = cpu.prepare(w_q, w_s, scheme)
    assert work.dtype == torch.bfloat16 and work.shape == (n, k)
    for m in (1, 5, 40):
        x = varied((m, k), torch.bfloat16, seed=m + k, spread=3)
        want = call("reference", x, w_q, w_s, b, scheme, act)
        got = call("cpu", x, w_q, w_s, b, scheme, act, False, work)
        assert got.dtype == x.dtype and got.shape == (m, n)
        assert rel_diff(got, want) < 1e-4, (m, rel_diff(got, want))
        # without a working copy the call widens the weight itself, with the same result
        assert torch.equal(call("cpu", x, w_q, w_s, b, scheme, act), got)


@pytest.mark.parametrize("act", ["token", "tensor", "group"])
@pytest.mark.parametrize("m,k", [(9, 1), (9, 128), (9, 300), (9, 576), (300, 576)])
def test_activation_bytes_are_numerics_bytes(act, m, k):
    """The backend's widened activation is exactly q * s of `numerics.quantize_activation` (300 x 576:
    more than one chunk of rows)."""
    assert 300 * 576 > cpu.ACT_CHUNK
    x = varied((m, k), torch.bfloat16, seed=k, spread=8)
    x[2] = 0                                       # all-zero row: the scale floors
    x[3, 0] = 3e38                                 # a huge value beside small ones
    q, s = quantize_activation(x, act)
    if act == "group":
        s = s.repeat_interleave(128, dim=1)[:, :k]
    want = (q.double() * s.double()).to(torch.bfloat16)  # one rounding of the exact product
    assert torch.equal(cpu.widened_activation(x, act), want)


def _near_every_boundary(ulps: int = 1 << 12) -> torch.Tensor:
    """Every float32 within `ulps` steps of each e4m3 value and each midpoint between neighbours
    (the rounding boundaries, up to 464: above 448 everything rounds to 448), plus one float32 in
    every 997 from 0 to 464 (subnormal range and float32 subnormals included); both signs."""
    vals = fp8_values().float()
    points = torch.cat([vals, (vals[1:] + vals[:-1]) / 2, torch.tensor([464.0])])
    near = points.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    top = int(torch.tensor(464.0).view(torch.int32))
    bits = torch.cat([near.flatten().clamp(0, top), torch.arange(0, top, 997, dtype=torch.int32)])
    y = bits.view(torch.float32)
    return torch.cat([y, -y])


def test_rounding_in_float32_bits_is_the_cast_near_every_boundary():
    """`round_e4m3_` against torch's cast (clamped to ±448 first, as numerics does) and against the
    table-driven oracle, over every float32 near each rounding boundary: ties, normals, subnormals,
    zeros, the clamp range and both signs. Equal as values; only the sign of a zero may differ."""
    y = _near_every_boundary()
    assert y.numel() > 4_000_000
    got = cpu.round_e4m3_(y.clone())
    cast = y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(got, cast)
    assert torch.equal(got.double(), round_fp8(y.clamp(-448, 448).double()))


@pytest.mark.parametrize("act", ["token", "tensor", "group"])
def test_activation_values_are_the_quantizers_values(act):
    """The float32 values the backend multiplies are `quantize_activation`'s bytes widened, and its
    scales are the same, on fresh inputs with zero rows, ties (powers of two beside the amax), tiny
    subnormal-range values, huge values and both signs; K off a multiple of 128."""
    g = torch.Generator().manual_seed(7)
    m, k = 64, 300
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-6, 4, (m, 1), generator=g)
    x[:, ::7] = 2.0 ** torch.randint(-20, 3, (m, 1), generator=g).float()  # exact ties after the scale
    x[1] = 0
    x[3, 5] = 1e-30
    x[5, 10:40] = x[5].abs().max() * 2.0 ** -torch.linspace(8, 22, 30)  # the subnormal range and below
    x[4, 9] = -3e38 if act != "tensor" else -3e4     # per tensor: the others would all round to 0
    x = x.to(torch.bfloat16)
    q_want, s_want = quantize_activation(x, act)
    q, s = cpu.activation_values(x, act)
    if act == "group":
        q, s = q.view(m, -1)[:, :k], s.view(m, -1)
    assert torch.equal(s, s_want)
    assert torch.equal(q, q_want.float())
    assert (q == 0).sum() > k and ((q != 0) & (q.abs() < 2 ** -6)).any()  # zeros and subnormals happen


def test_batch_invariant_rows_are_bit_identical_whatever_the_batch():
    n, k = 200, 300                                # a shape where oneDNN's result depends on M
    w = varied((n, k), torch.bfloat16, seed=1, spread=2)
    for scheme, act in KINDS[:3]:
        w_q, w_s = quantize_weight(w, scheme)
        work = cpu.prepare(w_q, w_s, scheme)
        rows = varied((3, k), torch.bfloat16, seed=2, spread=2)
        want = call("cpu", rows, w_q, w_s, None, scheme, act, True, work)
        for m in (1, 4, 15, 16, 17, 33, 130):
            others = varied((m, k), torch.bfloat16, seed=m, spread=2)
            for pos in (0, m // 2, m):             # the rows at the start, middle and end
                batch = torch.cat([others[:pos], rows, others[pos:]])
                got = call("cpu", batch, w_q, w_s, None, scheme, act, True, work)
                assert torch.equal(got[pos:pos + 3], want), (scheme, m, pos)


def test_cpu_is_the_default_on_cpu_and_refuses_other_devices():
    for scheme in Scheme:
        assert pick_backend("cpu", scheme, Fp8Config(scheme=scheme).act_kind(), 200, 300) == "cpu"
    assert "CPU tensors only" in cpu.available(torch.device("meta"), Scheme.CHANNEL, "token", 8, 8)
    assert "couples" in cpu.available(torch.device("cpu"), Scheme.TENSOR, "tensor", 8, 8, True)


def test_working_copy_is_not_state_and_follows_load():
    lin = torch.nn.Linear(300, 200, bias=True).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme="block"))
    assert layer.backend == "cpu"
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}
    x = varied((4, 300), torch.bfloat16, seed=5)
    before = layer(x)
    work_ptr = layer._work.data_ptr()
    with torch.no_grad():
        layer.load_(lin.weight * 3, lin.bias)      # in place: the working copy is rebuilt in place
    assert layer._work.data_ptr() == work_ptr
    fresh = Fp8Linear.from_linear(torch.nn.Linear(300, 200).to(torch.bfloat16).requires_grad_(False),
                                  Fp8Config(scheme="block"))
    fresh.load_(lin.weight.detach() * 3, lin.bias.detach())
    assert torch.equal(layer(x), fresh(x)) and not torch.equal(layer(x), before)


def test_reload_refreshes_the_working_copy(tmp_path):
    """After reload_weights the model computes what a fresh load of the new weights computes."""
    a = write_tiny_checkpoint(tmp_path / "a", "qwen2", seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen2", seed=1)
    model, _ = load(a, Fp8Config(scheme="channel"), device="cpu")
    fresh, _ = load(b, Fp8Config(scheme="channel"), device="cpu")
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        old = model(ids).logits
        reload_weights(model, load_file(b / "model.safetensors"))
        new, want = model(ids).logits, fresh(ids).logits
    assert not torch.equal(old, want) and torch.equal(new, want)


def test_the_report_counts_the_working_copies(tmp_path):
    """The load report states the working copies' bytes beside the model's: 2 bytes per quantized weight."""
    model, report = load(write_tiny_checkpoint(tmp_path / "m", "llama"), Fp8Config(scheme="block"))
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers and report.work_bytes == sum(2 * m.out_features * m.in_features for m in layers)
    assert "of backend working copies" in report.summary_lines()[0]
