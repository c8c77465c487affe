"""The decode GEMMs against float64 products of the same FP8 operands: the one-launch decode kernel
(activation quantized inside a split-K GEMM that reduces its own splits) and the GEMV for up to 4
rows (CUDA-core products, no K split, pre-quantized rows).

Without a CUDA device the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 before triton is
imported), so shapes stay tiny. The interpreter's fp32 -> fp8 cast is defective (SPEC §2), so there the
FP8 operands of the reference come from the Triton quantizers (same cast); on a GPU they come from
`numerics` (whose bytes the Triton quantizers match exactly).
"""

import pytest
import torch

pytest.importorskip("triton")

from fp8now import numerics as nu  # noqa: E402  (conftest chose the interpreter before this import)
from fp8now.kernels import triton_decode as td, triton_jit as tj, triton_gemv as tv, triton_quant as tq  # noqa: E402
from fp8_oracle import varied  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(tj.available(DEV) is not None, reason=f"Triton: {tj.available(DEV)}")]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
W_GROUP = {"tensor": (-1, -1), "channel": (1, -1), "block": (128, 128)}
PAIRS = [("channel", "token"), ("tensor", "token"), ("block", "group")]


def _operands(m, n, k, w_kind, seed, bias=True, dtype=BF16):
    x = varied((m, k), torch.float32, seed=seed, spread=3) * 0.25
    if m > 2:
        x[1] = 0.0            # an all-zero row: the scale floor
        x[2, :3] = 300.0      # outliers next to small values
    x = x.to(dtype)
    w_q, w_s = nu.quantize_weight(varied((n, k), torch.float32, seed=seed + 1, spread=3), w_kind)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    return x.to(DEV), w_q.to(DEV), w_s.to(DEV), None if b is None else b.to(DEV)


def _quantized_x(x, act):
    """The FP8 activation operands the kernel must reproduce (see the module docstring)."""
    if DEV.type == "cpu":
        return tq.quantize_act_token(x) if act == "token" else tq.quantize_act_group(x)
    return nu.quantize_activation(x, act)


def _exact(x_q, x_s, act, w_q, w_s, w_kind, b):
    y = (nu.dequantize(x_q.cpu(), x_s.cpu(), (1, -1) if act == "token" else (1, 128)).double()
         @ nu.dequantize(w_q.cpu(), w_s.cpu(), W_GROUP[w_kind]).double().T)
    return y if b is None else y + b.cpu().double()


@pytest.mark.parametrize("w_kind,act", PAIRS)
@pytest.mark.parametrize("m,n,k,split", [(1, 200, 640, 1), (1, 96, 640, 3), (5, 200, 640, 2), (16, 64, 640, 3),
                                         (3, 130, 640, 5), (7, 96, 256, 0)])
def test_decode_matches_exact_product(w_kind, act, m, n, k, split):
    """Every split count (5 splits of 128 = one K-block each), M and N tails, bias, float32 output."""
    x, w_q, w_s, b = _operands(m, n, k, w_kind, seed=m * 1000 + n + split)
    counters = td.ticket_counters(n, DEV)
    y = td.decode_linear(x, w_q, w_s, w_kind, act, b, counters=counters, out_dtype=FP32,
                         config=dict(SPLIT_K=split))
    ref = _exact(*_quantized_x(x, act), act, w_q, w_s, w_kind, b)
    assert y.shape == (m, n) and y.dtype == FP32
    assert torch.isfinite(y).all()
    assert nu.rel_diff(y.cpu(), ref) < 1e-6
    worst = max(nu.rel_diff(y[i].cpu(), ref[i]) for i in range(m) if ref[i].abs().sum() > 0)
    assert worst < 1e-6
    assert int(counters.abs().sum()) == 0, "the last split must reset its tile's counter"


@pytest.mark.parametrize("w_kind,act", PAIRS)
def test_decode_split_count_and_order_do_not_change_the_sum_beyond_rounding(w_kind, act):
    """1, 2 and 5 splits agree to float32 rounding; the same split twice gives the same bytes."""
    x, w_q, w_s, b = _operands(4, 160, 640, w_kind, seed=3)
    counters = td.ticket_counters(160, DEV)
    run = lambda s: td.decode_linear(x, w_q, w_s, w_kind, act, b, counters=counters,  # noqa: E731
                                     out_dtype=FP32, config=dict(SPLIT_K=s))
    y1, y2, y5 = run(1), run(2), run(5)
    assert nu.rel_diff(y2.cpu(), y1.cpu()) < 1e-6 and nu.rel_diff(y5.cpu(), y1.cpu()) < 1e-6
    assert torch.equal(run(5), y5) and torch.equal(run(2), y2)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("w_kind,act", PAIRS)
