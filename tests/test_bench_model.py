"""benchmarks/bench_model.py, run for real as a subprocess on the CPU (tiny Llama, eager rows only):
it builds the model, quantizes a copy per scheme, and writes a results file (meta + one row per
(case, model) with the output error against bf16 and the model's bytes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_model_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--device", "cpu", "--preset", "tiny",
         "--layers", "1", "--decode", "1,3", "--prefill", "2x16", "--schemes", "channel,block",
         "--host-profile", "--out", str(tmp_path / "model.json")], env=env, capture_output=True, text=True,
        timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "model.json").read_text())
    assert set(result) == {"meta", "rows"}
    meta, rows = result["meta"], result["rows"]
    assert set(meta) == {"date", "gpu", "torch", "triton", "commit", "command"}
    assert meta["gpu"] == "cpu" and "bench_model.py" in meta["command"] and "--preset tiny" in meta["command"]
    assert not [r for r in rows if "error" in r]  # nothing failed
    cases = {(1, 1), (3, 1), (2, 16)}
    impls = {"bf16", "fp8now-channel", "fp8now-block"}
    profiled = {(r["impl"], r["batch"], r["seq"]): r for r in rows if r["mode"] == "host-profile"}
    rows = [r for r in rows if r["mode"] != "host-profile"]
    assert {(r["batch"], r["seq"], r["impl"]) for r in rows} == {(*c, i) for c in cases for i in impls}
    assert all(r["mode"] == "eager" and r["ms"] > 0 for r in rows)
    # the host profile (decode cases) counts one Fp8Linear call per linear of the layer: 7 per forward
    assert set(profiled) == {(i, b, 1) for i in impls for b in (1, 3)}
    assert all(p["ms"] > 0 and p["top"] for p in profiled.values())
    for (impl, _, _), p in profiled.items():
        assert p["calls_per_forward"]["fp8now/linear.py:forward"] == (0 if impl == "bf16" else 7)
    for r in rows:
        assert r["tokens"] == r["batch"] * r["seq"]
        if r["impl"] == "bf16":
            assert r["rel"] is None
        else:  # FP8 noise on a one-layer random model: clearly nonzero, clearly not garbage
            assert 1e-3 < r["rel"] < 0.3, r
    size = {r["impl"]: r["weight_bytes"] for r in rows}
    # tiny preset, 1 layer: q, o [256, 256], k, v [128, 256], gate, up [512, 256], down [256, 512].
    # bf16 -> FP8 saves one byte per weight and adds one float32 scale per output row (channel).
    rows_out = 256 + 128 + 128 + 256 + 512 + 512 + 256
    linear = 256 * 256 * 2 + 128 * 256 * 2 + 512 * 256 * 3
    assert size["bf16"] - size["fp8now-channel"] == linear - 4 * rows_out
    assert size["fp8now-channel"] < 0.55 * size["bf16"]
    assert "fp8now-channel" in run.stdout  # the summary table
