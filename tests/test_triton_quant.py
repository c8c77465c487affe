"""Triton FP8 quantizers against the torch reference (`fp8now.numerics`), bit for bit.

With a CUDA device the kernels run on it and every FP8 byte and scale must equal the reference
(computed on the CPU, which is the spec's true-division arithmetic). Without one they run under
Triton's interpreter (TRITON_INTERPRET=1, set below before Triton is imported). Scales must still be
exact there, but the interpreter's fp32 -> fp8 cast is not: it returns half the value when rounding
carries into the next power of two (SPEC §2), rounds exact ties up instead of to even, truncates
results in the FP8 subnormal range, and mangles fp32-subnormal inputs. `assert_fp8_equal` admits
exactly those cases (checked element by element against the exact pre-cast value) and nothing else.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fp8now import numerics  # noqa: E402
from fp8now.kernels import triton_quant as tq, triton_wquant as tw  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"
FMAX = numerics.E4M3FN.fmax
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if tq.available(DEVICE) is not None:  # e.g. triton_quant was imported before TRITON_INTERPRET was set
    pytest.skip(f"Triton quantizers unavailable: {tq.available(DEVICE)}", allow_module_level=True)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def expand_scale(s: torch.Tensor, shape: tuple[int, int], group: tuple[int, int]) -> torch.Tensor:
    """Spread a scale tensor over the elements of its groups: [rows, cols] float32."""
    rows, cols = shape
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    s = s.float().reshape(-(-rows // gr), -(-cols // gc))
    return s.repeat_interleave(gr, 0)[:rows].repeat_interleave(gc, 1)[:, :cols]


def precast(x: torch.Tensor, s: torch.Tensor, group: tuple[int, int], rule: str) -> torch.Tensor:
    """The exact clamped float32 value each element has just before the FP8 cast (CPU)."""
    x32 = x.detach().cpu().float()
    x32 = x32.reshape(-1, x32.shape[-1])
    sf = expand_scale(s.cpu(), tuple(x32.shape), group)
    y = x32 * (1.0 / sf) if rule in ("tensor", "block") else x32 / sf
    return y.clamp(-FMAX, FMAX)


def assert_fp8_equal(q: torch.Tensor, q_ref: torch.Tensor, y: torch.Tensor, max_frac: float = 0.05) -> None:
    """Kernel FP8 output `q` vs the reference `q_ref`; `y` is the exact pre-cast float32 value.

    On a GPU: identical bytes. Under the interpreter every differing byte must be one of its known
    cast defects (see the module docstring), and they must stay below `max_frac` of the elements.
    """
    q = q.cpu()
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape, (q.dtype, q.shape, q_ref.shape)
    diff = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if not INTERPRET:
        assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} FP8 bytes differ on {DEVICE}"
        return
    got, ref, yd = q.double()[diff], q_ref.double()[diff], y.double()[diff]
    carry = (got == ref / 2) & (ref != 0)                           # carry into next power of two
    tie = ((yd - ref).abs() == (yd - got).abs()) & (got != ref)      # exact midpoint, other neighbour
    sub8 = (yd.abs() < 2.0 ** -6) & (yd.abs() >= 2.0 ** -126)        # FP8-subnormal result: truncated
    trunc = sub8 & (got == torch.sign(yd) * torch.floor(yd.abs() * 2.0 ** 9) * 2.0 ** -9)
    sub32 = (yd.abs() < 2.0 ** -126) & (ref == 0) & (got.abs() <= 2.0 ** -6)  # fp32-denormal input
    unexplained = ~(carry | tie | trunc | sub32)
    if unexplained.any():
        i = int(unexplained.nonzero()[0])
        raise AssertionError(f"{int(unexplained.sum())} FP8 mismatches are not interpreter cast defects; "
                             f"first: pre-cast {yd[i].item()!r}, reference {ref[i].item()}, got {got[i].item()}")
    frac = float(diff.float().mean())
    assert frac < max_frac, f"{frac:.2%} of the FP8 values differ (interpreter defects), limit {max_frac:.0%}"


def make_act(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with the awkward cases: huge, small, zero, floored rows, big values, tiny groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2.0
    x[0] *= 1e3                         # large row, values far beyond 448
    if M > 1:
        x[1] *= 1e-3                    # small row
    if M > 2:
        x[2] = 0.0                      # all-zero row: the scale floor
    if M > 3:
        x[3] *= 1e-5                    # amax / 448 below the per-token floor
    if M > 4:
        x[4, : min(K, 128)] *= 1e-11    # a group below the 1e-10 group floor (0 in fp16)
        x[4, -1] = 5000.0
    return x.to(dtype).to(DEVICE)


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-tensor rule's kernels (amax, then quantize), as the weight `tensor` scheme runs them."""
    return tw.quantize_weight(x.reshape(-1, x.shape[-1]), "tensor")


