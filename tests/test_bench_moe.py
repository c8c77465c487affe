"""benchmarks/bench_moe.py on the CPU: the smoke run as a subprocess (tiny shapes, every implementation, a
row per case, failures as rows), and moe_layers' bf16 grouped-mm experts and router against plain float64
loops."""

import json
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCH)
import bench_moe  # noqa: E402
import moe_layers  # noqa: E402
from hang import HANG_S


def _experts_loop(x, index, weights, w13, w2):
    """float64, token by token, slot by slot: sum_j w_j * W2_e (silu(gate) * up)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    return out


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (13, 16, 4), (40, 4, 2)])
def test_grouped_mm_experts_matches_a_float64_loop(t, e, k):
    g = torch.Generator().manual_seed(t * 100 + e)
    h, i = 64, 48
    x = torch.randn(t, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).bfloat16()
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])   # some experts get no token
    weights = torch.rand(t, k, generator=g).bfloat16()
    y = moe_layers.grouped_mm_experts(x, index, weights, w13, w2)
    ref = _experts_loop(x, index, weights, w13, w2)
    assert y.shape == (t, h) and y.dtype == torch.bfloat16
    assert bench_moe.rel(y, ref) < 1e-2            # bf16 operands and intermediates
    wrong = moe_layers.grouped_mm_experts(x, index.roll(1, dims=0), weights, w13, w2)
    if t > 1:                                      # control: another routing is far off
        assert bench_moe.rel(wrong, ref) > 0.1


def test_route_is_renormalised_softmax_top_k():
    g = torch.Generator().manual_seed(3)
    x, router = torch.randn(9, 32, generator=g).bfloat16(), torch.randn(16, 32, generator=g).bfloat16()
    index, weights = moe_layers.route(x, router, 4)
    probs = torch.softmax(x.double() @ router.double().T, dim=-1)
    assert torch.equal(index.sort(-1).values, probs.topk(4, -1).indices.sort(-1).values)
    top = probs.gather(1, index)
    assert torch.allclose(weights.double(), top / top.sum(-1, keepdim=True), atol=1e-2)
    assert weights.dtype == torch.bfloat16


def test_weight_copies_fit_the_memory_given():
    gb = 10 ** 9
    assert bench_moe.weight_copies(4, 2 * gb, gb, 3, 100.0) == 4          # 4 x 5 GB fits 100 GB
    assert bench_moe.weight_copies(30, 2 * gb, gb, 3, 100.0) == 20        # 20 x 5 GB
    with pytest.raises(SystemExit, match="two weight copies need 10.0 GB"):
        bench_moe.weight_copies(4, 2 * gb, gb, 3, 9.0)


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_case(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_moe.py"), "--device", "cpu", "--tokens", "1,8",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speed-up over the faster of bf16-transformers (tf) and bf16-grouped_mm" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == "cpu" and "bench_moe.py" in data["meta"]["command"]
    rows = data["rows"]
    cases = {(r["shape"], r["tokens"]) for r in rows}
    assert cases == {(s, t) for s in bench_moe.CPU_SHAPES for t in (1, 8)}
    for shape, tokens in cases:
        _, e, k, h, i = bench_moe.CPU_SHAPES[shape]
        case = {r["impl"]: r for r in rows if (r["shape"], r["tokens"]) == (shape, tokens)}
        for impl in ("bf16-transformers", "bf16-transformers-eager", "bf16-grouped_mm", "fp8now-tensor",
                     "fp8now-channel", "fp8now-block"):
            r = case[impl]
            assert "error" not in r, r
            assert r["ms"] > 0 and r["rel"] is not None
        assert case["bf16-transformers"]["experts_implementation"] and case["bf16-transformers"]["rel"] == 0
        assert case["bf16-grouped_mm"]["rel"] < 0.02 and case["bf16-transformers-eager"]["rel"] < 0.02
        for scheme in ("tensor", "channel", "block"):
            r = case[f"fp8now-{scheme}"]
            assert 1e-3 < r["rel"] < 0.1, r              # quantized (not bf16), and not broken
            assert r["backend"]
        hit = case["bf16-grouped_mm"]["experts_hit"]
        assert hit == k if tokens == 1 else k <= hit <= min(e, tokens * k)
        assert case["bf16-grouped_mm"]["fp8_bytes"] == hit * 3 * h * i
        # no GPU here: the floors take the H200's HBM rate (on a GPU its own: 3.0 TB/s on an H100)
        assert case["bf16-grouped_mm"]["hbm_tbps"] == 4.27
        assert case["bf16-grouped_mm"]["floor_ms"] == pytest.approx(hit * 3 * h * i / 4.27e9)
    for r in rows:                                         # an implementation that cannot run is a row
        if "error" in r:
            assert r["ms"] is None and r["impl"].startswith("bf16-transformers-"), r


def test_tune_moe_smoke_run_compares_each_change(tmp_path):
    """benchmarks/tune_moe.py on the CPU (interpreter, one tiny shape): at one token (the direct path's size) the plan
    now, the plan before issue 38 and the sorted path on the direct path's tiles, all three with the plan's bytes,
    each timed; at two tokens (the sorted path) also the other alignments, the chunked Triton one included."""
    out = tmp_path / "tune.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tune_moe.py"), "--device", "cpu", "--shapes",
                           "qwen3-tiny", "--tokens", "1,2", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == "cpu" and "tune_moe.py" in data["meta"]["command"]
    got = {(r["tokens"], r["variant"]): r for r in data["rows"]}
    assert {v for t, v in got if t == 1} == {"now", "before", "sorted, same tiles"}
    assert {"now", "align=torch", "align=triton-chunked", "direct, same tiles"} <= {v for t, v in got if t == 2}
    for (t, v), r in got.items():
        assert r["same_bytes"] and r["ms"] > 0 and r["scheme"] == "channel"
        if t == 1:
            assert ("triton-moe-direct" in r["path"]) == (v == "now") and ("align=triton," in r["path"]) == (v != "now")
    assert "align=triton," in got[(2, "now")]["path"] and "align=triton-chunked," in got[(2, "align=triton-chunked")]["path"]
