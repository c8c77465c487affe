"""The M = 1 FP8 GEMV (CUDA-core products, no K split) against float64 products of the same FP8 operands.

Without a CUDA device the kernel runs in Triton's interpreter, so shapes stay tiny; there the FP8
activation comes from the Triton quantizers (the interpreter's fp32 -> fp8 cast is defective, SPEC §2),
on a GPU from `numerics`. The reference is the float64 product of the same FP8 operands.
"""

import pytest
import torch

pytest.importorskip("triton")

from fp8now import numerics as nu  # noqa: E402  (conftest chose the interpreter before this import)
from fp8now.kernels import triton_gemm as tg, triton_gemv as tv, triton_quant as tq  # noqa: E402
from fp8_oracle import varied  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(tg.available(DEV) is not None, reason=f"Triton: {tg.available(DEV)}")]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
W_GROUP = {"tensor": (-1, -1), "channel": (1, -1), "block": (128, 128)}
ACT = {"tensor": "token", "channel": "token", "block": "group"}


def _operands(n, k, w_kind, seed, bias=True, dtype=BF16):
    x = varied((1, k), torch.float32, seed=seed, spread=3) * 0.25
    x[0, :3] = 300.0                   # outliers next to small values
    x[0, 128:256] = 0.0                # an all-zero group: the group scale floor
    w_q, w_s = nu.quantize_weight(varied((n, k), torch.float32, seed=seed + 1, spread=3), w_kind)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    return x.to(dtype).to(DEV), w_q.to(DEV), w_s.to(DEV), None if b is None else b.to(DEV)


def _quantized_x(x, act):
    if DEV.type == "cpu":
        return tq.quantize_act_token(x) if act == "token" else tq.quantize_act_group(x)
    return nu.quantize_activation(x, act)


def _exact(x_q, x_s, w_kind, w_q, w_s, b):
    act = ACT[w_kind]
    y = (nu.dequantize(x_q.cpu(), x_s.cpu(), (1, -1) if act == "token" else (1, 128)).double()
         @ nu.dequantize(w_q.cpu(), w_s.cpu(), W_GROUP[w_kind]).double().T)
    return y if b is None else y + b.cpu().double()


def _gemv(x, w_q, w_s, w_kind, b, **kw):
    x_q, x_s = _quantized_x(x, ACT[w_kind])
    return tv.gemv(x_q, w_q, w_s, w_kind, b, x_scale=x_s, **kw)


@pytest.mark.parametrize("w_kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("n,k,cfg", [(200, 640, dict(BLOCK_N=4, BLOCK_K=256)),     # N tail, K tail
                                     (96, 1024, dict(BLOCK_N=16, BLOCK_K=512)),
                                     (130, 384, dict(BLOCK_N=8, BLOCK_K=128)),
                                     (64, 256, None)])                             # shipped config
def test_gemv_matches_exact_product(w_kind, n, k, cfg):
    x, w_q, w_s, b = _operands(n, k, w_kind, seed=n + k)
    y = _gemv(x, w_q, w_s, w_kind, b, out_dtype=FP32, config=cfg)
    ref = _exact(*_quantized_x(x, ACT[w_kind]), w_kind, w_q, w_s, b)
    assert y.shape == (1, n) and y.dtype == FP32 and torch.isfinite(y).all()
    assert nu.rel_diff(y.cpu(), ref) < 1e-6
    assert float((y.cpu().double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("w_kind", ["channel", "block"])
def test_gemv_output_dtype_without_bias(w_kind, dtype):
    x, w_q, w_s, _ = _operands(64, 512, w_kind, seed=9, bias=False, dtype=dtype)
    y = _gemv(x, w_q, w_s, w_kind, None, out_dtype=dtype)
    assert y.dtype == dtype
    ref = _exact(*_quantized_x(x, ACT[w_kind]), w_kind, w_q, w_s, None)
    assert nu.rel_diff(y.cpu().float(), ref) < 1e-4


def test_gemv_block_scale_layouts_agree():
    """Row- and column-major activation scales (the group quantizer's two layouts) give the same bytes."""
    x, w_q, w_s, b = _operands(96, 640, "block", seed=21)
    ys = []
    for col_major in (False, True):
        x_q, x_s = tq.quantize_act_group(x, col_major=col_major)
        ys.append(tv.gemv(x_q, w_q, w_s, "block", b, x_scale=x_s, config=dict(BLOCK_N=8, BLOCK_K=256)))
    assert torch.equal(ys[0], ys[1])


def test_gemv_misindexed_scale_control():
    """A rolled weight scale (control) moves the result: the scales are really applied per tile."""
    x, w_q, w_s, b = _operands(256, 512, "block", seed=5)
    x_q, x_s = tq.quantize_act_group(x)
    y = tv.gemv(x_q, w_q, w_s, "block", b, x_scale=x_s)
    rolled = tv.gemv(x_q, w_q, w_s.roll(1, 1).contiguous(), "block", b, x_scale=x_s)
    assert nu.rel_diff(rolled.cpu().float(), y.cpu().float()) > 1e-3


def test_gemv_rejects_bad_inputs():
    x, w_q, w_s, _ = _operands(64, 256, "block", seed=1)
    x_q, x_s = tq.quantize_act_group(x)
    with pytest.raises(ValueError, match="one row"):
        tv.gemv(torch.cat([x_q] * 2), w_q, w_s, "block", x_scale=x_s)
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
    with pytest.raises(ValueError, match="BLOCK_K >= 128"):
        tv.gemv(x_q, w_q, w_s, "block", x_scale=x_s, config=dict(BLOCK_K=64))
    with pytest.raises(ValueError, match="contiguous along K"):
        tv.gemv(x_q, w_q.t().contiguous().t(), w_s, "block", x_scale=x_s)
    xt_q, xt_s = tq.quantize_act_token(x)
    wc_q, wc_s = nu.quantize_weight(varied((64, 256), torch.float32, seed=2), "channel")
    with pytest.raises(ValueError, match="x_scale"):
        tv.gemv(xt_q, wc_q.to(DEV), wc_s.to(DEV), "channel", x_scale=xt_s.expand(1, 2))
