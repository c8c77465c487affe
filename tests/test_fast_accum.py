"""Fp8Config(fast_accum=True): config checks, the plan's marks, the refusals, and the fast kernels
against the exact float64 product of the same FP8 operands (Triton's interpreter on CPU, tiny shapes;
the H200 runs the `gpu` test at the end)."""

import pytest
import torch
from cli_here import fp8now_here
from test_models import embedded_model_dir, needs_gguf

from fp8now import Fp8Config, Fp8Linear, Scheme
from fp8now import numerics as nu
from fp8now.kernels import pick_backend
from fp8now.kernels.plan import FAST_ACCUM_GEMMS, Table, plan
from fp8_oracle import varied

W_GROUP = {"tensor": (-1, -1), "channel": (1, -1)}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_config_default_off_and_type_checked():
    assert Fp8Config().fast_accum is False
    assert Fp8Config(scheme="ptpc", fast_accum=True).fast_accum is True
    with pytest.raises(TypeError, match="fast_accum must be True or False"):
        Fp8Config(fast_accum="yes")


def test_block_refuses_fast_accum_and_says_why():
    for name in ("block", "fp8_block", "per-block"):
        with pytest.raises(ValueError, match="scheme 'block'.*128-wide K-block.*fast_accum=True"):
            Fp8Config(scheme=name, fast_accum=True)
    # routed experts do not use it, so a block moe_scheme beside a channel dense scheme is fine
    assert Fp8Config(scheme="channel", moe_scheme="block", fast_accum=True).expert_scheme is Scheme.BLOCK


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (2, 4096, 4096), (8, 6144, 4096), (8, 2048, 2048),
                                   (48, 4096, 4096), (4096, 4096, 4096)])
def test_plan_marks_exactly_the_gemms_with_the_mode(scheme, m, n, k):
    for backend, dclass in (("triton", "cuda-fp8"), ("torch", "cuda-fp8")):
        exact = plan(backend, scheme, "token", m, n, k, dclass)
        fast = plan(backend, scheme, "token", m, n, k, dclass, fast_accum=True)
        assert not exact.fast_accum and "fast-accum" not in exact.name
        assert fast.fast_accum == (exact.gemm in FAST_ACCUM_GEMMS)
        assert ("fast-accum" in fast.name) == fast.fast_accum
        # nothing else changes: the same kernel, quantizer and launch details
        assert (fast.gemm, fast.quant, fast.config, fast.pdl) == (exact.gemm, exact.quant, exact.config, exact.pdl)


def test_plan_fast_accum_on_every_tensor_core_gemm_and_not_on_gemv_or_block():
    gemv_everywhere = Table(gemv=(("channel", 1, 0, 1 << 40),), tensorwise_m1=False)
    paths = [plan("triton", "channel", "token", m, 2048, 4096, "cuda-fp8", fast_accum=True) for m in (2, 8, 64, 4096)]
    assert {p.gemm for p in paths} == {"triton-decode", "triton-rowwise", "cublas-rowwise"}
    assert all(p.fast_accum for p in paths)
    assert plan("triton", "channel", "token", 8, 6144, 4096, "cuda-fp8", fast_accum=True).gemm \
        == "triton-decode-exchange"
    gemv = plan("triton", "channel", "token", 1, 4096, 4096, "cuda-fp8", table=gemv_everywhere, fast_accum=True)
    assert gemv.gemm == "triton-gemv" and not gemv.fast_accum           # CUDA-core float32 products
    block = plan("triton", "block", "group", 4096, 4096, 4096, "cuda-fp8", fast_accum=True)
    assert not block.fast_accum
    tensorwise = plan("torch", "tensor", "tensor", 64, 4096, 4096, "cuda-fp8", fast_accum=True)
    assert tensorwise.gemm == "cublas-tensorwise" and tensorwise.name.endswith("(fast-accum)")


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_cpu_backends_refuse_fast_accum_listing_each(scheme):
    act = Fp8Config(scheme=scheme).act_kind()
    with pytest.raises(RuntimeError) as e:
        pick_backend("cpu", scheme, act, 64, 64, fast_accum=True)
    msg = str(e.value)
    assert "fast_accum=True" in msg and "cpu: fast_accum=True: oneDNN" in msg
    assert "reference: fast_accum=True: the exact float64 product" in msg
    with pytest.raises(RuntimeError, match="torch: fast_accum=True: torch's CPU _scaled_mm"):
        pick_backend("cpu", scheme, act, 64, 64, forced="torch", fast_accum=True)
    assert pick_backend("cpu", scheme, act, 64, 64) == "cpu"      # off: unchanged


def test_fp8linear_on_cpu_refuses_at_load():
    lin = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no FP8 backend fits.*fast_accum=True"):
        Fp8Linear.from_linear(lin, Fp8Config(fast_accum=True), name="model.layers.0.mlp.up_proj")


