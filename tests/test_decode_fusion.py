"""Issue 38's kernels against the unfused path and against independent references:
- the GEMV and the split-K decode kernel quantizing their own bf16 input (no quantizer launch) give the
  output of the Triton quantizer followed by the same kernel, bit for bit, and the float64 product;
- the RMSNorm kernel and the SiLU(gate) * up kernel write their output as transformers' modules compute
  it, and FP8 bytes + scales equal to what the Triton quantizer makes of that output.

Without a GPU the kernels run in Triton's interpreter (tiny shapes). Its fp32 -> fp8 cast is defective
(SPEC §2), so the FP8 operands of the float64 references come from the Triton quantizers there (the same
cast as the kernels), and from `numerics` on a GPU; scales are exact everywhere.
"""

import pytest
import torch

pytest.importorskip("triton")

from fp8now import numerics as nu  # noqa: E402  (conftest chose the interpreter before this import)
from fp8now.config import Scheme  # noqa: E402
from fp8now.kernels import triton_decode as td, triton_fp8, triton_gemv as tv, triton_jit as tj  # noqa: E402
from fp8now.kernels import triton_quant as tq  # noqa: E402
from fp8now.kernels.plan import QUANT_INSIDE, Table, Weights, plan  # noqa: E402
from fp8now.kernels.triton_norm import rms_norm  # noqa: E402
from fp8now.kernels.triton_silu_mul import silu_mul  # noqa: E402
from fp8_oracle import exact_product, group_scale, varied  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(tj.available(DEV) is not None, reason=f"Triton: {tj.available(DEV)}")]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ACT = {"tensor": "token", "channel": "token", "block": "group"}
X_GROUP = {"token": (1, -1), "group": (1, 128)}
W_GROUP = {"tensor": (-1, -1), "channel": (1, -1), "block": (128, 128)}


def operands(m, n, k, w_kind, seed, dtype=BF16, bias=True):
    """Rows with an all-zero row, outliers next to small values and an all-zero 1x128 group; a weight."""
    x = varied((m, k), torch.float32, seed=seed, spread=3) * 0.25
    x[0, :3] = 300.0
    x[0, 128:256] = 0.0
    if m > 2:
        x[1] = 0.0
    w_q, w_s = nu.quantize_weight(varied((n, k), torch.float32, seed=seed + 1, spread=3), w_kind)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    return x.to(dtype).to(DEV), w_q.to(DEV), w_s.to(DEV), None if b is None else b.to(DEV)


def quantizer(x, act):
    """The unfused path's quantizer: the Triton kernel the triton backend launches before the GEMM."""
    return tq.quantize_act_token(x) if act == "token" else tq.quantize_act_group(x)


def exact(x, act, w_q, w_s, w_kind, b):
    """float64 product of the FP8 operands (see the module docstring), plus bias."""
    x_q, x_s = quantizer(x, act) if DEV.type == "cpu" else nu.quantize_activation(x, act)
    y = exact_product(x_q.cpu(), x_s.cpu(), w_q.cpu(), w_s.cpu(), X_GROUP[act], W_GROUP[w_kind])
    return y if b is None else y + b.cpu().double()


GEMV_SHAPES = [(1, 200, 640, dict(BLOCK_N=4, BLOCK_K=256)),    # N tail, K tail (token)
               (1, 96, 1024, dict(BLOCK_N=16, BLOCK_K=512)),
               (1, 64, 256, None),                            # shipped configs
               (2, 72, 384, None),
               (3, 136, 384, dict(BLOCK_N=8, BLOCK_K=128)),   # M tail: wrapped row
               (4, 64, 640, None)]
# tensor and channel run the same kernel code (per-token activation scales; the weight's scale read with
# stride 0 or 1): each shape runs block and one of them, in turn, so both meet every row count but one.
GEMV_CASES = [(w_kind, *shape) for row, shape in enumerate(GEMV_SHAPES)
              for w_kind in (("tensor", "channel")[row % 2], "block")]


