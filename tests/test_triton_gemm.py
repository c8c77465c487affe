"""Triton FP8 GEMMs against float64 references built from the same quantized operands.

Without a CUDA device the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), so shapes stay tiny. With a GPU the same tests run there.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fp8now import numerics as nu  # noqa: E402
from fp8now.kernels.plan import TABLES  # noqa: E402
from fp8now.kernels import triton_jit as tj, triton_splitk as tk, triton_w8a16 as tw  # noqa: E402
from fp8now.kernels.triton_block import block_gemm  # noqa: E402
from fp8now.kernels.triton_rowwise import rowwise_gemm  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(tj.available(DEV) is not None, reason=f"Triton FP8 kernels: {tj.available(DEV)}"),
]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOKEN, GROUP = (1, -1), (1, 128)
W_GROUP = {"tensor": (-1, -1), "channel": (1, -1), "block": (128, 128)}
SMALL = dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2)   # many tiles, swizzled
WIDE = dict(BLOCK_M=16, BLOCK_N=256, GROUP_M=1, num_warps=4, num_stages=2)   # N tile over 2 scale rows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _varied(rows: int, cols: int, row_group: int, g: torch.Generator) -> torch.Tensor:
    """Gaussian data whose magnitude changes by powers of two per row and per (row_group x 128) tile.

    A transposed or mis-indexed scale then lands on data of another magnitude and shows up at once.
    """
    base = torch.randn(rows, cols, generator=g) * 0.25
    row_f = 2.0 ** torch.randint(-3, 4, (rows, 1), generator=g)
    tiles = 2.0 ** torch.randint(-2, 3, (-(-rows // row_group), -(-cols // 128)), generator=g)
    tile_f = tiles.repeat_interleave(row_group, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return base * row_f * tile_f


def _ref(x_q, x_s, x_group, w_q, w_s, w_group, bias=None) -> torch.Tensor:
    """float64 product of the dequantized operands (+ bias)."""
    y = nu.dequantize(x_q, x_s, x_group).double() @ nu.dequantize(w_q, w_s, w_group).double().T
    return y if bias is None else y + bias.double()


def _check(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    """Global and per-row rel_diff below `tol`, no NaN (a row of small magnitude cannot hide)."""
    assert y.shape == ref.shape
    assert not torch.isnan(y).any()
    d = nu.rel_diff(y.cpu(), ref.cpu())
    assert d < tol, d
    worst = max(nu.rel_diff(y[m].cpu(), ref[m].cpu()) for m in range(y.shape[0]))
    assert worst < tol, worst


def _block_operands(m, n, k, seed, bias):
    g = _gen(seed)
    x = _varied(m, k, 1, g)
    w = _varied(n, k, 128, g)
    b = torch.randn(n, generator=g) if bias else None
    x_q, x_s = nu.quantize_activation(x, "group")
    w_q, w_s = nu.quantize_weight(w, "block")
    ref = _ref(x_q, x_s, GROUP, w_q, w_s, W_GROUP["block"], b)
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return to(x_q), to(x_s), to(w_q), to(w_s), to(b), ref


def test_varied_data_exposes_misindexed_scales():
    """Control: the test data makes a mis-indexed scale a large error (pure torch, no kernel)."""
    x_q, x_s, w_q, w_s, _, ref = _block_operands(33, 200, 320, 0, False)
    x_q, x_s, w_q, w_s = x_q.cpu(), x_s.cpu(), w_q.cpu(), w_s.cpu()
    wrong_rows = _ref(x_q, x_s.roll(1, 0), GROUP, w_q, w_s, W_GROUP["block"])
    wrong_tiles = _ref(x_q, x_s, GROUP, w_q, w_s.roll(1, 1), W_GROUP["block"])
    assert nu.rel_diff(wrong_rows, ref) > 1e-2
    assert nu.rel_diff(wrong_tiles, ref) > 1e-2


# ---------------------------------------------------------------------------------------------------
# block_gemm
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,bias,dtype,config", [
    (1, 64, 128, False, BF16, None),
    (3, 200, 320, True, FP16, None),
    (33, 200, 256, True, BF16, None),
    (33, 64, 320, False, FP16, None),
    (33, 200, 320, True, BF16, SMALL),
    (3, 200, 320, False, FP32, WIDE),
])
def test_block_gemm(m, n, k, bias, dtype, config):
    x_q, x_s, w_q, w_s, b, ref = _block_operands(m, n, k, 1 + m + n + k, bias)
    y = block_gemm(x_q, x_s, w_q, w_s, b, out_dtype=dtype, config=config)
    assert y.dtype == dtype
    _check(y, ref)


def test_block_gemm_column_major_scales():
    x_q, x_s, w_q, w_s, b, ref = _block_operands(33, 200, 320, 7, True)
    x_s_cm = torch.empty((x_s.shape[1], x_s.shape[0]), dtype=torch.float32, device=DEV).t()
    x_s_cm.copy_(x_s)
    assert x_s_cm.stride() == (1, x_s.shape[0])
    y_rm = block_gemm(x_q, x_s, w_q, w_s, b, config=SMALL)
    y_cm = block_gemm(x_q, x_s_cm, w_q, w_s, b, config=SMALL)
    assert torch.equal(y_rm, y_cm)
    _check(y_cm, ref)


def test_block_gemm_rejects_bad_inputs():
    x_q, x_s, w_q, w_s, _, _ = _block_operands(3, 64, 256, 3, False)
    with pytest.raises(ValueError, match="BLOCK_K"):
        block_gemm(x_q, x_s, w_q, w_s, config=dict(BLOCK_K=64))
    with pytest.raises(ValueError, match="x_s"):
        block_gemm(x_q, x_s[:, :1], w_q, w_s)
    with pytest.raises(ValueError, match="unknown config"):
        block_gemm(x_q, x_s, w_q, w_s, config=dict(BLOCK=64))
    for bad in (-1, "2", 2.0):
        with pytest.raises(ValueError, match="SPLIT_K"):
            block_gemm(x_q, x_s, w_q, w_s, config=dict(SPLIT_K=bad))
    with pytest.raises(TypeError):
        block_gemm(x_q.float(), x_s, w_q, w_s)


# ---------------------------------------------------------------------------------------------------
# rowwise_gemm
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,act,wscheme,bias,dtype", [
    (3, 200, 320, "token", "channel", True, BF16),
    (33, 64, 256, "token", "channel", False, FP16),
    (1, 200, 128, "token", "tensor", True, BF16),
    (33, 200, 320, "tensor", "channel", False, BF16),
    (3, 64, 320, "tensor", "tensor", True, FP32),
])
def test_rowwise_gemm(m, n, k, act, wscheme, bias, dtype):
    g = _gen(11 + m + n + k)
    x = _varied(m, k, 1, g)
    w = _varied(n, k, 1, g)
    b = torch.randn(n, generator=g) if bias else None
    x_q, x_s = nu.quantize_activation(x, act)
    w_q, w_s = nu.quantize_weight(w, wscheme)
    ref = _ref(x_q, x_s, TOKEN if act == "token" else (-1, -1), w_q, w_s, W_GROUP[wscheme], b)
    y = rowwise_gemm(x_q.to(DEV), x_s.to(DEV), w_q.to(DEV), w_s.to(DEV),
                        None if b is None else b.to(DEV), out_dtype=dtype)
    assert y.dtype == dtype
    _check(y, ref)


@pytest.mark.parametrize("row", range(len(TABLES["cuda-fp8"].rowwise_mid)))
def test_rowwise_gemm_with_the_plans_mid_m_configs(row):
    """The configs the plan gives the rowwise GEMM between the decode kernel's 16 rows and cuBLAS (Table.rowwise_mid:
    5 stages, K in 1 or 2 splits), on 40 token-scaled rows whose K (5 blocks) does not split evenly, channel and
    tensor weights, against float64."""
    config = dict(TABLES["cuda-fp8"].rowwise_mid[row][2])
    g = _gen(71 + row)
    m, n, k = 40, 136, 640
    x = _activation(m, k, BF16, g)
    b = torch.randn(n, generator=g)
    x_q, x_s = nu.quantize_activation(x, "token")
    for wscheme in ("channel", "tensor"):
        w_q, w_s = nu.quantize_weight(_varied(n, k, 1, g), wscheme)
        ref = _ref(x_q, x_s, TOKEN, w_q, w_s, W_GROUP[wscheme], b)
        y = rowwise_gemm(*(t.to(DEV) for t in (x_q, x_s, w_q, w_s, b)), out_dtype=BF16, config=config)
        _check(y, ref)


# ---------------------------------------------------------------------------------------------------
# batch invariance
# ---------------------------------------------------------------------------------------------------

def _embed(fixed: torch.Tensor, size: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """A batch of `size` rows holding the first min(size, len(fixed)) fixed rows at random places."""
    used = min(size, fixed.shape[0])
    batch = _varied(size, fixed.shape[1], 1, g).to(fixed.dtype)
    where = torch.randperm(size, generator=g)[:used].tolist()
    batch[where] = fixed[:used]
    return batch, where


@pytest.mark.parametrize("kind", ["block", "rowwise"])
def test_batch_invariant(kind):
    g = _gen(5)
    n, k = 200, 320
    fixed = _varied(5, k, 1, g).to(BF16)
    w = _varied(n, k, 128, g)
    scheme = "channel" if kind == "rowwise" else "block"
    w_q, w_s = (t.to(DEV) for t in nu.quantize_weight(w, scheme))

    def run(batch):
        x_q, x_s = (t.to(DEV) for t in nu.quantize_activation(batch, "group" if kind == "block" else "token"))
        gemm = block_gemm if kind == "block" else rowwise_gemm
        return gemm(x_q, x_s, w_q, w_s, out_dtype=BF16, batch_invariant=True)

    outs = {}
    for size in (40, 17, 3, 1):
        batch, where = _embed(fixed, size, g)
        y = run(batch)
        outs[size] = [y[i] for i in where]
    for size in (17, 3, 1):
        for j, row in enumerate(outs[size]):
            assert torch.equal(row, outs[40][j]), (kind, size, j)


def _activation(m, k, dtype, g):
    x = _varied(m, k, 1, g)
    if m > 2:
        x[1] = 0.0                 # all-zero row: scale floor
        x[2, :5] = 300.0            # outliers next to tiny values in one row
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------------
# split-K (decode): partial sums in a workspace, reduced in order by a second kernel
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["block", "rowwise-channel", "rowwise-tensor"])
@pytest.mark.parametrize("split,bias", [(2, True), (3, False), (5, True)])
def test_split_k_matches_reference(kind, split, bias):
    """K=640 in 2 / 3 / 5 splits (the last one short or, for 5 splits of 128, exact), every M tail."""
    g = _gen(61 + split)
    m, n, k = 5, 200, 640
    x = _activation(m, k, BF16, g)
    scheme = "block" if kind == "block" else kind.split("-")[1]
    w_q, w_s = nu.quantize_weight(_varied(n, k, 128, g), scheme)
    b = torch.randn(n, generator=g) if bias else None
    act = GROUP if kind == "block" else TOKEN
    x_q, x_s = nu.quantize_activation(x, "group" if kind == "block" else "token")
    ref = _ref(x_q, x_s, act, w_q, w_s, W_GROUP[scheme], b)
    gemm = block_gemm if kind == "block" else rowwise_gemm
    args = [t.to(DEV) for t in (x_q, x_s, w_q, w_s)] + [None if b is None else b.to(DEV)]
    y32 = gemm(*args, out_dtype=FP32, config=dict(SPLIT_K=split))
    assert nu.rel_diff(y32.cpu(), ref) < 1e-6
    y1 = gemm(*args, out_dtype=FP32, config=dict(SPLIT_K=1))
    assert nu.rel_diff(y32.cpu(), y1.cpu()) < 1e-6
    y = gemm(*args, out_dtype=BF16, config=dict(SPLIT_K=split))
    assert y.dtype == BF16
    _check(y, ref)


def test_split_k_auto_choice():
    """Auto split: about four programs per SM, each split >= SPLIT_MIN_K (an H200's 132 SMs; tiles of
    16 x 32 outputs)."""
    assert tk.auto_splits(4096 // 32, 4096, 132) == 5            # 128 tiles -> 528 programs
    assert tk.auto_splits(4096 // 32, 14336, 132) == 5
    assert tk.auto_splits(28672 // 32, 4096, 132) == 1           # 896 tiles are enough
    assert tk.auto_splits(12288 // 32, 4096, 132) == 2           # 384 tiles, two splits
    assert tk.auto_splits(64 // 32, 1024, 132) == 2              # capped by K // 512
    cfg, cpu = dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=0), torch.device("cpu")   # the interpreter's SM count
    assert tk.split_k(cfg, 1, 4096, 4096, cpu) == 1 + (4 * tk.INTERPRETER_SMS - 1) // 128
    assert tk.split_k(dict(cfg, SPLIT_K=7), 1, 64, 1024, cpu) == 7
    assert tk.k_per_split(4096, 3, 128) == 1408 and tk.k_per_split(640, 5, 128) == 128


# ---------------------------------------------------------------------------------------------------
# W8A16
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,scheme,bias,dtype", [
    (1, 64, 128, "tensor", True, BF16),
    (3, 200, 320, "block", False, BF16),
    (33, 200, 256, "block", True, FP16),
    (33, 64, 320, "tensor", False, FP16),
])
def test_w8a16_gemm(m, n, k, scheme, bias, dtype):
    g = _gen(61 + m + n + k)
    x = _varied(m, k, 1, g).to(dtype)
    w_q, w_s = nu.quantize_weight(_varied(n, k, 128, g), scheme)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ nu.dequantize(w_q, w_s, W_GROUP[scheme]).double().T
    if b is not None:
        ref = ref + b.double()
    y = tw.w8a16_gemm(x.to(DEV), w_q.to(DEV), w_s.to(DEV), W_GROUP[scheme],
                      None if b is None else b.to(DEV))
    assert y.dtype == dtype
    _check(y, ref)


def test_w8a16_refuses_channel():
    w_q, w_s = nu.quantize_weight(torch.randn(64, 128), "channel")
    x = torch.randn(2, 128).to(BF16)
    with pytest.raises(ValueError, match="channel"):
        tw.w8a16_gemm(x.to(DEV), w_q.to(DEV), w_s.to(DEV), (1, -1))


# ---------------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------------

def test_available():
    assert tj.available(DEV) is None
    assert tw.available_gemm(DEV) is None
    assert isinstance(tj.available("meta"), str)
    assert isinstance(tw.available_gemm("meta"), str)
