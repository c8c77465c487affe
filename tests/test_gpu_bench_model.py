"""benchmarks/bench_model.py on a CUDA GPU, on the tiny preset (a minute): the decode step captured in one
CUDA graph gives an eager step's logits, every phase yields figures, --profile names the kernels. Run it
before the long whole-model runs: it exercises every GPU-only path of fp8now/bench*.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang import HANG_S

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (run through the device tool)")]
ROOT = Path(__file__).resolve().parents[1]


def test_bench_model_tiny_on_cuda_graph_decode(tmp_path):
    out = tmp_path / "model.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "tiny", "--device", "cuda",
                          "--schemes", "channel,block", "--prefill", "1x64,4x64", "--decode", "1,4", "--context", "32",
                          "--reps", "2", "--profile", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    meta, rows = (lambda d: (d["meta"], d["rows"]))(json.loads(out.read_text()))
    assert meta["gpu"] != "cpu"
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    by = {(r["impl"], r["phase"], r["batch"]): r for r in rows}
    for impl in ("bf16", "fp8now-channel", "fp8now-block"):
        load = by[(impl, "load", None)]
        assert load["peak_gb"] >= load["resident_gb"] > 0
        for b in (1, 4):
            d = by[(impl, "decode", b)]
            assert d["mode"] == "graph" and d["tokens_per_s"] > 0 and d["peak_gb"] > 0
            assert d["rel_to_eager"] < 1e-3, d      # the replayed step computes what the eager step does
            assert d["kernels"]["kinds"] and d["kernels"]["top"]
        pre = by[(impl, "prefill", 4)]
        assert pre["kernels"]["kinds"]
        assert pre["host"]["enqueue_ms"] > 0 and len(pre["host"]["top"]) == 12
        assert all(h["calls"] >= 1 and h["ms"] >= 0 for h in pre["host"]["top"])
    for impl in ("fp8now-channel", "fp8now-block"):
        acc = by[(impl, "accuracy", 4)]
        assert 1e-5 < acc["kl"] < 1.0 and 0.5 <= acc["top1"] <= 1.0
        assert by[(impl, "load", None)]["resident_gb"] < 0.75 * by[("bf16", "load", None)]["resident_gb"]