@pytest.mark.parametrize("w_kind,m,n,k,cfg", GEMV_CASES)
def test_gemv_quantizing_its_input_gives_the_quantizer_then_gemv(w_kind, m, n, k, cfg):
    """Every scheme, 1 to 4 rows, N / K tails: the same float32 output bit for bit (the same FP8 operands
    and the same products in the same order), and the float64 product of those operands."""
    x, w_q, w_s, b = operands(m, n, k, w_kind, seed=m + n + k)
    act = ACT[w_kind]
    inside = tv.gemv(x, w_q, w_s, w_kind, b, x_scale=None, out_dtype=FP32, config=cfg)
    x_q, x_s = quantizer(x, act)
    after = tv.gemv(x_q, w_q, w_s, w_kind, b, x_scale=x_s, out_dtype=FP32, config=cfg)
    assert inside.shape == (m, n) and torch.isfinite(inside).all()
    assert torch.equal(inside, after)
    ref = exact(x, act, w_q, w_s, w_kind, b)
    assert nu.rel_diff(inside.cpu(), ref) < 1e-6
    assert max(nu.rel_diff(inside[i].cpu(), ref[i]) for i in range(m) if ref[i].abs().sum() > 0) < 1e-6


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gemv_quantizing_its_input_outputs_its_dtype_and_refuses_partial_groups(dtype):
    x, w_q, w_s, _ = operands(1, 64, 512, "block", seed=4, dtype=dtype, bias=False)
    y = tv.gemv(x, w_q, w_s, "block", x_scale=None)
    assert y.dtype == dtype
    assert nu.rel_diff(y.cpu().float(), exact(x, "group", w_q, w_s, "block", None)) < 1e-4
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 128"):
        tv.gemv(x, w_q, w_s, "block", x_scale=None, config=dict(BLOCK_K=64))
    with pytest.raises(ValueError, match="pre-quantized"):
        tv.gemv(x, w_q, w_s, "block", x_scale=quantizer(x, "group")[1])


@pytest.mark.parametrize("w_kind", ["channel", "block"])
@pytest.mark.parametrize("m", [2, 5, 16])
def test_decode_kernel_quantizing_reads_only_real_rows(w_kind, m):
    """The split-K decode kernel quantizing its input reads rows past M as zeros (no re-read of wrapped
    rows): still the bytes of the quantizer then the kernel, and the float64 product."""
    x, w_q, w_s, b = operands(m, 96, 640, w_kind, seed=50 + m)
    act = ACT[w_kind]
    cfg = dict(SPLIT_K=3)
    inside = td.decode_linear(x, w_q, w_s, w_kind, act, b, out_dtype=FP32, config=cfg)
    x_q, x_s = quantizer(x, act)
    assert torch.equal(inside, td.decode_linear(x_q, w_q, w_s, w_kind, act, b, x_scale=x_s, out_dtype=FP32,
                                                config=cfg))
    assert nu.rel_diff(inside.cpu(), exact(x, act, w_q, w_s, w_kind, b)) < 1e-6


DECODE_SIZES = [(scheme, m, n) for scheme in ("tensor", "channel", "block") for m, n in [(1, 160), (3, 160), (8, 4096)]]


def decode_size_plans(scheme, m, n):
    """(K, the default table's path, the same with no GEMM quantizing inside) at M x N."""
    k = 256 if n > 1024 else 1024
    return k, *(plan("triton", Scheme(scheme), ACT[scheme], m, n, k, "cuda-fp8",
                     table=Table(tensorwise_m1=False, quant_inside=inside)) for inside in (QUANT_INSIDE, ()))


def test_triton_backend_plans_no_quantizer_launch_at_decode_sizes():
    """The default table: at M = 1 the GEMV (or the decode kernel) quantizes its own input, at M <= 16 the
    token decode kernels do, in the GEMM the plan without it runs after the Triton quantizer."""
    for scheme, m, n in DECODE_SIZES:
        _, fused, apart = decode_size_plans(scheme, m, n)
        inside_expected = m == 1 or ACT[scheme] == "token" or 4096 <= n <= 8192
        assert (fused.quant == "fused") == inside_expected, fused.name
        assert fused.gemm == apart.gemm and not fused.pdl
        always = scheme == "block" and m == 1 and n < 4096   # block below the GEMV's N: the decode kernel, fused
        assert apart.quant == ("fused" if always else "triton")


# At 8 x 4096 tensor plans channel's kernel (the weight's scale read with stride 0 instead of 1; the smaller
# sizes run both): channel stands for it there.
@pytest.mark.parametrize("scheme,m,n", [case for case in DECODE_SIZES if case != ("tensor", 8, 4096)])
def test_the_decode_size_plans_give_the_bytes_of_the_quantizer_then_the_gemm(scheme, m, n):
    """Through `triton_fp8.linear` the output of the default table's path is that of the same GEMM after the
    Triton quantizer (Table(quant_inside=())), bit for bit, and the float64 product of its operands."""
    k, fused, apart = decode_size_plans(scheme, m, n)
    x, w_q, w_s, b = operands(m, n, k, scheme, seed=7 * m + n)
    act = ACT[scheme]
    ws = triton_fp8.workspace(DEV, Scheme(scheme), act, n, k, False, None)
    y = triton_fp8.linear(x, Weights(w_q, w_s, b, ws), fused)
    assert torch.equal(y, triton_fp8.linear(x, Weights(w_q, w_s, b, ws), apart))
    assert nu.rel_diff(y.cpu().float(), exact(x, act, w_q, w_s, scheme, b)) < 1e-4