def run_act(kind: str, x: torch.Tensor, **kw):
    fn = {"token": tq.quantize_act_token, "group": tq.quantize_act_group, "tensor": quantize_tensor}[kind]
    return fn(x, **kw)


ACT_GROUP_RULE = {"token": ((1, -1), "row"), "group": ((1, 128), "group"), "tensor": ((-1, -1), "tensor")}


def check_act(kind: str, x: torch.Tensor, max_frac: float = 0.05, quantize=None) -> None:
    q, s = (quantize or (lambda t: run_act(kind, t)))(x)
    q_ref, s_ref = numerics.quantize_activation(x.cpu(), kind)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape, (s.shape, s_ref.shape)
    assert torch.equal(s.cpu(), s_ref), f"{kind} scales differ"
    group, rule = ACT_GROUP_RULE[kind]
    assert_fp8_equal(q, q_ref, precast(x, s_ref, group, rule), max_frac)


FP8_POS = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 2^-9 .. 448


def near_roundings(shape: tuple[int, int], group: tuple[int, int], quantize, seed: int) -> torch.Tensor:
    """float32 values whose pre-cast x/s or x*(1/s) lies within 2 ulps of an FP8 rounding midpoint.

    One anchor per scale group (its first element) fixes the group's amax and scale; every other
    element is (midpoint * s) moved by -2..2 ulps, below the anchor in magnitude. Here true division
    and reciprocal-multiply often round to different FP8 values, so a kernel using the wrong one, or
    an approximate division, fails.
    """
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    anchor = torch.zeros(rows, cols, dtype=torch.bool)
    anchor[::gr, ::gc] = True
    x = torch.zeros(rows, cols)
    x[anchor] = torch.exp(torch.randn(int(anchor.sum()), generator=g) * 4).float()
    _, s = quantize(x)
    sf = expand_scale(s, shape, group).double()
    mids = (FP8_POS[:-1] + FP8_POS[1:]) / 2                       # midpoints up to 416 < 448
    pick = mids[torch.randint(len(mids), (rows, cols), generator=g)]
    sign = torch.randint(0, 2, (rows, cols), generator=g) * 2.0 - 1.0
    v = (pick * sf * sign).float()
    steps = torch.randint(-2, 3, (rows, cols), generator=g)
    for k in (1, 2):
        v = torch.where(steps >= k, torch.nextafter(v, torch.tensor(float("inf"))), v)
        v = torch.where(steps <= -k, torch.nextafter(v, torch.tensor(float("-inf"))), v)
    return torch.where(anchor, x, v)


# ------------------------------------------------------------------------------------------------
# activations
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["token", "group", "tensor"])
@pytest.mark.parametrize("shape", [(3, 200), (5, 384), (7, 1000)])
def test_activation_matches_reference(kind, shape, dtype):
    check_act(kind, make_act(*shape, dtype, seed=shape[0] * 1000 + shape[1] + len(kind)))


@pytest.mark.parametrize("kind", ["token", "group", "tensor"])
def test_long_rows(kind):
    """K above the single-tile limit of few rows: the per-token kernel's two-pass loop in its widest
    chunks, many groups per row."""
    k = tq._ROW_MAX_SINGLE_FEW_ROWS + 300
    assert tq._row_plan(2, k)[:2] == (False, 4096)
    check_act(kind, make_act(2, k, torch.bfloat16, seed=7))


@pytest.mark.parametrize("many", [False, True], ids=["few-rows-one-tile", "many-rows-chunks"])
def test_token_rows_between_the_limits(many):
    """_ROW_MAX_SINGLE < K <= _ROW_MAX_SINGLE_FEW_ROWS: few rows are held whole (one wide masked tile),
    many rows go through the two-pass loop in 2048-wide chunks (the row count that switches is
    lowered to 3 here so that the interpreter stays quick)."""
    m, k = (3 if many else 2), tq._ROW_MAX_SINGLE + 300
    assert tq._row_plan(m, k, few_rows=3)[:2] == ((False, 2048) if many else (True, 16384))

    def quantize(x):
        q = torch.empty(x.shape, dtype=numerics.E4M3FN.dtype, device=x.device)
        s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        tq.launch_row(x, q, s, numerics.E4M3FN, few_rows=3)
        return q, s
    check_act("token", make_act(m, k, torch.bfloat16, seed=8), quantize=quantize)