def test_decode_output_dtype_and_no_counters(w_kind, act, dtype):
    """Output in the activation dtype by default; without counters a zeroed tensor is made per call."""
    x, w_q, w_s, b = _operands(3, 64, 512, w_kind, seed=9, dtype=dtype)
    y = td.decode_linear(x, w_q, w_s, w_kind, act, b, config=dict(SPLIT_K=2))
    assert y.dtype == dtype
    ref = _exact(*_quantized_x(x, act), act, w_q, w_s, w_kind, b)
    assert nu.rel_diff(y.cpu().float(), ref) < 1e-4


@pytest.mark.parametrize("w_kind,act", PAIRS)
@pytest.mark.parametrize("m", [1, 6])
def test_decode_prequantized_equals_fused(w_kind, act, m):
    """FP8 rows + scales from the Triton quantizer (per group also with column-major scales) give the
    bytes of quantizing inside the kernel."""
    x, w_q, w_s, b = _operands(m, 96, 640, w_kind, seed=21 + m)
    quantizers = [tq.quantize_act_token] if act == "token" else [
        tq.quantize_act_group, lambda t: tq.quantize_act_group(t, col_major=True)]
    cfg = dict(SPLIT_K=3)
    fused = td.decode_linear(x, w_q, w_s, w_kind, act, b, config=cfg)
    for quantize in quantizers:
        x_q, x_s = quantize(x)
        pre = td.decode_linear(x_q, w_q, w_s, w_kind, act, b, x_scale=x_s, out_dtype=BF16, config=cfg)
        assert torch.equal(fused, pre)


@pytest.mark.parametrize("w_kind,act", PAIRS)
@pytest.mark.parametrize("m,block_m", [(40, 16), (64, 64), (70, 64)])
def test_decode_prequantized_rows_past_one_tile(w_kind, act, m, block_m):
    """Pre-quantized rows beyond the in-kernel quantizer's 16 (a decode batch of 64): several row tiles or one
    64-row tile (plus a tail tile), K split with the ticket, against the float64 product; the layer's
    counters (sized for one row tile) come back zero, or the wrapper makes its own when they are too few."""
    x, w_q, w_s, b = _operands(m, 96, 640, w_kind, seed=m + block_m)
    x_q, x_s = _quantized_x(x, act)
    counters = td.ticket_counters(96, DEV)
    y = td.decode_linear(x_q, w_q, w_s, w_kind, act, b, x_scale=x_s, counters=counters, out_dtype=FP32,
                         config=dict(BLOCK_M=block_m, BLOCK_N=32, SPLIT_K=3))
    ref = _exact(x_q, x_s, act, w_q, w_s, w_kind, b)
    assert y.shape == (m, 96) and nu.rel_diff(y.cpu(), ref) < 1e-6
    worst = max(nu.rel_diff(y[i].cpu(), ref[i]) for i in range(m) if ref[i].abs().sum() > 0)
    assert worst < 1e-6
    assert int(counters.abs().sum()) == 0


def test_decode_noncontiguous_and_misindexed_control():
    """A strided activation gives the contiguous result; a rolled weight scale (control) does not."""
    x, w_q, w_s, b = _operands(4, 128, 384, "block", seed=5)
    wide = torch.zeros(4, 2 * 384, dtype=x.dtype, device=DEV)
    wide[:, ::2] = x
    y = td.decode_linear(x, w_q, w_s, "block", "group", b, config=dict(SPLIT_K=3))
    assert torch.equal(td.decode_linear(wide[:, ::2], w_q, w_s, "block", "group", b,
                                        config=dict(SPLIT_K=3)), y)
    rolled = td.decode_linear(x, w_q, w_s.roll(1, 1).contiguous(), "block", "group", b)
    assert nu.rel_diff(rolled.cpu().float(), y.cpu().float()) > 1e-2


