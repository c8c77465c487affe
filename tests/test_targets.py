"""benchmarks/targets.py, run for real as a subprocess on results files it is handed: the floors it
explains misses with (recomputed here from the bytes and FLOPs of each call and the H200 ceilings
BENCHMARKS.md states), which row set each ratio comes from, and the met / missed verdicts on random
timings."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HBM, FP8_RATE = 4.27e12, 1.28e15                 # device copy; cuBLAS FP8 tensorwise
STREAM_FIXED, STREAM_BW = 2.9e-6, 4.36e12        # the fastest read-only Triton kernel (floor run 7)
GRID_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (57344, 8192),
               (8192, 28672)]
GRID_M = [1, 16, 64, 256, 1024, 4096, 16384]


def targets(*args) -> subprocess.CompletedProcess:
    """benchmarks/targets.py run with these arguments."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "targets.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def score(tmp_path, files, *extra):
    """Write each {name: rows} file, run targets.py on them in order, return (scored rows, stdout)."""
    paths = []
    for name, rows in files.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rows))
    out = tmp_path / "scored.json"
    run = targets(*paths, "--json", out, *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (tmp_path / "scored.json.tmp").exists()
    return json.loads(out.read_text()), run.stdout


def by(rows, target, timing, m, n, k):
    found = [r for r in rows if (r["target"], r["timing"], r["M"], r["N"], r["K"]) == (target, timing, m, n, k)]
    assert len(found) == 1, (target, timing, m, n, k, found)
    return found[0]


def random_run(rng, impls, ms=GRID_M, shapes=GRID_SHAPES):
    """Rows with a random time per (impl, M, N, K): 0.5-2x of a rough bf16 time, never zero."""
    rows = []
    for n, k in shapes:
        for m in ms:
            base = max(5e-3, 2 * m * n * k / 7e14 * 1e3)
            rows += [dict(M=m, N=n, K=k, impl=i, ms=base * rng.uniform(0.5, 2.0)) for i in impls]
    return rows


def test_floors_are_the_bytes_and_flops_of_each_call(tmp_path):
    rng = random.Random(11)
    impls = ["bf16", "scaled_mm", "fp8now-channel", "fp8now-block", "bf16-graph", "fp8now-tensor-graph"]
    run = random_run(rng, impls)
    rows, _ = score(tmp_path, {"run": run})
    times = {(r["impl"], r["M"], r["N"], r["K"]): r["ms"] * 1e-3 for r in run}
    for n, k in GRID_SHAPES:
        m = rng.choice([1024, 4096, 16384])
        # channel: quantizer pass (bf16 in, FP8 + one scale per row out), then the GEMM's bytes or MMAs
        quant = (2 * m * k + m * k + 4 * m) / HBM
        gemm = max((m * k + n * k + 2 * m * n + 4 * (n + m)) / HBM, 2 * m * n * k / FP8_RATE)
        r = by(rows, "channel, M >= 1024", "eager", m, n, k)
        assert r["floor_us"] == pytest.approx((quant + gemm) * 1e6, rel=1e-9)
        assert r["bound"] == pytest.approx(times[("bf16", m, n, k)] / (quant + gemm), rel=1e-9)
        mm = times[("scaled_mm", m, n, k)]
        assert r["mm_cap"] == pytest.approx(mm / (mm + quant), rel=1e-9)
        # block: one scale per 1x128 group of the activation, per 128x128 tile of the weight
        g = math.ceil(k / 128)
        quant = (3 * m * k + 4 * m * g) / HBM
        gemm = max((m * k + n * k + 2 * m * n + 4 * (math.ceil(n / 128) * g + m * g)) / HBM,
                   2 * m * n * k / FP8_RATE)
        assert by(rows, "block, M >= 1024", "eager", m, n, k)["floor_us"] == pytest.approx((quant + gemm) * 1e6)
        # decode: one kernel streaming bf16 x, the FP8 weight, one tensor scale + a scale per row, bf16 y
        m = rng.choice([1, 16])
        stream = STREAM_FIXED + (2 * m * k + n * k + 2 * m * n + 4 * (1 + m)) / STREAM_BW
        r = by(rows, "tensor, M <= 16", "GPU time", m, n, k)
        assert r["floor_us"] == pytest.approx(stream * 1e6, rel=1e-9)
        assert r["x"] == pytest.approx(times[("bf16-graph", m, n, k)] / times[("fp8now-tensor-graph", m, n, k)])


def test_verdicts_on_random_timings(tmp_path):
    rng = random.Random(5)
    impls = ["bf16", "scaled_mm", "scaled_mm-blockwise", "fp8now-tensor", "fp8now-channel", "fp8now-block",
             "torchao-row", "torchao-row-compiled", "torchao-block-compiled"]
    run = random_run(rng, impls)
    rows, text = score(tmp_path, {"run": run})
    t = {(r["impl"], r["M"], r["N"], r["K"]): r["ms"] for r in run}
    checked = 0
    for n, k in GRID_SHAPES:
        for m in GRID_M:
            bf16, mm = t[("bf16", m, n, k)], t[("scaled_mm", m, n, k)]
            if m >= 1024:
                for s in ("tensor", "channel"):
                    fp8 = t[(f"fp8now-{s}", m, n, k)]
                    r = by(rows, f"{s}, M >= 1024", "eager", m, n, k)
                    assert r["met"] == (bf16 / fp8 >= 1.6 and mm / fp8 >= 0.93)
                    assert bool(r["why"]) == (not r["met"])
                r = by(rows, "block, M >= 1024", "eager", m, n, k)     # no share of the bare GEMM asked
                fp8 = t[("fp8now-block", m, n, k)]
                assert r["met"] == (bf16 / fp8 >= 1.4)
                assert r["of_mm"] == pytest.approx(t[("scaled_mm-blockwise", m, n, k)] / fp8)
            if m <= 16:
                for s in ("tensor", "channel", "block"):
                    r = by(rows, f"{s}, M <= 16", "eager", m, n, k)
                    assert r["met"] == (bf16 / t[(f"fp8now-{s}", m, n, k)] >= 1.4)
            fp8 = t[("fp8now-channel", m, n, k)]
            r = by(rows, "channel vs torchao", "eager", m, n, k)
            best = min(t[("torchao-row", m, n, k)], t[("torchao-row-compiled", m, n, k)])
            assert r["met"] == (fp8 < best)
            assert r["peer_us"] == pytest.approx(best * 1e3)
            checked += 1
    assert checked == len(GRID_SHAPES) * len(GRID_M)
    assert not [r for r in rows if r["target"] == "tensor vs torchao"]   # no torchao-tensor rows given
    met = sum(r["met"] for r in rows if r["target"] == "block, M >= 1024")
    assert f"### block, M >= 1024 (eager): >= 1.4x bf16; met on {met} of 21" in text


def test_ratios_stay_inside_one_run_and_the_newest_run_wins(tmp_path):
    rng = random.Random(3)
    m, n, k = 4096, 8192, 8192
    old = [dict(M=m, N=n, K=k, impl=i, ms=rng.uniform(0.4, 0.8))
           for i in ("bf16", "scaled_mm", "fp8now-channel", "fp8now-block")]
    new = [dict(M=m, N=n, K=k, impl=i, ms=rng.uniform(0.4, 0.8)) for i in ("bf16", "fp8now-channel", "fp8now-block")]
    rows, _ = score(tmp_path, {"old": old, "new": new})
    chan, block = by(rows, "channel, M >= 1024", "eager", m, n, k), by(rows, "block, M >= 1024", "eager", m, n, k)
    assert chan["src"] == "old"     # only the old run also timed bare scaled_mm: every ratio from it
    assert chan["x"] == pytest.approx(old[0]["ms"] / old[2]["ms"])
    assert chan["of_mm"] == pytest.approx(old[1]["ms"] / old[2]["ms"])
    assert block["src"] == "new" and block["x"] == pytest.approx(new[0]["ms"] / new[2]["ms"])


def test_decodex_rows_are_graph_rows_and_off_grid_rows_need_all(tmp_path):
    rng = random.Random(8)
    rows_in = [dict(impl=i, sec="decodex", M=m, N=n, K=4096, graph=rng.uniform(0.005, 0.02))
               for i in ("bf16", "channel-shipped", "block-shipped", "channel-auto")
               for m in (1, 4) for n in (1024, 4096)]
    rows, _ = score(tmp_path, {"decodex": rows_in})
    assert {(r["M"], r["N"]) for r in rows} == {(1, 4096)}           # M = 4 and N = 1024: not the issue's
    t = {(r["impl"], r["M"], r["N"]): r["graph"] for r in rows_in}
    r = by(rows, "block, M <= 16", "GPU time", 1, 4096, 4096)
    assert r["x"] == pytest.approx(t[("bf16", 1, 4096)] / t[("block-shipped", 1, 4096)])
    assert not [r for r in rows if r["target"].startswith("tensor")]  # no tensor-shipped rows given
    rows, _ = score(tmp_path, {"decodex": rows_in}, "--all")
    assert {(r["M"], r["N"]) for r in rows} == {(1, 4096), (4, 4096), (1, 1024), (4, 1024)}


def test_quantizers_launch_bound_rows_skipped_and_per_tensor_capped(tmp_path):
    rng = random.Random(2)
    quant = [dict(what=w, op=op, shape=[r, c], bytes=3 * r * c, triton_gbps=rng.uniform(2000, 4000))
             for w, op in (("act", "token"), ("act", "tensor"), ("weight", "block"))
             for r, c in ((1024, 4096), (16384, 8192))]
    path = tmp_path / "quant.json"
    path.write_text(json.dumps(quant))
    rows, _ = score(tmp_path, {}, "--quant", path)
    assert [(r["op"], r["shape"]) for r in rows] == [(f"{q['what']} {q['op']}", "16384 x 8192")
                                                     for q in quant if q["shape"][0] == 16384]
    for r, q in zip(rows, [q for q in quant if q["shape"][0] == 16384]):
        assert r["met"] == (q["triton_gbps"] >= 3000)
        if q["op"] == "tensor":
            assert f"{HBM * 3 / 5 / 1e12:.2f} TB/s at most" in r["why"]


def test_no_results_file_is_an_error():
    run = targets()
    assert run.returncode == 2 and "name at least one results file" in run.stderr


def test_an_eager_decode_miss_points_to_the_same_calls_gpu_time(tmp_path):
    rng = random.Random(21)
    m, n, k = 16, 4096, 4096
    graph = [dict(M=m, N=n, K=k, impl="bf16-graph", ms=0.011), dict(M=m, N=n, K=k, impl="fp8now-block-graph",
                                                                  ms=rng.uniform(0.009, 0.013))]
    eager = [dict(M=m, N=n, K=k, impl="bf16", ms=0.018), dict(M=m, N=n, K=k, impl="fp8now-block",
                                                            ms=rng.uniform(0.02, 0.04))]
    rows, _ = score(tmp_path, {"gpu": graph, "eager": eager})
    gpu, slow = by(rows, "block, M <= 16", "GPU time", m, n, k), by(rows, "block, M <= 16", "eager", m, n, k)
    assert not slow["met"] and gpu["src"] == "gpu" and slow["src"] == "eager"
    assert f"{graph[1]['ms'] * 1e3:.1f} µs, {0.011 / graph[1]['ms']:.2f}x bf16 (gpu)" in slow["why"]


def test_a_loss_to_fast_accumulation_names_the_float32_peer_too(tmp_path):
    rng = random.Random(4)
    m, n, k = 4096, 8192, 8192
    t = {"bf16": 0.7, "fp8now-channel": 0.5, "torchao-row-compiled": rng.uniform(0.40, 0.45),
         "torchao-row-f32acc-compiled": rng.uniform(0.46, 0.6), "torchao-row-f32acc": rng.uniform(0.8, 0.9)}
    rows, _ = score(tmp_path, {"run": [dict(M=m, N=n, K=k, impl=i, ms=v) for i, v in t.items()]})
    r = by(rows, "channel vs torchao", "eager", m, n, k)
    assert not r["met"] and r["peer"] == "torchao-row-compiled"
    assert f"torchao-row-f32acc-compiled takes {t['torchao-row-f32acc-compiled'] / 0.5:.2f}" in r["why"]


def test_a_file_that_is_not_results_is_named_in_the_error(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([dict(M=1, N=4096, K=4096, impl="bf16", ms=0.01)]))
    for name, text in (("notjson.json", "{oops"), ("dict.json", json.dumps({"M": 1})),
                       ("rows.json", json.dumps([dict(M=1, N=4096, impl="bf16", ms=0.01)]))):
        (tmp_path / name).write_text(text)
        run = targets(good, tmp_path / name)
        assert run.returncode == 1 and str(tmp_path / name) in run.stderr, (name, run.stderr)
        assert run.stdout == ""