@pytest.mark.slow
@needs_gguf
def test_cli_fast_accum_on_cpu_is_one_clear_error(monkeypatch, capsys):
    """Through main() in this process (inspect and eval run as real subprocesses in test_cli.py and
    test_first_run.py), on the default model from the session's converted cache."""
    monkeypatch.setenv("FP8NOW_CACHE", str(embedded_model_dir()[0].parent))
    out = fp8now_here(capsys, "inspect", "--device", "cpu", "--fast-accum")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.startswith("fp8now: error: no FP8 backend fits"), out.stderr
    assert "fast_accum=True" in out.stderr and "Traceback" not in out.stderr
    block = fp8now_here(capsys, "eval", "--scheme", "block", "--fast-accum")
    assert block.returncode == 1 and "does not apply to scheme 'block'" in block.stderr, block.stderr


def _operands(m, n, k, w_kind, seed):
    x = (varied((m, k), torch.float32, seed=seed, spread=3) * 0.25).to(torch.bfloat16)
    w_q, w_s = nu.quantize_weight(varied((n, k), torch.float32, seed=seed + 1, spread=3), w_kind)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2))
    return x.to(DEV), w_q.to(DEV), w_s.to(DEV), b.to(DEV)


def _exact(x_q, x_s, w_q, w_s, w_kind, b):
    y = (nu.dequantize(x_q.cpu(), x_s.cpu(), (1, -1)).double()
         @ nu.dequantize(w_q.cpu(), w_s.cpu(), W_GROUP[w_kind]).double().T)
    return y + b.cpu().double()


def _close(y, ref):
    """SPEC §4's tolerance, over the whole output and per row."""
    assert torch.isfinite(y).all()
    assert nu.rel_diff(y.float().cpu(), ref) < 1e-4
    assert max(nu.rel_diff(y[i].float().cpu(), ref[i]) for i in range(y.shape[0])) < 1e-4


@pytest.mark.triton
@pytest.mark.parametrize("w_kind", ["tensor", "channel"])
@pytest.mark.parametrize("m,n,k,config", [(5, 96, 640, None), (33, 80, 384, dict(SPLIT_K=3)),
                                          (20, 64, 256, dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2))])
def test_rowwise_fast_accum_matches_exact_product(w_kind, m, n, k, config):
    pytest.importorskip("triton")
    from fp8now.kernels.triton_rowwise import rowwise_gemm

    x, w_q, w_s, b = _operands(m, n, k, w_kind, seed=m + n + k)
    x_q, x_s = nu.quantize_activation(x, "token")
    y = rowwise_gemm(x_q, x_s, w_q, w_s, b, torch.float32, config=config, fast_accum=True)
    _close(y, _exact(x_q, x_s, w_q, w_s, w_kind, b))


@pytest.mark.triton
@pytest.mark.parametrize("w_kind", ["tensor", "channel"])
@pytest.mark.parametrize("m,n,k,split,exchange", [(1, 96, 640, 3, False), (7, 130, 512, 2, True),
                                                  (16, 64, 384, 1, False)])
def test_decode_fast_accum_matches_exact_product(w_kind, m, n, k, split, exchange):
    pytest.importorskip("triton")
    from fp8now.kernels import triton_decode as td

    x, w_q, w_s, b = _operands(m, n, k, w_kind, seed=10 * m + n)
    x_q, x_s = nu.quantize_activation(x, "token")
    slots = td.exchange_slots(n, split, DEV) if exchange else None
    y = td.decode_linear(x_q, w_q, w_s, w_kind, "token", b, x_scale=x_s, out_dtype=torch.float32,
                         config=dict(SPLIT_K=split), slots=slots, fast_accum=True)
    _close(y, _exact(x_q, x_s, w_q, w_s, w_kind, b))
    if exchange:
        assert bool((slots == td.EMPTY).all()), "the exchange must leave its slots empty"


@pytest.mark.triton
def test_decode_fast_accum_refuses_group_scales():
    pytest.importorskip("triton")
    from fp8now.kernels import triton_decode as td

    w_q, w_s = nu.quantize_weight(torch.randn(128, 256), "block")
    with pytest.raises(ValueError, match="fast_accum applies to per-token scales only"):
        td.decode_linear(torch.randn(1, 256, dtype=torch.bfloat16), w_q, w_s, "block", "group", fast_accum=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("scheme", ["tensor", "channel"])
@pytest.mark.parametrize("m", [1, 2, 8, 48, 300])
def test_gpu_fast_accum_layer_matches_exact_product(scheme, m):
    """Every planned path with fast accumulation (GEMV, decode, Triton rowwise, cuBLAS) on real tensor cores."""
    n, k = 2048, 4096
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16, device="cuda")
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, fast_accum=True, decode_graphs=False))
    x = (varied((m, k), torch.float32, seed=m, spread=3) * 0.25).to(torch.bfloat16).cuda()
    y = layer(x)
    x_q, x_s = nu.quantize_activation(x, "token")
    ref = _exact(x_q, x_s, layer.weight, layer.weight_scale, scheme, layer.bias)
    assert layer.path(m).fast_accum == (layer.path(m).gemm in FAST_ACCUM_GEMMS)
    _close(y, ref)


def test_transformers_door_passes_fast_accum():
    from fp8now import TransformersConfig

    assert TransformersConfig(scheme="tensor", fast_accum=True).fp8_config().fast_accum is True
    assert TransformersConfig().fp8_config().fast_accum is False
    with pytest.raises(ValueError, match="does not apply to scheme 'block'"):
        TransformersConfig(scheme="block", fast_accum=True)