def test_decode_rejects_bad_inputs():
    x, w_q, w_s, _ = _operands(3, 64, 256, "block", seed=1)
    with pytest.raises(ValueError, match="pairs act"):
        td.decode_linear(x, w_q, w_s, "block", "token")
    with pytest.raises(ValueError, match="M <= 16"):
        td.decode_linear(torch.cat([x] * 6), w_q, w_s, "block", "group")
    with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
        td.decode_linear(x, w_q, w_s, "block", "group", config=dict(BLOCK_N=256))
    x_q, x_s = tq.quantize_act_group(x)
    with pytest.raises(ValueError, match="pre-quantized"):
        td.decode_linear(x_q.float(), w_q, w_s, "block", "group", x_scale=x_s)
    with pytest.raises(ValueError, match="x_scale"):
        td.decode_linear(x_q, w_q, w_s, "block", "group", x_scale=x_s[:, :1])
    with pytest.raises(ValueError, match="w_s"):
        td.decode_linear(x, w_q, w_s[:, :1], "block", "group")
    with pytest.raises(ValueError, match="counters"):
        td.decode_linear(x, w_q, w_s, "block", "group", counters=torch.zeros(8, device=DEV),
                         config=dict(SPLIT_K=2))


# --- K splits added by pairwise exchanges (triton_decode._exchange) instead of the ticket -------------
@pytest.mark.parametrize("w_kind,act", PAIRS)
@pytest.mark.parametrize("m,n,k,split", [(1, 96, 512, 2), (3, 200, 1024, 4), (16, 64, 1024, 8), (5, 130, 384, 2)])
def test_decode_exchange_matches_exact_product_and_empties_its_slots(w_kind, act, m, n, k, split):
    """The exchange tree against the float64 product (M and N tails, bias); the slots are EMPTY again
    after each call, so the next call gives the same bytes; with two splits it is the ticket's sum
    (a + b either way), with more it agrees with the ticket to float32 rounding."""
    x, w_q, w_s, b = _operands(m, n, k, w_kind, seed=7 * m + n + split)
    slots = td.exchange_slots(n, split, DEV, m)
    run = lambda **kw: td.decode_linear(x, w_q, w_s, w_kind, act, b, out_dtype=FP32,  # noqa: E731
                                        config=dict(SPLIT_K=split), **kw)
    y = run(slots=slots)
    ref = _exact(*_quantized_x(x, act), act, w_q, w_s, w_kind, b)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    assert nu.rel_diff(y.cpu(), ref) < 1e-6
    assert bool((slots == td.EMPTY).all()), "the second of each pair must put EMPTY back"
    assert torch.equal(run(slots=slots), y)
    ticket = run()
    assert torch.equal(ticket, y) if split == 2 else nu.rel_diff(y.cpu(), ticket.cpu()) < 1e-6


def test_decode_exchange_rejects_bad_slots():
    x, w_q, w_s, _ = _operands(3, 64, 768, "channel", seed=2)
    with pytest.raises(ValueError, match="power-of-two"):
        td.decode_linear(x, w_q, w_s, "channel", "token", config=dict(SPLIT_K=3),
                         slots=td.exchange_slots(64, 4, DEV))
    with pytest.raises(ValueError, match="slots must be"):
        td.decode_linear(x, w_q, w_s, "channel", "token", config=dict(SPLIT_K=2),
                         slots=td.exchange_slots(64, 2, DEV, 2))
    with pytest.raises(ValueError, match="slots must be"):
        td.decode_linear(x, w_q, w_s, "channel", "token", config=dict(SPLIT_K=2),
                         slots=td.exchange_slots(64, 2, DEV).float())


@pytest.mark.gpu
@pytest.mark.skipif(DEV.type != "cuda", reason="the arrival race needs real concurrent programs")
@pytest.mark.parametrize("w_kind,act", PAIRS)
@pytest.mark.parametrize("m,split", [(2, 2), (16, 2), (4, 4)])
def test_decode_exchange_same_bytes_whoever_arrives_second(w_kind, act, m, split):
    """At a decode size on the GPU, where the two programs of a pair race for each element: 30 calls
    (and a CUDA graph replayed 10 times) give the bytes of the first, which match the float64 product."""
    x, w_q, w_s, b = _operands(m, 4096, 4096, w_kind, seed=m + split)
    slots = td.exchange_slots(4096, split, DEV)
    run = lambda: td.decode_linear(x, w_q, w_s, w_kind, act, b, config=dict(SPLIT_K=split),  # noqa: E731
                                   slots=slots, out_dtype=FP32)
    y = run()
    assert nu.rel_diff(y.cpu(), _exact(*_quantized_x(x, act), act, w_q, w_s, w_kind, b)) < 1e-6
    assert all(torch.equal(run(), y) for _ in range(30))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(10):
        graph.replay()
        assert torch.equal(out, y)
    assert bool((slots == td.EMPTY).all())


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fused_max_n,gemv,few", [(0, False, False), (4096, False, False), (0, True, False),
                                                  (0, False, True)])
