"""The dispatch table: choices, forced backends, and errors that list every rejected candidate."""

import pytest
import torch

from fp8now import Fp8Config, Fp8Linear, Scheme
from fp8now.kernels import TABLE, device_class, pick_backend
from hang import HANG_S


def test_cpu_defaults_to_the_cpu_backend():
    assert device_class(torch.device("cpu")) == "cpu"
    for scheme in Scheme:
        assert pick_backend("cpu", scheme, Fp8Config(scheme=scheme).act_kind(), 256, 256) == "cpu"


def test_table_covers_every_device_class_and_scheme():
    for dclass in ("cpu", "cuda", "cuda-fp8"):
        for scheme in Scheme:
            assert TABLE[(dclass, scheme)], (dclass, scheme)
    # channel must never be given to a weight-only kernel (SPEC §9)
    assert all("w8a16" not in name for (d, s), names in TABLE.items() if s is Scheme.CHANNEL
               for name in names)


def test_forced_backend_error_lists_reason():
    with pytest.raises(RuntimeError, match=r"scheme 'block'.*torch: blockwise scaled_mm is not offered"):
        pick_backend("cpu", Scheme.BLOCK, "group", 256, 256, forced="torch")


def test_cublas_blockwise_k_alignment():
    """cuBLAS blockwise needs the K/128 weight-scale columns 16-byte aligned: K % 512 == 0 is taken,
    other K are refused with that reason (the triton backend then keeps the Triton block GEMM)."""
    from fp8now.kernels import torch_mm
    for k in (512, 2048, 4096, 7168, 8192, 14336, 28672):
        assert torch_mm.blockwise_unfit(k) is None
    for k in (128, 384, 1152, 4224):
        assert "divisible by 512" in torch_mm.blockwise_unfit(k)


def test_batch_invariant_rejects_cublas():
    with pytest.raises(RuntimeError, match=r"batch_invariant=True.*torch: cuBLAS"):
        pick_backend("cpu", Scheme.CHANNEL, "token", 256, 256, forced="torch", batch_invariant=True)
    assert pick_backend("cpu", Scheme.CHANNEL, "token", 256, 256, batch_invariant=True) == "cpu"


def test_torch_needs_dims_divisible_by_16():
    with pytest.raises(RuntimeError, match=r"divisible by 16 \(N=100, K=256\)"):
        pick_backend("cpu", Scheme.CHANNEL, "token", 100, 256, forced="torch")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"unknown backend 'cutlass'; known: reference, cpu, torch, triton, triton-w8a16"):
        pick_backend("cpu", Scheme.CHANNEL, "token", 256, 256, forced="cutlass")


def test_layer_picks_on_load():
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme="tensor", backend="torch"))
    assert layer.backend == "torch"


def test_every_backend_has_a_planner_and_the_interface():
    """A backend is its module (available, linear; optional workspace) plus a planner in kernels.plan."""
    from fp8now.kernels import MODULES, backend_module
    from fp8now.kernels.plan import PLANNERS
    assert set(MODULES) == set(PLANNERS)
    for name in MODULES:
        module = backend_module(name)
        assert callable(module.available) and callable(module.linear), name


def test_importable_without_triton(tmp_path):
    """With triton unimportable, fp8now and every kernel module import; the Triton backends say why
    they cannot run, and a layer runs on the reference backend, reporting its path."""
    import subprocess
    import sys
    code = """
import sys
sys.modules["triton"] = None
import torch
import fp8now
from fp8now import Fp8Config, Fp8Linear
from fp8now.kernels import MODULES, backend_module, pick_backend, triton_quant
for name in MODULES:
    backend_module(name)
for mod in ("triton_block", "triton_rowwise", "triton_splitk", "triton_wquant", "triton_gemv", "triton_decode"):
    __import__("fp8now.kernels." + mod)
assert "triton is not importable" in triton_quant.available("cpu")
try:
    pick_backend("cpu", "channel", "token", 64, 64, forced="triton")
    raise SystemExit("triton was picked")
except RuntimeError as e:
    assert "triton is not importable" in str(e), e
layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32), Fp8Config())
assert layer(torch.randn(2, 64)).shape == (2, 32)
print(layer.backend, layer.path(1).name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "cpu cpu-token + bf16-matmul"