# --- the producers' kernels (fp8now.layers.producers) -------------------------------------------------------
def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b (same-sign finite values)."""
    bits = {BF16: torch.int16, FP16: torch.int16, FP32: torch.int32}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


def assert_bytes_of_the_quantizer(y, q, s, act):
    """q, s are the Triton quantizer's bytes of y, and s the SPEC's scales of y (independent oracle)."""
    q_ref, s_ref = quantizer(y, act)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    mags = y.float().cpu().abs()
    if act == "group":   # a partial last group is padded with zeros (SPEC §4)
        mags = torch.nn.functional.pad(mags, (0, -mags.shape[1] % 128))
    groups = mags.reshape(y.shape[0], -1, 128 if act == "group" else y.shape[1])
    rule = "group" if act == "group" else "row"
    want = torch.stack([torch.stack([group_scale(g.max(), rule) for g in row]) for row in groups])
    assert torch.equal(s.cpu(), want)


@pytest.mark.parametrize("act,k,dtype", [(act, k, dtype) for act in (None, "token", "group") for k in (192, 640, 1000)
                                         for dtype in (BF16, FP16, FP32)])
def test_rms_norm_kernel_is_the_llama_norm_and_writes_its_fp8_input(act, k, dtype):
    """Against transformers' LlamaRMSNorm (a real module): bf16 / fp16 at most one step of the dtype apart,
    in at most 1% of the elements, float32 within 1e-6 (the sum of squares runs in another order, the mean
    is a product with 1/K); the FP8 bytes and scales are the quantizer's of the kernel's own output
    (K = 1000: a partial last group, zero-padded)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(k, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(k)))
    norm = norm.to(DEV, dtype)
    x = (varied((6, k), torch.float32, seed=k, spread=4)).to(dtype).to(DEV)
    x[2] = 0.0                                    # an all-zero row: y = 0, the scale floor
    y, q, s = rms_norm(x, norm.weight.detach(), norm.variance_epsilon, act)
    want = norm(x).detach()
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y[2], want[2])
    if dtype == FP32:
        assert float(((y - want).abs() / want.abs().clamp_min(1e-30)).max()) < 1e-6
    else:
        apart = ulps_apart(y.cpu(), want.cpu())
        assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01
    if act is None:
        assert q is None and s is None
    else:
        assert_bytes_of_the_quantizer(y, q, s, act)


@pytest.mark.parametrize("act,i,m", [(None, 200, 3), (None, 20000, 3), ("token", 200, 3), ("token", 20000, 3),
                                     ("token", 2600, 130), ("group", 384, 3), ("group", 2560, 3)])
def test_silu_mul_kernel_is_act_fn_gate_times_up_and_writes_its_fp8_input(act, i, m):
    """Against transformers' SiLU activation times up on bf16 tensors: at most one bf16 step apart in at
    most 1% of the elements (the kernel's exp); the FP8 bytes and scales are the quantizer's of the
    kernel's own product (per token: whole rows at 3 rows of 200, two passes over 2048-column steps for rows of
    20000 or for more than 128 rows; 2560: two programs of 1x128 groups)."""
    from transformers.activations import ACT2FN
    g = varied((m, i), torch.float32, seed=i, spread=2).to(BF16).to(DEV)
    u = varied((m, i), torch.float32, seed=i + 1, spread=2).to(BF16).to(DEV)
    h = silu_mul(g, u)
    want = ACT2FN["silu"](g) * u
    apart = ulps_apart(h.cpu(), want.cpu())
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01
    if act is not None:
        q, s = silu_mul(g, u, act)
        assert_bytes_of_the_quantizer(h, q, s, act)


def test_producer_kernels_refuse_bad_input():
    x = torch.ones(2, 128, dtype=BF16, device=DEV)
    with pytest.raises(ValueError, match="share a dtype"):
        rms_norm(x, torch.ones(128, device=DEV), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[128\]"):
        rms_norm(x, torch.ones(64, dtype=BF16, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="act must be"):
        rms_norm(x, torch.ones(128, dtype=BF16, device=DEV), 1e-6, act="tensor")
    with pytest.raises(ValueError, match="gate and up must be"):
        silu_mul(x, x[:, :64])
    with pytest.raises(ValueError, match="act must be"):
        silu_mul(x, x, act="row")