def test_triton_backend_decode_dispatch(scheme, m, fused_max_n, gemv, few):
    """The triton backend's decode branches (quantizer + decode kernel; block at M=1 fused or not;
    the GEMV at M = 1 and 3 for every scheme; the few-split plan: two splits by exchange, block on the
    decode kernel), chosen by a table and run through `triton_fp8.linear` (on CPU the backend itself
    refuses to be picked, the interpreter runs its kernels). The layer's workspace (the backend's hook)
    is back to zeros (and EMPTY slots) after the call."""
    from fp8now.config import Scheme
    from fp8now.kernels import triton_fp8
    from fp8now.kernels.plan import WIDE, Table, Weights, plan
    table = Table(fused_block_max_n=fused_max_n, few_splits_n=(0, WIDE) if few else (1, 0), tensorwise_m1=False,
                  gemv=tuple((s, r, 0, WIDE) for s in ("tensor", "channel", "block") for r in (1, 2, 4)) if gemv else (),
                  quant_inside=())   # the Triton quantizer first (GEMMs quantizing inside: test_decode_fusion.py)
    act = "group" if scheme == "block" else "token"
    x, w_q, w_s, b = _operands(m, 160, 1024, scheme, seed=31 + m)   # K=1024: auto-split in two
    path = plan("triton", Scheme(scheme), act, m, 160, 1024, "cuda-fp8", table=table)
    fused = scheme == "block" and m == 1 and fused_max_n >= 160
    want = ("triton-gemv" if gemv else "triton-decode-exchange" if few and act == "token"
            else "triton-decode" if act == "token" or fused or few else "triton-block")
    assert path.gemm == want and (path.quant == "fused") == (fused and not gemv)
    counters = triton_fp8.workspace(DEV, Scheme(scheme), act, 160, 1024, False, table)
    y = triton_fp8.linear(x, Weights(w_q, w_s, b, counters), path)
    assert y.dtype == x.dtype and y.shape == (m, 160)
    ref = _exact(*_quantized_x(x, act), act, w_q, w_s, scheme, b)
    assert nu.rel_diff(y.cpu().float(), ref) < 1e-4
    tickets = -(-160 // 16)
    if act == "group" and not few and not fused_max_n:   # no M <= 16 runs the decode kernel
        assert counters is None
        return
    assert counters.numel() == (tickets + td.MAX_M * 160 if few and act == "token" else tickets)
    assert int(counters[:tickets].abs().sum()) == 0
    assert bool((counters[tickets:] == td.EMPTY).all())


# --- the GEMV (triton_gemv, M <= 4): CUDA-core products, no K split, pre-quantized rows -------------
ACT = dict(PAIRS)


def _row(n, k, w_kind, seed, bias=True, dtype=BF16):
    """One activation row with outliers next to small values and an all-zero 1x128 group (its scale
    floor), and a weight quantized per `w_kind`."""
    x, w_q, w_s, b = _operands(1, n, k, w_kind, seed, bias=bias, dtype=dtype)
    x[0, :3] = 300.0
    x[0, 128:256] = 0.0
    return x, w_q, w_s, b


def _gemv(x, w_q, w_s, w_kind, b, **kw):
    x_q, x_s = _quantized_x(x, ACT[w_kind])
    return tv.gemv(x_q, w_q, w_s, w_kind, b, x_scale=x_s, **kw)


@pytest.mark.parametrize("w_kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m,n,k,cfg", [(1, 200, 640, dict(BLOCK_N=4, BLOCK_K=256)),     # N tail, K tail
                                       (1, 96, 1024, dict(BLOCK_N=16, BLOCK_K=512)),
                                       (1, 130, 384, dict(BLOCK_N=8, BLOCK_K=128)),
                                       (1, 64, 256, None),                             # shipped configs
                                       (2, 72, 384, None),
                                       (3, 136, 640, dict(BLOCK_N=8, BLOCK_K=64)),     # M tail, BK < 128
                                       (4, 64, 256, None),
                                       (4, 72, 640, dict(BLOCK_N=8, BLOCK_K=128)),
                                       (2, 40, 384, dict(BLOCK_N=2, BLOCK_K=512, num_warps=2))])
def test_gemv_matches_exact_product(w_kind, m, n, k, cfg):
    """Every scheme, 1 to 4 rows (M = 3 in a 4-row program: its wrapped rows must not be stored), with
    an all-zero row and outliers (M > 2), N / K tails, float32 output, bias, against float64."""
    x, w_q, w_s, b = _row(n, k, w_kind, seed=n + k) if m == 1 else _operands(m, n, k, w_kind, seed=m + n + k)
    y = _gemv(x, w_q, w_s, w_kind, b, out_dtype=FP32, config=cfg)
    ref = _exact(*_quantized_x(x, ACT[w_kind]), ACT[w_kind], w_q, w_s, w_kind, b)
    assert y.shape == (m, n) and y.dtype == FP32 and torch.isfinite(y).all()
    assert nu.rel_diff(y.cpu(), ref) < 1e-6
    assert float((y.cpu().double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("w_kind", ["channel", "block"])
def test_gemv_output_dtype_without_bias(w_kind, dtype):
    x, w_q, w_s, _ = _row(64, 512, w_kind, seed=9, bias=False, dtype=dtype)
    y = _gemv(x, w_q, w_s, w_kind, None, out_dtype=dtype)
    assert y.dtype == dtype
    ref = _exact(*_quantized_x(x, ACT[w_kind]), ACT[w_kind], w_q, w_s, w_kind, None)
    assert nu.rel_diff(y.cpu().float(), ref) < 1e-4


def test_gemv_block_scale_layouts_agree():
    """Row- and column-major activation scales (the group quantizer's two layouts) give the same bytes."""
    x, w_q, w_s, b = _row(96, 640, "block", seed=21)
    ys = []
    for col_major in (False, True):
        x_q, x_s = tq.quantize_act_group(x, col_major=col_major)
        ys.append(tv.gemv(x_q, w_q, w_s, "block", b, x_scale=x_s, config=dict(BLOCK_N=8, BLOCK_K=256)))
    assert torch.equal(ys[0], ys[1])


def test_gemv_misindexed_scale_control():
    """A rolled weight scale (control) moves the result: the scales are really applied per tile."""
    x, w_q, w_s, b = _row(256, 512, "block", seed=5)
    x_q, x_s = tq.quantize_act_group(x)
    y = tv.gemv(x_q, w_q, w_s, "block", b, x_scale=x_s)
    rolled = tv.gemv(x_q, w_q, w_s.roll(1, 1).contiguous(), "block", b, x_scale=x_s)
    assert nu.rel_diff(rolled.cpu().float(), y.cpu().float()) > 1e-3


def test_gemv_rejects_bad_inputs():
    x, w_q, w_s, _ = _row(64, 256, "block", seed=1)
    x_q, x_s = tq.quantize_act_group(x)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        tv.gemv(torch.cat([x_q] * 5), w_q, w_s, "block", x_scale=torch.cat([x_s] * 5))
    with pytest.raises(ValueError, match="w_kind"):
        tv.gemv(x_q, w_q, w_s, "group", x_scale=x_s)
    with pytest.raises(ValueError, match="pre-quantized"):
        tv.gemv(x, w_q, w_s, "block", x_scale=x_s)
    with pytest.raises(ValueError, match="x_scale"):
        tv.gemv(x_q, w_q, w_s, "block", x_scale=x_s[:, :1])
    with pytest.raises(ValueError, match="w_s"):
        tv.gemv(x_q, w_q, w_s[:, :1], "block", x_scale=x_s)
    with pytest.raises(ValueError, match="powers of two"):
        tv.gemv(x_q, w_q, w_s, "block", x_scale=x_s, config=dict(BLOCK_N=3))
    with pytest.raises(ValueError, match="contiguous along K"):
        tv.gemv(x_q, w_q.t().contiguous().t(), w_s, "block", x_scale=x_s)
    xt_q, xt_s = tq.quantize_act_token(x)
    wc_q, wc_s = nu.quantize_weight(varied((64, 256), torch.float32, seed=2), "channel")
    with pytest.raises(ValueError, match="x_scale"):
        tv.gemv(xt_q, wc_q.to(DEV), wc_s.to(DEV), "channel", x_scale=xt_s.expand(1, 2))
