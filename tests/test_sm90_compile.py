"""Every Triton kernel compiles for sm_90 (and W8A16 for sm_80) with Triton's real compiler on this
CPU machine, in a subprocess without TRITON_INTERPRET (tests/sm90_compile.py). The GPU-only
branches come out as intended: the PDL decode kernel and GEMV wait on the grid dependency and only
they, the early-launch quantizers signal, and the prefill GEMM tiles use Hopper's wgmma."""

import json
import os
import subprocess
import sys

import pytest
from hang import HANG_S

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated (silences a warning)
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["kernel"]: r for r in rows}


def test_every_kernel_compiles(compiled):
    assert len(compiled) >= 20
    failed = {k: r["error"] for k, r in compiled.items() if not r["ok"]}
    assert not failed, failed


def test_pdl_only_where_asked(compiled):
    for name, r in compiled.items():
        assert r["gdc_wait"] == (name.startswith("decode group=False quant=False pdl=True")
                                 or name.startswith("gemv") and "pdl=True" in name), name
        if r["gdc_wait"]:  # nothing is read before the wait: the previous kernel may still be writing it
            assert not r["load_before_wait"], name
        assert r["gdc_launch"] == (name in ("row_quant single=True bk=4096 early=True",
                                            "group_quant bm=1 g=16 early=True")), name


def test_gemms_use_tensor_cores(compiled):
    for name, r in compiled.items():
        if "gemm" in name or name.startswith("decode"):
            assert r["mma"], name
    assert compiled["block_gemm M<=None"]["wgmma"] and compiled["rowwise_gemm M<=None"]["wgmma"]
    assert compiled["decode rows=64 tile=64x64"]["wgmma"]   # a 64-token batch's one tile: Hopper's wgmma too
    moe_prefill = [r for name, r in compiled.items() if name.startswith("moe_gemm 128x128")]
    assert len(moe_prefill) == 3 and all(r["wgmma"] for r in moe_prefill)   # rows gathered, still wgmma (+ fast)


def test_fast_accum_variants_skip_the_promotion(compiled):
    """Fp8Config.fast_accum's kernels accumulate in the MMA: no float32 fma per K-block (`acc += dot * one`)."""
    fast = [name for name in compiled if name.endswith(" fast_accum")]
    assert len(fast) >= 6, fast
    for name in fast:
        exact = compiled[name.removesuffix(" fast_accum")]
        assert compiled[name]["mma"] and compiled[name]["fma_f32"] < exact["fma_f32"], (name, compiled[name], exact)


def test_direct_moe_kernels_use_tensor_cores_and_an_acq_rel_ticket(compiled):
    """The direct MoE kernels (few slots) compile at every config the plan gives them; their GEMMs use the
    tensor cores; only the w2 kernel draws the combine's ticket, with acquire-release semantics."""
    direct = {name: r for name, r in compiled.items() if name.startswith("moe_direct_")}
    assert len(direct) >= 14 and all(r["mma"] for r in direct.values()), direct
    for name, r in direct.items():
        assert r["acq_rel_atom"] == name.startswith("moe_direct_w2"), name
    assert {"moe_align_counts bins=256", "moe_align_place bins=256"} <= set(compiled)


def test_issue38_kernels_compile_for_sm90(compiled):
    """The GEMV and decode kernels quantizing their own input, and the producers' kernels (RMSNorm, SiLU * up,
    each with its FP8 output) compile; the norm squares without fused multiply-adds (each x² rounded, as
    torch's pow rounds it before its sum)."""
    names = [n for n in compiled if n.endswith(" quant_x") or n.startswith(("rms_norm", "silu_mul"))
             or (n.startswith("decode") and n.endswith(" rows=16"))]
    assert len([n for n in names if n.startswith("gemv")]) == 9 and len(names) == 9 + 6 + 4 + 2, names
    assert all(compiled[n]["ok"] and not compiled[n]["gdc_wait"] for n in names)
    assert all(compiled[n]["fma_f32"] == 0 for n in names if n.startswith("rms_norm"))