@pytest.mark.parametrize("kind", ["token", "group", "tensor"])
def test_activation_rounding_boundaries(kind):
    group, _ = ACT_GROUP_RULE[kind]
    x = near_roundings((16, 512), group, lambda t: numerics.quantize_activation(t, kind), seed=21)
    check_act(kind, x.to(DEVICE), max_frac=0.3)


def test_all_zero_inputs():
    """amax == 0 everywhere: the floors and the per-tensor zero guard (no NaN, no zero scale)."""
    x = torch.zeros(3, 200, dtype=torch.bfloat16, device=DEVICE)
    for kind in ("token", "group", "tensor"):
        check_act(kind, x)
    for scheme in ("tensor", "channel", "block"):
        check_weight(torch.zeros(2, 130, 200, device=DEVICE), scheme)


def test_leading_dims_flatten_like_reference():
    x = make_act(6, 256, torch.bfloat16, seed=3).reshape(2, 3, 256)
    for kind in ("token", "group", "tensor"):
        check_act(kind, x)


def test_fp8_subnormal_and_fp32_denormal_ranges():
    """Results in the FP8 subnormal range, and fp32-denormal inputs (interpreter: looser)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 512, generator=g)
    x[0, 1:] *= 2.0 ** -12              # row max 448-ish units: the rest lands in FP8 subnormals
    x[0, 0] = 300.0
    x[1] = torch.randn(512, generator=g) * 1e-40   # fp32 denormals (floored per-token scale)
    x[2, :256] = 1e-42                  # denormals under a large per-tensor scale
    x[3] *= 1e6
    for kind in ("token", "group", "tensor"):
        check_act(kind, x.to(DEVICE), max_frac=0.6)


def test_nan_row_gives_nan_scale_only_there():
    x = make_act(4, 256, torch.float32, seed=5)
    x[1, 17] = float("nan")
    q, s = tq.quantize_act_token(x)
    q_ref, s_ref = numerics.quantize_activation(x.cpu(), "token")
    s = s.cpu()
    assert torch.isnan(s[1]).all() and torch.isnan(s_ref[1]).all()
    keep = [0, 2, 3]
    assert torch.equal(s[keep], s_ref[keep])
    assert_fp8_equal(q[keep], q_ref[keep], precast(x[keep], s_ref[keep], (1, -1), "row"))
    if not INTERPRET:  # the interpreter's cast does not produce FP8 NaN
        assert torch.isnan(q[1].cpu().float()).all()
    _, sg = tq.quantize_act_group(x)
    assert torch.isnan(sg[1, 0].cpu()) and not torch.isnan(sg[1, 1].cpu()) and not torch.isnan(sg[0]).any()


@pytest.mark.parametrize("M,K", [(5, 384), (3, 200), (1, 128)])
def test_group_col_major_layout(M, K):
    x = make_act(M, K, torch.bfloat16, seed=M * K)
    q_row, s_row = tq.quantize_act_group(x)
    q_col, s_col = tq.quantize_act_group(x, col_major=True)
    G = -(-K // 128)
    assert s_col.shape == (M, G) and s_col.stride() == (1, M)
    assert s_row.shape == (M, G) and s_row.stride() == (G, 1)
    assert torch.equal(s_col, s_row)
    assert torch.equal(q_col.view(torch.uint8), q_row.view(torch.uint8))


def test_empty_batch():
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=DEVICE)
    assert [t.shape for t in tq.quantize_act_token(x)] == [(0, 256), (0, 1)]
    assert [t.shape for t in tq.quantize_act_group(x)] == [(0, 256), (0, 2)]
    q, s = quantize_tensor(x)
    floor = torch.tensor(numerics.E4M3FN.min_scale, dtype=torch.float32)
    assert q.shape == (0, 256) and s.shape == () and torch.equal(s.cpu(), floor)


def test_rejects_bad_input():
    with pytest.raises(TypeError):
        tq.quantize_act_token(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError):
        tw.quantize_weight(torch.zeros(2, 2, 8, 8, device=DEVICE), "block")
    with pytest.raises(ValueError):
        tw.quantize_weight(torch.zeros(8, 8, device=DEVICE), "nonsense")


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------
def make_weight(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Outlier 128x128 tiles (x1e3, x1e-3), a zero tile, a tile under the 1e-4 block floor, a tiny row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w2 = w.view(-1, shape[-2], shape[-1])
    for e in range(w2.shape[0]):
        w2[e, :128, :128] *= 1e3
        w2[e, 128:, 128:256] *= 1e-3
        w2[e, :128, 256:] = 0.0
        w2[e, 128:, :128] *= 1e-4
        w2[e, 5] *= 1e-4                # a channel whose amax / 448 is under the row floor
    return w.to(dtype).to(DEVICE)


WEIGHT_RULE = {"tensor": ((-1, -1), "tensor"), "channel": ((1, -1), "row"), "block": ((128, 128), "block")}


def check_weight(w: torch.Tensor, scheme: str, max_frac: float = 0.05) -> None:
    q, s = tw.quantize_weight(w, scheme)
    q_ref, s_ref = numerics.quantize_weight(w.cpu(), scheme)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape, (s.shape, s_ref.shape)
    assert torch.equal(s.cpu(), s_ref), f"{scheme} weight scales differ"
    group, rule = WEIGHT_RULE[scheme]
    ws, ss = (w, s_ref) if w.dim() == 3 else (w.unsqueeze(0), s_ref.unsqueeze(0))
    y = torch.stack([precast(ws[e], ss[e], group, rule) for e in range(ws.shape[0])]).reshape(q.shape)
    assert_fp8_equal(q, q_ref, y, max_frac)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_matches_reference(scheme, dtype):
    check_weight(make_weight((130, 260), dtype, seed=1), scheme)


@pytest.mark.parametrize("shape", [(2, 136, 200), (3, 256, 136)], ids=["one-launch-each", "one-launch"])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_stacked_expert_weights(scheme, shape):
    check_weight(make_weight(shape, torch.bfloat16, seed=2), scheme)


@pytest.mark.parametrize("shape", [(130, 260), (2, 256, 136)])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_out_is_written_in_place(scheme, shape):
    w = make_weight(shape, torch.bfloat16, seed=9)
    q_new, s_new = tw.quantize_weight(w, scheme)
    q_out = torch.full(w.shape, 7.0, device=DEVICE).to(torch.float8_e4m3fn)   # stale bytes and scales
    s_out = torch.full(s_new.shape, -1.0, device=DEVICE).reshape(-1)           # any shape of as many elements
    q, s = tw.quantize_weight(w, scheme, out=(q_out, s_out))
    assert q is q_out and s is s_out and s_out.shape == (s_new.numel(),)
    assert torch.equal(q_out.view(torch.uint8), q_new.view(torch.uint8)) and torch.equal(s_out, s_new.reshape(-1))
    with pytest.raises(ValueError, match="out= must be contiguous"):
        tw.quantize_weight(w, scheme, out=(q_out, s_out[1:]))
    with pytest.raises(ValueError, match="out= must be contiguous"):
        tw.quantize_weight(w, scheme, out=(q_out.view(torch.uint8), s_out))


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_rounding_boundaries(scheme):
    group, _ = WEIGHT_RULE[scheme]
    w = near_roundings((256, 384), group, lambda t: numerics.quantize_weight(t, scheme), seed=22)
    check_weight(w.to(DEVICE), scheme, max_frac=0.3)


def test_weight_strided_view():
    w = make_weight((130, 520), torch.bfloat16, seed=4)[:, ::2]   # column stride 2: made contiguous
    for scheme in ("tensor", "channel", "block"):
        check_weight(w, scheme)


def test_weight_all_finite():
    w = make_weight((130, 260), torch.bfloat16, seed=6)
    assert bool(tw.weight_all_finite(w))
    for bad in (float("nan"), float("inf"), float("-inf")):
        v = w.clone()
        v[129, 259] = bad
        flag = tw.weight_all_finite(v)
        assert flag.dtype == torch.bool and flag.shape == () and not bool(flag)
    e = make_weight((2, 64, 96), torch.float16, seed=8)
    assert bool(tw.weight_all_finite(e))
    e[1, 3, 4] = float("nan")
    assert not bool(tw.weight_all_finite(e))


def test_available():
    assert tq.available(DEVICE) is None
    assert isinstance(tq.available("meta"), str)
