"""Probes for the open items of issue 4, one device call (H200). Each section checks its results
against a reference before timing; all rows go to OUT/probe.json, short tables print last.

Sections (argv: a comma list, default all):
- `large`: where the time of a large-M channel/tensor/block layer goes. do_bench (L2 flushed) of the
  layer, of its quantizer and its GEMM alone, and the CUDA kernels the layer launches (torch.profiler).
  Env LARGE_CASES=MxNxK,... and LARGE_SCHEMES=block,... narrow it.
- `quant`: per-token quantizer configurations at large K (bytes checked against the shipped config).
- `gquant`: the per-1x128-group quantizer over tile configurations, row- and column-major scales.
- `block`: the Triton block GEMM at large M over tile configurations (smaller tiles let two or three
  programs share an SM, so one's MMAs can overlap another's scale promotion: a manual software
  pipeline inside one program does not, since Triton places the MMA wait right after its issue).
- `cublas`: cuBLAS blockwise at K > 8192, whole and in K chunks with float32 partials.
- `cublas_data`: cuBLAS blockwise and the Triton block GEMM on check_core_gpu's data and bench data
  against the float64 product, at K = 6144 to 28672, with GEMM times. (Run 3 of 2026-12-03, and a
  `cublas_chunks` section since removed, compared with a reference product whose weight-row chunks
  started inside 128-row tiles: every implementation then looked equally wrong.)
- `blockm`: block scheme at M = 32-256, Triton block GEMM vs cuBLAS blockwise (CUDA graphs).
- `host`: host µs per eager call of Fp8Linear (with and without decode graphs) and its parts (GPU kept busy).
- `launchparts`: the host cost of one quantizer call taken apart, and a cProfile of eager calls.
- `m1cublas`: M = 1 tensor / channel through cuBLAS tensorwise / rowwise vs the decode-kernel path.
- `decode`: programmatic dependent launch (PDL) of the decode kernel after the quantizer, GPU time in
  CUDA graphs; PDL results checked bit-identical to the plain launch, eager and replayed.
- `compiledquant`: under torch.compile, a layer behind its producer (Llama RMSNorm, or SiLU(gate) x up),
  with the activation quantizer fused by inductor (`triton_fp8.COMPILED_QUANT`, set for both kinds) against
  the Triton quantizer after a materialized bf16 activation; GPU time of the compiled call in a CUDA
  graph, bf16 compiled as the baseline. Env CQ_M (default 16,8192) sets M, CQ_CASES=silu:4096:14336,...
  the cases, CQ_KERNELS=1 records each call's CUDA kernels.
- `cqvariants`: the compiled quantizer alone behind its producer (SiLU x up at K = 14336, RMSNorm at
  K = 4096; M from env CQ_M, default 8192) in several formulations, against the producer alone and the
  producer + Triton quantizer; the inductor code of each goes to OUT/cq_<case>.py.
- `decodecfg`: the decode kernel's launch configuration swept (BLOCK_N, num_warps, num_stages,
  SPLIT_K; the shipped `DECODE_CONFIG` first) for channel (Triton quantizer + decode kernel, PDL at
  M <= 4, as shipped) and block (in-kernel groups at M = 1, pre-quantized above), each config checked
  against the float64 product of its FP8 operands (float32 output, rel < 1e-5), GPU time in CUDA graphs of 8 weight copies. Env
  DCFG_SHAPES (N x K list, default 4096x4096,6144x4096,8192x8192), DCFG_M (default
  1,4,16), DCFG_BUDGET_S (default 330: stops sweeping, keeps what it has), DCFG_SPLITS (only the
  shipped tile at these SPLIT_K values, e.g. 1,2,3,4,6,8).
- `decodex`: the decode kernel's K splits added by pairwise exchanges (`triton_decode._exchange`, no
  ticket, no fence) against the ticket reduction, same tiles and splits, for channel (Triton quantizer +
  decode kernel, PDL at M <= 4) and block (pre-quantized groups), with the shipped layer
  (`triton_fp8.linear`) as reference; every config checked against the float64 product, exchange
  results also bit-identical over 20 graph replays; at M > 1 also the plan before it (`-auto`: auto
  splits and the ticket, block's split-K GEMM) and tensor as shipped. Env DX_SHAPES (default
  4096x4096,6144x4096,4096x14336,8192x8192), DX_M (default 1,2,4,8,16), DX_BUDGET_S (default 300),
  DX_GRID=0 (the shipped and former plans only).

`PYTHONPATH=src:benchmarks python benchmarks/probe_kernels.py [sections]`
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

from bench_decode import rel
from bench_linear import bench, graph_ms, kernels_of, varied
from tune_decode import exact as exact_product

OUT = os.environ.get("OUT", ".")
ROWS: list[dict] = []


def add(**r):
    ROWS.append(r)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


# ------------------------------------------------------------------------------------------------
def section_large():
    from fp8now import Fp8Config, Fp8Linear, Scheme
    from fp8now.kernels import torch_mm, triton_gemm as tg, triton_quant as tq
    cases = [(16384, 4096, 4096), (16384, 8192, 8192), (16384, 4096, 14336), (4096, 4096, 14336),
             (16384, 8192, 28672)]
    if os.environ.get("LARGE_CASES"):     # e.g. LARGE_CASES=1024x4096x14336,4096x8192x28672 (MxNxK)
        cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["LARGE_CASES"].split(",")]
    schemes = os.environ.get("LARGE_SCHEMES", "channel,tensor,block").split(",")
    for m, n, k in cases:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(varied(n, k, seed=n + k, device="cuda"))
        x = varied(m, k, seed=m + k, device="cuda")
        base = dict(M=m, N=n, K=k)
        add(sec="large", impl="bf16", ms=bench(lambda: torch.nn.functional.linear(x, lin.weight), 5, 25), **base)
        for scheme in schemes:
            layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=Scheme(scheme)))
            w, ws = layer.weight, layer.weight_scale
            add(sec="large", impl=f"{scheme}-layer", ms=bench(lambda: layer(x), 5, 25),
                kernels=kernels_of(lambda: layer(x)), **base)
            if scheme == "block":
                xq, xs = tq.quantize_act_group(x)
                add(sec="large", impl="block-quant", ms=bench(lambda: tq.quantize_act_group(x), 5, 25), **base)
                add(sec="large", impl="block-triton-gemm",
                    ms=bench(lambda: tg.block_gemm(xq, xs, w, ws), 5, 25), **base)
                if torch_mm.blockwise_unfit(k) is None:
                    xqc, xsc = tq.quantize_act_group(x, col_major=True)
                    add(sec="large", impl="block-quant-colmajor",
                        ms=bench(lambda: tq.quantize_act_group(x, col_major=True), 5, 25), **base)
                    add(sec="large", impl="block-cublas-gemm", ms=bench(
                        lambda: torch_mm.blockwise_mm(xqc, xsc, w, ws, None, torch.bfloat16), 5, 25), **base)
                    add(sec="large", impl="block-quant+cublas", ms=bench(lambda: torch_mm.blockwise_mm(
                        *tq.quantize_act_group(x, col_major=True), w, ws, None, torch.bfloat16), 5, 25), **base)
            else:
                xq, xs = tq.quantize_act_token(x)
                add(sec="large", impl=f"{scheme}-quant", ms=bench(lambda: tq.quantize_act_token(x), 5, 25), **base)
                add(sec="large", impl=f"{scheme}-rowwise_mm", ms=bench(
                    lambda: torch_mm.rowwise_mm(xq, xs, w, ws, None, torch.bfloat16), 5, 25), **base)
                wsr = ws.reshape(1, -1).expand(1, n).contiguous()
                add(sec="large", impl=f"{scheme}-bare_scaled_mm", ms=bench(lambda: torch._scaled_mm(
                    xq, w.t(), xs, wsr, out_dtype=torch.bfloat16), 5, 25), **base)
                add(sec="large", impl=f"{scheme}-quant+mm", ms=bench(
                    lambda: torch_mm.rowwise_mm(*tq.quantize_act_token(x), w, ws, None, torch.bfloat16),
                    5, 25), **base)
            del layer
        del lin, x
        torch.cuda.empty_cache()
        print(f"large {m}x{n}x{k} done", file=sys.stderr, flush=True)


def same_bytes(q, s, q0, s0) -> bool:
    """FP8 bytes and scales equal to the shipped launch's."""
    return bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0))


def sweep_config(name, run, same, gb, m, k, rep_ms):
    """One quantizer configuration of a sweep: run it, check its bytes, time it, and record the row
    (or why it failed) in section "quant"."""
    try:
        run()
        ok = same()
        ms = bench(run, 5, rep_ms)
        add(sec="quant", impl=name, M=m, K=k, ms=ms, tbs=gb / ms, same=ok)
    except Exception as e:
        add(sec="quant", impl=name, M=m, K=k, fail=f"{type(e).__name__}: {e}"[:200])


# ------------------------------------------------------------------------------------------------
def section_quant():
    from fp8now.kernels import triton_quant as tq
    from fp8now.numerics import E4M3FN
    for m, k in [(16384, 4096), (16384, 8192), (16384, 14336), (16384, 28672), (4096, 14336)]:
        x = varied(m, k, seed=k, device="cuda")
        q0, s0 = tq.quantize_act_token(x)
        gb = m * k * 3 / 1e9
        ms = bench(lambda: tq.quantize_act_token(x), 5, 25)
        add(sec="quant", impl="shipped", M=m, K=k, ms=ms, tbs=gb / ms)
        cfgs = []
        if k <= 16384:
            for w in (8, 16, 32):
                cfgs.append((True, 1 << (k - 1).bit_length(), 1, w))
        for bk in (1024, 2048, 4096, 8192):
            for bm in (1, 2, 4):
                for w in (4, 8, 16):
                    if bm * bk // (w * 32) in (4, 8, 16, 32):
                        cfgs.append((False, bk, bm, w))
        for single, bk, bm, w in cfgs:
            q = torch.empty_like(q0)
            s = torch.empty_like(s0)

            def run():
                tq._row_quant_kernel[(triton.cdiv(m, bm),)](
                    x, q, s, m, k, x.stride(0), q.stride(0), FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale,
                    BLOCK_M=bm, BLOCK_K=bk, SINGLE=single, EARLY=False, num_warps=w)
            sweep_config(f"{'single' if single else 'chunk'} bk={bk} bm={bm} w={w}", run,
                         lambda: same_bytes(q, s, q0, s0), gb, m, k, rep_ms=15)
        del x, q0, s0
        torch.cuda.empty_cache()
        print(f"quant {m}x{k} done", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
def section_gquant():
    from fp8now.kernels import triton_quant as tq
    from fp8now.numerics import E4M3FN
    for m, k in [(4096, 14336), (16384, 14336), (1024, 28672), (4096, 28672), (16384, 4096)]:
        x = varied(m, k, seed=k + 1, device="cuda")
        gb = m * k * 3 / 1e9
        for col in (False, True):
            q0, s0 = tq.quantize_act_group(x, col_major=col)
            ms = bench(lambda: tq.quantize_act_group(x, col_major=col), 5, 25)
            add(sec="quant", impl=f"group shipped col={col}", M=m, K=k, ms=ms, tbs=gb / ms)
            ng = s0.shape[1]
            for groups in (1, 2, 4, 8, 16):
                for bm in (1, 2, 4, 8, 16, 32):
                    for w in (2, 4, 8, 16):
                        if not 4 <= bm * groups * 128 // (w * 32) <= 32:
                            continue
                        q = torch.empty_like(q0)
                        sb = (torch.empty((ng, m), dtype=torch.float32, device="cuda").t() if col
                              else torch.empty_like(s0))

                        def run():
                            tq._group_quant_kernel[(triton.cdiv(m, bm), triton.cdiv(ng, groups))](
                                x, q, sb, m, k, x.stride(0), q.stride(0), sb.stride(0), sb.stride(1),
                                FMAX=E4M3FN.fmax, FLOOR=tq.GROUP_AMAX_FLOOR, BLOCK_M=bm, GROUPS=groups,
                                GROUP_K=tq.GROUP, num_warps=w)
                        sweep_config(f"group col={col} g={groups} bm={bm} w={w}", run,
                                     lambda: same_bytes(q, sb, q0, s0), gb, m, k, rep_ms=10)
            del q0, s0
        del x
        torch.cuda.empty_cache()
        print(f"gquant {m}x{k} done", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
def section_block():
    from fp8now.kernels import triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import quantize_weight
    configs = [(128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (128, 128, 4, 3, 8), (64, 128, 4, 4, 8),
               (64, 128, 4, 3, 8), (128, 64, 4, 4, 8), (64, 256, 8, 3, 8), (128, 256, 8, 3, 8),
               (256, 128, 8, 3, 8), (128, 128, 8, 3, 16), (64, 64, 4, 4, 8), (128, 64, 4, 3, 8),
               (64, 128, 4, 5, 8)]
    for m, n, k in [(16384, 4096, 14336), (16384, 8192, 28672), (4096, 8192, 28672), (16384, 8192, 8192),
                    (16384, 4096, 4096)]:
        w = varied(n, k, seed=n * 3 + k, device="cuda")
        x = varied(m, k, seed=m + 5 * k, device="cuda")
        wq, ws = quantize_weight(w, "block")
        xq, xs = tq.quantize_act_group(x)
        ref = tg.block_gemm(xq, xs, wq, ws, out_dtype=torch.float32)
        flops = 2 * m * n * k
        ms = bench(lambda: torch.nn.functional.linear(x, w), 5, 25)
        add(sec="block", impl="bf16", M=m, N=n, K=k, ms=ms, tflops=flops / ms / 1e9)
        for bm, bn, nw, ns, g in configs:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns, GROUP_M=g, SPLIT_K=1)
            name = f"triton {bm}x{bn} w{nw} s{ns} g{g}"
            try:
                err = rel(tg.block_gemm(xq, xs, wq, ws, out_dtype=torch.float32, config=cfg), ref)
                ms = bench(lambda: tg.block_gemm(xq, xs, wq, ws, config=cfg), 5, 20)
                add(sec="block", impl=name, M=m, N=n, K=k, ms=ms, tflops=flops / ms / 1e9, err=err)
            except Exception as e:
                add(sec="block", impl=name, M=m, N=n, K=k, fail=f"{type(e).__name__}: {e}"[:200])
        del w, x, wq, ws, xq, xs, ref
        torch.cuda.empty_cache()
        print(f"block {m}x{n}x{k} done", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
def section_blockm():
    """Block scheme, M = 32 to 256: the Triton group quantizer + split-K Triton block GEMM against
    the column-major quantizer + cuBLAS blockwise, GPU time in CUDA graphs (8 weight copies), on
    every benchmark shape (TRITON_MAX_M["block"] was set when cuBLAS did not take K > 8192)."""
    from bench_linear import SHAPES
    from fp8now.kernels import torch_mm, triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import quantize_weight
    copies = 8
    for n, k in SHAPES:
        if torch_mm.blockwise_unfit(k) is not None:
            continue
        w = varied(n, k, seed=n + 5 * k, device="cuda")
        wc = [w.clone() for _ in range(copies)]
        wq = [tuple(t.clone() for t in quantize_weight(w, "block")) for _ in range(copies)]
        for m in (32, 64, 128, 256):
            x = varied(m, k, seed=m + n, device="cuda")
            base = dict(M=m, N=n, K=k)
            add(sec="blockm", impl="bf16", graph=graph_ms(
                lambda i: (lambda: torch.nn.functional.linear(x, wc[i])), copies, 5, 20), **base)
            tri = lambda i: tg.block_gemm(*tq.quantize_act_group(x), *wq[i])  # noqa: E731
            cub = lambda i: torch_mm.blockwise_mm(*tq.quantize_act_group(x, col_major=True), *wq[i],  # noqa: E731
                                                  None, torch.bfloat16)
            err = rel(tri(0), cub(0))
            for name, call in (("triton", tri), ("cublas", cub)):
                add(sec="blockm", impl=name, graph=graph_ms(lambda i, call=call: (lambda: call(i)), copies, 5, 20),
                    err=err, **base)
        del w, wc, wq
        torch.cuda.empty_cache()
        print(f"blockm {n}x{k} done", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
def host_us(fn, calls: int = 200) -> float:
    """Host µs per call of `fn`, the GPU held busy by a long sleep kernel so that every launch just
    queues (calls x launches stays under the launch queue's ~1000 entries)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9))   # ~1 s of GPU cycles: longer than the timed host loop
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def section_host():
    """Host (Python + launch) cost per eager call of Fp8Linear, with and without decode graphs, and of
    its parts: small-M eager rows ran at 0.2-0.3x bf16 though their GPU time is 1.0-1.4x faster
    (2026-12-03 run 6 also printed a cProfile of the call: Triton's launcher and our wrappers' checks)."""
    from fp8now import Fp8Config, Fp8Linear, Scheme
    from fp8now.kernels import torch_mm, triton_quant as tq
    n, k = 4096, 14336
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(varied(n, k, seed=7, device="cuda"))
    layers = {s: Fp8Linear.from_linear(lin, Fp8Config(scheme=Scheme(s))) for s in ("channel", "block")}
    plain = {s: Fp8Linear.from_linear(lin, Fp8Config(scheme=Scheme(s), decode_graphs=False))
             for s in ("channel", "block")}
    e = torch.empty(1, device="cuda")
    add(sec="host", impl="torch.empty", M=0, us=host_us(lambda: torch.empty((16, 16), device="cuda")))
    add(sec="host", impl="tensor.zero_", M=0, us=host_us(lambda: e.zero_()))
    for m in (1, 4, 16, 256):
        x = varied(m, k, seed=m, device="cuda")
        add(sec="host", impl="bf16 F.linear", M=m, us=host_us(lambda: torch.nn.functional.linear(x, lin.weight)))
        for s in layers:
            add(sec="host", impl=f"{s} layer (decode graphs)", M=m, us=host_us(lambda: layers[s](x)))
            add(sec="host", impl=f"{s} layer (every call launched)", M=m, us=host_us(lambda: plain[s](x)))
            same = all(bool(torch.equal(layers[s](x), plain[s](x))) for _ in range(2))
            add(sec="host", impl=f"{s} graphs == plain", M=m, us=float(same))
            w, ws = plain[s].weight, plain[s].weight_scale
            if s == "channel":
                add(sec="host", impl="quantize_act_token", M=m, us=host_us(lambda: tq.quantize_act_token(x)))
            else:
                add(sec="host", impl="quantize_act_group", M=m, us=host_us(lambda: tq.quantize_act_group(x)))
                if m > 32:
                    xq, xs = tq.quantize_act_group(x, col_major=True)
                    add(sec="host", impl="torch_mm.blockwise_mm", M=m, us=host_us(
                        lambda: torch_mm.blockwise_mm(xq, xs, w, ws, None, torch.bfloat16)))
        print(f"host M={m} done", file=sys.stderr, flush=True)


def section_launchparts():
    """Where the ~30 µs of host per quantizer call goes (GPU kept busy): triton's launch path on
    prepared arguments, the C launcher alone, allocations, the whole wrapper; then a
    cProfile of 300 eager channel calls (M = 16, no decode graphs)."""
    import cProfile
    import io
    import pstats
    from fp8now import Fp8Config, Fp8Linear, Scheme
    from fp8now.kernels import triton_quant as tq
    m, k = 16, 4096
    x = varied(m, k, seed=1, device="cuda")
    q = torch.empty((m, k), device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty((m,), device="cuda", dtype=torch.float32)
    kern = tq._row_quant_kernel
    single, bk, bm, warps = tq._row_plan(m, k)
    grid = (triton.cdiv(m, bm),)
    args = (x, q, s, m, k, x.stride(0), q.stride(0))
    w = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    kw = dict(FMAX=tq.E4M3FN.fmax, FLOOR=tq.E4M3FN.min_scale, BLOCK_M=bm, BLOCK_K=bk, SINGLE=single, EARLY=False,
              num_warps=warps)
    compiled = kern[grid](*args, **kw)
    stream = torch.cuda.current_stream().cuda_stream
    tail = [kw[n] for n in kern.arg_names[len(args):]]
    run = compiled.run
    rows = {
        "kernel[grid](...)": lambda: kern[grid](*args, **kw),
        "compiled.run(...) (C launcher)": lambda: run(grid[0], 1, 1, stream, compiled.function,
                                                      compiled.packed_metadata, None, None, None, *args, *tail),
        "torch.empty x2": lambda: (torch.empty((m, k), device="cuda", dtype=torch.float8_e4m3fn),
                                   torch.empty((m, 1), device="cuda", dtype=torch.float32)),
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "quantize_act_token(x)": lambda: tq.quantize_act_token(x),
        "F.linear bf16 (4096 x 4096)": lambda: torch.nn.functional.linear(x, w),
    }
    for name, fn in rows.items():
        add(sec="launchparts", impl=name, M=m, us=min(host_us(fn) for _ in range(3)))
    lin = torch.nn.Linear(k, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=Scheme("channel"), decode_graphs=False))
    add(sec="launchparts", impl="channel layer (no graphs)", M=m, us=min(host_us(lambda: layer(x)) for _ in range(3)))
    for _ in range(20):
        layer(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        layer(x)
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    add(sec="launchparts", impl="cProfile", M=m, text=buf.getvalue()[-5000:])


def section_m1cublas():
    """M = 1: per token equals per tensor for one row, so a tensor-scheme call could use cuBLAS
    tensorwise `_scaled_mm` (0-d scales) and a channel call rowwise; against the decode path
    (quantizer + split-K decode kernel), eager (do_bench) and GPU time (graphs of 8 weight copies).
    (Run 13 labelled the decode path "shipped"; tensor at M = 1 has shipped the cuBLAS one since.)"""
    from fp8now.kernels import split_counters, torch_mm, triton_decode as td, triton_quant as tq
    from fp8now.numerics import quantize_weight
    from bench_linear import SHAPES
    copies = 8
    for n, k in SHAPES:
        w = varied(n, k, seed=n + 5 * k, device="cuda")
        wq = {sch: [tuple(t.clone() for t in quantize_weight(w, sch)) for _ in range(copies)]
              for sch in ("tensor", "channel")}
        cnt = [split_counters(n, "cuda") for _ in range(copies)]
        ws = [w.clone() for _ in range(copies)]
        x = varied(1, k, seed=n, device="cuda")
        base = dict(M=1, N=n, K=k)

        def decode(sch, i):  # the M = 1 tensor / channel path before TENSORWISE_M1 (PDL at M = 1)
            q_w, s_w = wq[sch][i]
            q, s = tq.quantize_act_token(x, early_launch=True)
            return td.decode_linear(q, q_w, s_w, sch, "token", x_scale=s, counters=cnt[i], pdl=True)

        def cublas(sch, i):
            q_w, s_w = wq[sch][i]
            q, s = tq.quantize_act_token(x)
            if sch == "tensor":
                return torch_mm.rowwise_mm(q, s.reshape(()), q_w, s_w.reshape(()), None, torch.bfloat16)
            return torch_mm.rowwise_mm(q, s, q_w, s_w, None, torch.bfloat16)
        calls = {"bf16": lambda i: torch.nn.functional.linear(x, ws[i])}
        for sch in ("tensor", "channel"):
            calls[f"{sch} decode"] = lambda i, sch=sch: decode(sch, i)
            calls[f"{sch} cublas"] = lambda i, sch=sch: cublas(sch, i)
        for name, call in calls.items():
            try:
                err = 0.0 if name == "bf16" else rel(call(0), decode(name.split()[0], 0))
                add(sec="m1cublas", impl=name, ms=bench(lambda: call(0), 10, 25),
                    graph=graph_ms(lambda i, call=call: (lambda: call(i)), copies, 5, 20), err=err, **base)
            except Exception as e:
                add(sec="m1cublas", impl=name, fail=f"{type(e).__name__}: {e}"[:300], **base)
        del w, wq, cnt, ws
        torch.cuda.empty_cache()
        print(f"m1cublas {n}x{k} done", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
def section_decode():
    from fp8now.kernels import split_counters, triton_decode as td, triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import quantize_weight
    copies = 8
    for n, k in [(4096, 4096), (6144, 4096), (8192, 8192), (4096, 14336), (28672, 4096), (8192, 28672)]:
        w = varied(n, k, seed=n + 3 * k, device="cuda")
        wq = {s: [tuple(t.clone() for t in quantize_weight(w, s)) for _ in range(copies)]
              for s in ("channel", "block")}
        cnt = [split_counters(n, "cuda") for _ in range(copies)]
        for m in (1, 4, 16):
            x = varied(m, k, seed=m + n, device="cuda")
            base = dict(M=m, N=n, K=k)
            add(sec="decode", impl="bf16", graph=graph_ms(
                lambda i: (lambda: torch.nn.functional.linear(x, w)), copies, 5, 20), **base)

            def tok(i, pdl=False):
                q, s = tq.quantize_act_token(x, early_launch=pdl)
                return td.decode_linear(q, *wq["channel"][i], "channel", "token", x_scale=s, counters=cnt[i],
                                        pdl=pdl)

            def grp(i):
                q, s = tq.quantize_act_group(x)
                return td.decode_linear(q, *wq["block"][i], "block", "group", x_scale=s, counters=cnt[i])
            # (2026-12-03 run 1 also timed an L2 bulk prefetch of each program's weight slice, with and
            # without PDL: 0.55-0.92x everywhere; that kernel option was removed, BENCHMARKS.md)
            calls = {
                "channel-pre": tok,
                "channel-pre+pdl": lambda i: tok(i, pdl=True),
                "block-old": lambda i: tg.block_gemm(*tq.quantize_act_group(x), *wq["block"][i]),
                "block-pre": grp,
            }
            if m == 1:
                calls["channel-fused"] = lambda i: td.decode_linear(x, *wq["channel"][i], "channel", "token",
                                                                    counters=cnt[i])
                calls["block-fused"] = lambda i: td.decode_linear(x, *wq["block"][i], "block", "group",
                                                                  counters=cnt[i])
            want = {"channel": tok(0), "block": grp(0)}
            for name, call in calls.items():
                scheme = name.split("-")[0]
                try:
                    y = call(0)
                    same = bool(torch.equal(y, want[scheme]))
                    err = rel(y, want[scheme])
                    # replayed: a graph of 8 calls on copy 0, outputs compared after each replay
                    ys = []
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(8):
                            ys.append(call(0))
                    replay_same = True
                    for _ in range(20):
                        g.replay()
                        torch.cuda.synchronize()
                        replay_same &= all(bool(torch.equal(t, want[scheme])) for t in ys)
                    del g, ys
                    add(sec="decode", impl=name, graph=graph_ms(lambda i, call=call: (lambda: call(i)),
                                                                copies, 5, 20),
                        same=same, replay_same=replay_same, err=err, **base)
                except Exception as e:
                    add(sec="decode", impl=name, fail=f"{type(e).__name__}: {e}"[:300], **base)
        del w, wq, cnt
        torch.cuda.empty_cache()
        print(f"decode {n}x{k} done", file=sys.stderr, flush=True)


def section_cublas():
    """cuBLAS blockwise (torch._scaled_mm, 1x128 x 128x128) at K > 8192, whole and cut into K chunks
    with float32 partial outputs, against the float64 product of the same FP8 operands."""
    from fp8now.kernels import torch_mm, triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import dequantize, quantize_weight
    for m, n, k in [(16384, 4096, 14336), (4096, 4096, 14336), (1024, 4096, 14336), (256, 4096, 14336),
                    (16384, 8192, 28672), (4096, 8192, 8192), (4096, 4096, 10240), (4096, 4096, 12288)]:
        w = varied(n, k, seed=n * 5 + k, device="cuda")
        x = varied(m, k, seed=m + 7 * k, device="cuda")
        wq, ws = quantize_weight(w, "block")
        xq, xs = tq.quantize_act_group(x, col_major=True)
        ref = dequantize(xq, xs, (1, 128)).double() @ dequantize(wq, ws, (128, 128)).double().T
        base = dict(M=m, N=n, K=k)
        add(sec="cublas", impl="bf16", ms=bench(lambda: torch.nn.functional.linear(x, w), 5, 20), **base)
        add(sec="cublas", impl="triton-block", err=rel(tg.block_gemm(xq, xs, wq, ws, out_dtype=torch.float32), ref),
            ms=bench(lambda: tg.block_gemm(xq, xs, wq, ws), 5, 20), **base)
        variants = {"whole-bf16": lambda: torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16),
                    "whole-f32": lambda: torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.float32)}
        for chunk in (4096, 7168, 8192):
            if k > chunk and k % chunk == 0 or (k > chunk and (k % chunk) % 512 == 0):
                variants[f"chunks{chunk}-lib"] = (lambda c=chunk: torch_mm.blockwise_mm(
                    xq, xs, wq, ws, None, torch.bfloat16, k_chunk=c))

                def strided(c=chunk):
                    y = None
                    for a in range(0, k, c):
                        b = min(k, a + c)
                        part = torch._scaled_mm(xq[:, a:b], wq[:, a:b].t(), xs[:, a // 128:b // 128],
                                                ws[:, a // 128:b // 128].t(), out_dtype=torch.float32)
                        y = part if y is None else y.add_(part)
                    return y
                variants[f"chunks{chunk}-strided"] = strided
        for name, fn in variants.items():
            try:
                err = rel(fn(), ref)
                add(sec="cublas", impl=name, err=err, ms=bench(fn, 5, 20), **base)
            except Exception as e:
                add(sec="cublas", impl=name, fail=f"{type(e).__name__}: {e}"[:200], **base)
        del w, x, wq, ws, xq, xs, ref
        torch.cuda.empty_cache()
        print(f"cublas {m}x{n}x{k} done", file=sys.stderr, flush=True)


def section_cublas_data():
    """cuBLAS blockwise (whole K) and the Triton block GEMM against the float64 product, on
    check_core_gpu's data (magnitudes 2^+-4 across rows and 128-tiles) and bench data, at the K
    where the unaligned reference once made cuBLAS look wrong (BENCHMARKS.md), and their GEMM times."""
    import check_core_gpu as cc
    from fp8now import Scheme, rel_diff
    from fp8now.kernels import triton_gemm as tg
    from fp8now.kernels.reference import exact_matmul
    from fp8now.numerics import quantize_activation, quantize_weight
    for m, n, k in [(256, 4096, 14336), (256, 576, 7168), (256, 4096, 6144), (4096, 4096, 14336),
                    (4096, 4096, 7168), (16384, 8192, 28672)]:
        for data in ("core", "bench"):
            if data == "core":
                w, x = cc.varied(n, k, seed=n + k).cuda(), cc.varied(m, k, seed=7 * k).cuda()
            else:
                w, x = varied(n, k, seed=n + k, device="cuda"), varied(m, k, seed=7 * k, device="cuda")
            wq, ws = quantize_weight(w, "block")
            xq, xs = quantize_activation(x, "group")
            xsc = xs.t().contiguous().t()
            rows = min(m, 512)        # the float64 product of all rows would take minutes at 16384
            ref = exact_matmul(xq[:rows], xs[:rows], wq, ws, Scheme.BLOCK)
            base = dict(sec="cublas_data", M=m, N=n, K=k, data=data)
            for name, fn in (("cublas-f32", lambda: torch._scaled_mm(xq, wq.t(), xsc, ws.t(), out_dtype=torch.float32)),
                             ("cublas-bf16", lambda: torch._scaled_mm(xq, wq.t(), xsc, ws.t(), out_dtype=torch.bfloat16)),
                             ("triton-f32", lambda: tg.block_gemm(xq, xs, wq, ws, out_dtype=torch.float32))):
                y = fn()[:rows]
                add(impl=name, rd=rel_diff(y, ref), err=rel(y, ref),
                    ms=bench(fn, 5, 15) if data == "bench" and name != "cublas-f32" else None, **base)
            if data == "bench":
                add(impl="bf16", ms=bench(lambda: torch.nn.functional.linear(x, w), 5, 15), **base)
            del w, x, wq, ws, xq, xs, xsc, ref
            torch.cuda.empty_cache()
        print(f"cublas_data {m}x{n}x{k} done", file=sys.stderr, flush=True)
    bf = bf16_times("cublas_data")
    for r in ROWS:
        if r.get("sec") == "cublas_data" and r["impl"] != "bf16":
            t = (f"{1e3 * r['ms']:9.1f} us {bf[(r['M'], r['N'], r['K'])] / r['ms']:5.2f}x" if r.get("ms")
                 else " " * 18)
            print(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['data']:6} {r['impl']:12} {t} "
                  f"rel_diff {r['rd']:.1e} norm {r['err']:.1e}")


def produce(producer: str, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The activation a layer is fed: transformers' Llama RMSNorm of `a` (weight `w`), or SiLU(a) x b."""
    if producer == "norm":
        h = a.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    return torch.nn.functional.silu(a) * b


# ------------------------------------------------------------------------------------------------
def section_compiledquant():
    from fp8now import Fp8Config, Fp8Linear
    from fp8now.kernels import triton_fp8
    ms = [int(v) for v in os.environ.get("CQ_M", "16,8192").split(",")]  # ~8 s of compile per row
    cases = [("norm", 6144, 4096), ("norm", 8192, 8192), ("silu", 4096, 14336), ("silu", 8192, 28672)]
    if os.environ.get("CQ_CASES"):   # e.g. silu:4096:14336,norm:6144:4096
        cases = [(p, int(n), int(k)) for p, n, k in (c.split(":") for c in os.environ["CQ_CASES"].split(","))]
    want_kernels = bool(os.environ.get("CQ_KERNELS"))   # also the CUDA kernels of each compiled call
    shipped = dict(triton_fp8.COMPILED_QUANT)
    for producer, n, k in cases:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        lin.weight.copy_(varied(n, k, seed=n + k, device="cuda") * 0.02)
        layers = {"bf16": lin, **{f"fp8now-{s}": Fp8Linear.from_linear(lin, Fp8Config(scheme=s))
                                  for s in ("channel", "block")}}
        w = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        for m in ms:
            if producer == "norm":
                args = (varied(m, k, seed=m, device="cuda"),)
            else:
                args = (varied(m, k, seed=m, device="cuda"), varied(m, k, seed=m + 1, device="cuda"))
            for name, layer in layers.items():
                def f(*a, layer=layer):
                    return layer(produce(producer, w, *a))
                for fused in ((True, False) if name != "bf16" else (True,)):
                    triton_fp8.COMPILED_QUANT = {"token": fused, "group": fused}
                    torch._dynamo.reset()
                    try:
                        comp = torch.compile(f, fullgraph=True)
                        y = comp(*args)
                        ref = f(*args)   # eager: Triton quantizer after the eager producer
                        gms = graph_ms(lambda i, comp=comp: (lambda: comp(*args)), 1, 5, 25)
                        impl = name if name == "bf16" else f"{name}-{'fused' if fused else 'triton-quant'}"
                        extra = {"kernels": kernels_of(lambda: comp(*args))} if want_kernels else {}
                        add(sec="compiledquant", producer=producer, M=m, N=n, K=k, impl=impl, graph=gms,
                            rel_to_eager=rel(y, ref), **extra)
                    except Exception as e:
                        add(sec="compiledquant", producer=producer, M=m, N=n, K=k, impl=name,
                            fused=fused, fail=f"{type(e).__name__}: {e}"[:300])
        triton_fp8.COMPILED_QUANT = shipped
        del layers, lin
        torch.cuda.empty_cache()


def section_cqvariants():
    from torch._inductor.utils import run_and_get_code

    from fp8now import numerics
    from fp8now.kernels import triton_quant
    from fp8now.numerics import ACT_RULE, E4M3FN, exact_div32, scale_from_amax
    fmt = E4M3FN

    def group(x, col_major):           # numerics' group quantizer, scales optionally column-major
        q, s = numerics.quantize_activation(x, "group")
        return q, (s.t().contiguous().t() if col_major else s)

    def group_bf16amax(x, col_major):   # amax taken on the bf16 values (exact), one float upcast later
        m, k = x.shape
        xg = x.reshape(m, k // 128, 128)
        s = scale_from_amax(xg.abs().amax(dim=2, keepdim=True).float(), ACT_RULE["group"], fmt)
        q = exact_div32(xg.float(), s).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).reshape(m, k)
        s = s.reshape(m, k // 128)
        return q, (s.t().contiguous().t() if col_major else s)

    quants = {
        "none": lambda h: (h,),
        "group-colmajor": lambda h: group(h, True),
        "group-rowmajor": lambda h: group(h, False),
        "group-bf16amax-colmajor": lambda h: group_bf16amax(h, True),
        "group-triton-colmajor": lambda h: triton_quant.quantize_act_group(h, col_major=True),
        "token": lambda h: numerics.quantize_activation(h, "token"),
        "token-triton": triton_quant.quantize_act_token,
    }
    ms = [int(v) for v in os.environ.get("CQ_M", "8192").split(",")]
    for producer, k in (("silu", 14336), ("norm", 4096)):
        w = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        for m in ms:
            args = (varied(m, k, seed=m, device="cuda"), varied(m, k, seed=m + 1, device="cuda"))
            for name, qf in quants.items():
                def f(a, b, qf=qf):
                    return qf(produce(producer, w, a, b))
                torch._dynamo.reset()
                try:
                    comp = torch.compile(f, fullgraph=True)
                    out, code = run_and_get_code(comp, *args)
                    with open(os.path.join(OUT, f"cq_{producer}_{m}_{name}.py"), "w") as fh:
                        fh.write("\n\n# ----\n".join(code))
                    gms = graph_ms(lambda i, comp=comp: (lambda: comp(*args)), 1, 5, 25)
                    nbytes = sum(t.numel() * t.element_size() for t in args) if producer == "silu" else \
                        args[0].numel() * 2
                    nbytes += sum(t.numel() * t.element_size() for t in out)
                    add(sec="cqvariants", producer=producer, M=m, K=k, impl=name, graph=gms,
                        tbps=nbytes / gms / 1e9, kernels=sum(c.count("@triton.jit") for c in code))
                except Exception as e:
                    add(sec="cqvariants", producer=producer, M=m, K=k, impl=name,
                        fail=f"{type(e).__name__}: {e}"[:300])
        torch.cuda.empty_cache()


def decode_configs() -> list[dict]:
    """The shipped decode config first, then a grid around it (likely candidates early); with env
    DCFG_SPLITS (a list of SPLIT_K values) only the shipped tile shape at those splits."""
    import itertools

    from fp8now.kernels.triton_decode import DECODE_CONFIG
    out = [dict(DECODE_CONFIG)]
    if os.environ.get("DCFG_SPLITS"):
        return out + [dict(DECODE_CONFIG, SPLIT_K=int(v)) for v in os.environ["DCFG_SPLITS"].split(",")
                      if dict(DECODE_CONFIG, SPLIT_K=int(v)) not in out]
    # SPLIT_K = 1: no in-kernel reduction (its partial store, ticket and re-read are a serial tail)
    splits = (0, 1, 2, 4, 8, 16)
    grid = [(split, bn, 4, stages) for split, bn, stages in itertools.product(splits, (64, 32, 128, 16), (4, 6))]
    grid += [(split, 128, 8, 4) for split in splits]
    for split, bn, warps, stages in grid:
        cfg = dict(DECODE_CONFIG, BLOCK_N=bn, num_warps=warps, num_stages=stages, SPLIT_K=split)
        if cfg not in out:
            out.append(cfg)
    return out


def env_cases(prefix: str, shapes: str, ms: str) -> tuple[list[tuple[int, int]], list[int]]:
    """(N, K) shapes from env PREFIX_SHAPES ("NxK,..."), M values from PREFIX_M, else the defaults."""
    return ([tuple(int(v) for v in sh.split("x")) for sh in os.environ.get(f"{prefix}_SHAPES", shapes).split(",")],
            [int(v) for v in os.environ.get(f"{prefix}_M", ms).split(",")])


def section_decodecfg():
    from fp8now.kernels import split_counters, triton_decode as td, triton_quant as tq
    from fp8now.numerics import quantize_weight
    copies, t0 = 8, time.time()
    budget = float(os.environ.get("DCFG_BUDGET_S", "330"))
    shapes, ms = env_cases("DCFG", "4096x4096,6144x4096,8192x8192", "1,4,16")
    configs = decode_configs()
    for n, k in shapes:
        if time.time() - t0 > budget:
            break
        w = varied(n, k, seed=n + 5 * k, device="cuda")
        wq = {s: [tuple(t.clone() for t in quantize_weight(w, s)) for _ in range(copies)]
              for s in ("channel", "block")}
        cnt = [split_counters(n, "cuda") for _ in range(copies)]
        for m in ms:
            x = varied(m, k, seed=m + n + 1, device="cuda")
            base = dict(sec="decodecfg", M=m, N=n, K=k)
            add(impl="bf16", graph=graph_ms(lambda i: (lambda: torch.nn.functional.linear(x, w)), copies, 5, 20),
                **base)

            def channel(i, cfg, out=torch.bfloat16):
                pdl = m <= 4
                q, s = tq.quantize_act_token(x, early_launch=pdl)
                return td.decode_linear(q, *wq["channel"][i], "channel", "token", x_scale=s, counters=cnt[i],
                                        config=cfg, pdl=pdl, out_dtype=out)

            def block(i, cfg, out=torch.bfloat16):
                if m == 1:
                    return td.decode_linear(x, *wq["block"][i], "block", "group", counters=cnt[i], config=cfg,
                                            out_dtype=out)
                q, s = tq.quantize_act_group(x)
                return td.decode_linear(q, *wq["block"][i], "block", "group", x_scale=s, counters=cnt[i],
                                        config=cfg, out_dtype=out)

            exact = {"channel": exact_product(*tq.quantize_act_token(x), *wq["channel"][0], "channel"),
                     "block": exact_product(*tq.quantize_act_group(x), *wq["block"][0], "block")}
            for scheme, call in (("channel", channel), ("block", block)):
                for ci, cfg in enumerate(configs):
                    if time.time() - t0 > budget:
                        add(impl=f"{scheme}-budget", fail=f"budget {budget:.0f} s spent", **base)
                        break
                    tag = {kk: cfg[kk] for kk in ("BLOCK_N", "num_warps", "num_stages", "SPLIT_K")}
                    try:
                        err = rel(call(0, cfg, torch.float32), exact[scheme])   # float32 out: ~1e-7
                        gms = graph_ms(lambda i, cfg=cfg, call=call: (lambda: call(i, cfg)), copies, 3, 10)
                        add(impl=scheme, shipped=ci == 0, cfg=tag, graph=gms, err=err, **base)
                    except Exception as e:
                        add(impl=scheme, shipped=ci == 0, cfg=tag, fail=f"{type(e).__name__}: {e}"[:200], **base)
        del w, wq, cnt
        torch.cuda.empty_cache()
        print(f"decodecfg {n}x{k} done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def section_decodex():
    from fp8now.config import Scheme
    from fp8now.kernels import split_counters, triton_decode as td, triton_fp8, triton_gemm, triton_quant as tq
    from fp8now.numerics import quantize_weight
    copies, t0 = 8, time.time()
    budget = float(os.environ.get("DX_BUDGET_S", "300"))
    shapes, ms = env_cases("DX", "4096x4096,6144x4096,4096x14336,8192x8192", "1,2,4,8,16")
    grid = [dict(td.DECODE_CONFIG, BLOCK_N=bn, num_stages=st, SPLIT_K=sp)
            for bn in (64, 32) for st in (4, 6) for sp in (2, 4, 8)]
    for n, k in shapes:
        w = varied(n, k, seed=n + 7 * k, device="cuda")
        wq = {sc: [tuple(t.clone() for t in quantize_weight(w, sc)) for _ in range(copies)]
              for sc in ("channel", "block")}
        wt = [tuple(t.clone() for t in quantize_weight(w, "tensor")) for _ in range(copies)]
        cnt = [split_counters(n, "cuda") for _ in range(copies)]
        slots = {sp: [td.exchange_slots(n, sp, "cuda") for _ in range(copies)] for sp in (2, 4, 8)}
        for m in ms:
            if time.time() - t0 > budget:
                add(sec="decodex", impl="budget", fail=f"budget {budget:.0f} s spent", M=m, N=n, K=k)
                break
            x = varied(m, k, seed=m + n + 3, device="cuda")
            base = dict(sec="decodex", M=m, N=n, K=k)
            add(impl="bf16", graph=graph_ms(lambda i: (lambda: torch.nn.functional.linear(x, w)), copies, 5, 20),
                **base)
            for sc in ("channel", "block", "tensor"):
                scheme = Scheme(sc)
                act = "group" if sc == "block" else "token"
                wsc = wt if sc == "tensor" else wq[sc]
                add(impl=f"{sc}-shipped", graph=graph_ms(lambda i, wsc=wsc, scheme=scheme, act=act: (
                    lambda: triton_fp8.linear(x, *wsc[i], None, scheme, act, counters=cnt[i])), copies, 3, 10),
                    **base)
            def call(i, sc, cfg, xch, out=torch.bfloat16):  # cfg None: the decode kernel's auto plan
                sl = slots[cfg["SPLIT_K"]][i] if xch else None
                if sc == "channel":
                    pdl = m <= 4
                    q, s = tq.quantize_act_token(x, early_launch=pdl)
                    return td.decode_linear(q, *wq[sc][i], sc, "token", x_scale=s, counters=cnt[i], config=cfg,
                                            pdl=pdl, out_dtype=out, slots=sl)
                q, s = tq.quantize_act_group(x)
                return td.decode_linear(q, *wq[sc][i], sc, "group", x_scale=s, counters=cnt[i], config=cfg,
                                        out_dtype=out, slots=sl)

            if m > 1:  # the plan before the few-split rows: auto splits and the ticket; block's split-K GEMM
                def auto_block(i):
                    q, s = tq.quantize_act_group(x)
                    return triton_gemm.block_gemm(q, s, *wq["block"][i], None, torch.bfloat16)
                for sc, fn in (("channel", lambda i: call(i, "channel", None, False)), ("block", auto_block)):
                    add(impl=f"{sc}-auto", graph=graph_ms(lambda i, fn=fn: (lambda: fn(i)), copies, 3, 10), **base)
            if os.environ.get("DX_GRID", "1") == "0":
                continue
            exact = {"channel": exact_product(*tq.quantize_act_token(x), *wq["channel"][0], "channel"),
                     "block": exact_product(*tq.quantize_act_group(x), *wq["block"][0], "block")}
            for sc in ("channel", "block"):
                for cfg in grid:
                    if sc == "block" and cfg["num_stages"] == 6:
                        continue
                    for xch in (False, True):
                        tag = dict(BLOCK_N=cfg["BLOCK_N"], stages=cfg["num_stages"], splits=cfg["SPLIT_K"],
                                   reduce="exchange" if xch else "ticket")
                        try:
                            err = rel(call(0, sc, cfg, xch, torch.float32), exact[sc])
                            row = dict(impl=sc, cfg=tag, err=err)
                            if xch:  # the same bytes whoever arrives second, replay after replay
                                y0 = call(0, sc, cfg, xch)
                                g = torch.cuda.CUDAGraph()
                                with torch.cuda.graph(g):
                                    y = call(0, sc, cfg, xch)
                                same = True
                                for _ in range(20):
                                    g.replay()
                                    same &= bool(torch.equal(y, y0))
                                row["same_bytes_20_replays"] = same
                                row["slots_empty"] = bool((slots[cfg["SPLIT_K"]][0] == td.EMPTY).all())
                            row["graph"] = graph_ms(lambda i, cfg=cfg, sc=sc, xch=xch: (
                                lambda: call(i, sc, cfg, xch)), copies, 3, 10)
                            add(**row, **base)
                        except Exception as e:
                            add(impl=sc, cfg=tag, fail=f"{type(e).__name__}: {e}"[:200], **base)
        del w, wq, wt, cnt, slots
        torch.cuda.empty_cache()
        print(f"decodex {n}x{k} done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def bf16_times(sec: str, field: str = "ms") -> dict:
    """(M, N, K) -> the bf16 row's `field` in section `sec` (the baseline of that section's table)."""
    return {(r["M"], r["N"], r["K"]): r[field] for r in ROWS if r.get("sec") == sec and r["impl"] == "bf16"}


def quant_family(impl: str) -> str:
    return "token" if "group" not in impl else ("group col" if "col=True" in impl else "group row")


def print_host_rows(sec: str, what: str) -> None:
    """The host-time rows of section `sec` (µs per call, or a cProfile text)."""
    print(f"\n== {sec} ({what})")
    for r in ROWS:
        if r.get("sec") == sec:
            if "us" in r:
                print(f"{r['M']:>5} {r['impl']:34} {r['us']:7.1f}")
            elif "text" in r:
                print(f"--- {r['impl']} M={r['M']}\n{r['text'][:4500]}")


def table():
    print("\n== cublas blockwise (x = bf16 / this; err vs float64)")
    bfc = bf16_times("cublas")
    for r in ROWS:
        if r.get("sec") == "cublas" and r["impl"] != "bf16":
            key = (r["M"], r["N"], r["K"])
            if "fail" in r:
                print(f"{key} {r['impl']:22} FAILED {r['fail'][:120]}")
            else:
                print(f"{key} {r['impl']:22} {1e3 * r['ms']:9.1f} us {bfc[key] / r['ms']:5.2f}x err {r['err']:.1e}")
    print("\n== large (ms; x = bf16 / this)")
    bf = bf16_times("large")
    for r in ROWS:
        if r.get("sec") == "large" and r["impl"] != "bf16":
            key = (r["M"], r["N"], r["K"])
            kern = "; ".join(f"{nm[:40]} {us:.0f}" for nm, us in r.get("kernels", [])[:4])
            print(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['impl']:24} {1e3 * r['ms']:9.1f} us "
                  f"{bf[key] / r['ms']:5.2f}x  {kern}")
    print("\n== quant (best 3 per shape, and shipped)")
    for key in sorted({(r["M"], r["K"]) for r in ROWS if r.get("sec") == "quant"}):
        rs = [r for r in ROWS if r.get("sec") == "quant" and (r["M"], r["K"]) == key and "ms" in r]
        for fam in ("token", "group row", "group col"):
            fr = [r for r in rs if quant_family(r["impl"]) == fam]
            ship = [r for r in fr if "shipped" in r["impl"]]
            best = sorted([r for r in fr if r.get("same")], key=lambda r: r["ms"])[:3]
            for r in ship + best:
                print(f"{key[0]:>6} {key[1]:>6} {r['impl']:32} {1e3 * r['ms']:8.1f} us {r['tbs']:5.2f} TB/s")
        bad = [r["impl"] for r in rs if r.get("same") is False]
        if bad:
            print(f"   BYTES DIFFER: {bad}")
    print("\n== block (TFLOP/s; best 4 and bf16)")
    for key in sorted({(r["M"], r["N"], r["K"]) for r in ROWS if r.get("sec") == "block"}):
        rs = [r for r in ROWS if r.get("sec") == "block" and (r["M"], r["N"], r["K"]) == key and "ms" in r]
        for r in [r for r in rs if r["impl"] == "bf16"] + sorted(
                [r for r in rs if r["impl"] != "bf16"], key=lambda r: r["ms"])[:4]:
            print(f"{key} {r['impl']:28} {1e3 * r['ms']:9.1f} us {r['tflops']:7.0f} err {r.get('err', 0):.1e}")
        worst = max((r.get("err", 0) for r in rs), default=0)
        fails = [r["impl"] for r in ROWS if r.get("sec") == "block" and (r["M"], r["N"], r["K"]) == key
                 and "fail" in r]
        print(f"   max err {worst:.1e}; failed: {fails}")
    print("\n== blockm (graph us; x = bf16 / this; err triton vs cublas)")
    bfb = bf16_times("blockm", "graph")
    for r in ROWS:
        if r.get("sec") == "blockm" and r["impl"] != "bf16" and "graph" in r:
            key = (r["M"], r["N"], r["K"])
            print(f"{r['M']:>4} {r['N']:>6} {r['K']:>6} {r['impl']:8} {1e3 * r['graph']:7.1f} "
                  f"{bfb[key] / r['graph']:5.2f}x err={r['err']:.1e}")
    print_host_rows("host", "µs per eager call, GPU kept busy")
    print_host_rows("launchparts", "host µs per call, GPU busy; min of 3")
    print("\n== m1cublas (M = 1; eager us / graph us; x = bf16 / this)")
    bfm = {(r["N"], r["K"]): r for r in ROWS if r.get("sec") == "m1cublas" and r["impl"] == "bf16" and "ms" in r}
    for r in ROWS:
        if r.get("sec") == "m1cublas" and r["impl"] != "bf16":
            b = bfm.get((r["N"], r["K"]))
            if "fail" in r or b is None:
                print(f"{r['N']}x{r['K']} {r['impl']} FAILED {r.get('fail', 'no bf16 row')[:100]}")
                continue
            print(f"{r['N']:>6} {r['K']:>6} {r['impl']:16} eager {1e3 * r['ms']:7.1f} {b['ms'] / r['ms']:5.2f}x "
                  f"graph {1e3 * r['graph']:7.1f} {b['graph'] / r['graph']:5.2f}x err {r['err']:.1e}")
    print("\n== compiledquant (compiled, graph us; x = bf16 compiled / this)")
    bfq = {(r["producer"], r["M"], r["N"], r["K"]): r["graph"] for r in ROWS
           if r.get("sec") == "compiledquant" and r["impl"] == "bf16" and "graph" in r}
    for r in ROWS:
        if r.get("sec") == "compiledquant" and r["impl"] != "bf16":
            key = (r["producer"], r["M"], r["N"], r["K"])
            if "fail" in r or key not in bfq:
                print(f"{key} {r['impl']} FAILED {r.get('fail', 'no bf16 row')[:100]}")
                continue
            print(f"{r['producer']:>5} {r['M']:>5} {r['N']:>6} {r['K']:>6} {r['impl']:26} {1e3 * r['graph']:8.1f} "
                  f"{bfq[key] / r['graph']:5.2f}x rel_to_eager={r['rel_to_eager']:.1e}")
            for nm, us in r.get("kernels", [])[:4]:
                print(f"{'':>12} {us:8.1f} us  {nm[:80]}")
    print("\n== cqvariants (compiled producer + quantizer, graph us, TB/s of the unavoidable bytes)")
    for r in ROWS:
        if r.get("sec") == "cqvariants":
            if "fail" in r:
                print(f"{r['producer']:>5} {r['M']:>5} {r['K']:>6} {r['impl']:24} FAILED {r['fail'][:100]}")
            else:
                print(f"{r['producer']:>5} {r['M']:>5} {r['K']:>6} {r['impl']:24} {1e3 * r['graph']:8.1f} "
                      f"{r['tbps']:5.2f} TB/s {r['kernels']} @triton.jit in the code")
    print("\n== decodecfg (graph us; x = bf16 / this; shipped, then the best 3 configs that pass)")
    bfd = bf16_times("decodecfg", "graph")
    keys = sorted({(r["N"], r["K"], r["M"], r["impl"]) for r in ROWS
                   if r.get("sec") == "decodecfg" and r["impl"] in ("channel", "block")})
    for n, k, m, impl in keys:
        rs = [r for r in ROWS if r.get("sec") == "decodecfg" and (r["N"], r["K"], r["M"], r["impl"]) == (n, k, m, impl)]
        ok = sorted((r for r in rs if "graph" in r and r["err"] < 1e-5), key=lambda r: r["graph"])
        ship = [r for r in rs if r.get("shipped") and "graph" in r]
        bad = sum(1 for r in rs if "fail" in r or ("err" in r and r["err"] >= 1e-5))
        line = f"{n:>6} {k:>6} {m:>3} {impl:8}"
        if ship:
            line += f" shipped {1e3 * ship[0]['graph']:6.1f} ({bfd[(m, n, k)] / ship[0]['graph']:4.2f}x)"
        for r in ok[:3]:
            c = r["cfg"]
            line += (f" | {1e3 * r['graph']:6.1f} ({bfd[(m, n, k)] / r['graph']:4.2f}x) n{c['BLOCK_N']}"
                     f" w{c['num_warps']} s{c['num_stages']} k{c['SPLIT_K']}")
        print(line + (f" [{bad} failed/off]" if bad else ""))
    print("\n== decodex (graph us; x = bf16 / this; per config ticket -> exchange; best of each)")
    bfd = bf16_times("decodex", "graph")
    for key in sorted({(r["N"], r["K"], r["M"]) for r in ROWS if r.get("sec") == "decodex" and "M" in r}):
        n, k, m = key
        rs = [r for r in ROWS if r.get("sec") == "decodex" and (r.get("N"), r.get("K"), r.get("M")) == key]
        for sc in ("channel", "block"):
            ship = [r for r in rs if r["impl"] == f"{sc}-shipped" and "graph" in r]
            best = {}
            bad = 0
            for r in rs:
                if r["impl"] != sc:
                    continue
                if "graph" not in r or r["err"] >= 1e-5 or not r.get("same_bytes_20_replays", True) \
                        or not r.get("slots_empty", True):
                    bad += 1
                    continue
                red = r["cfg"]["reduce"]
                if red not in best or r["graph"] < best[red]["graph"]:
                    best[red] = r
            line = f"{n:>6} {k:>6} {m:>3} {sc:8}"
            if ship:
                line += f" shipped {1e3 * ship[0]['graph']:6.1f} ({bfd[(m, n, k)] / ship[0]['graph']:4.2f}x)"
            for r in rs:
                if r["impl"] in (f"{sc}-auto",) + (("tensor-shipped",) if sc == "channel" else ()):
                    line += f" | {r['impl']} {1e3 * r['graph']:6.1f} ({bfd[(m, n, k)] / r['graph']:4.2f}x)"
            for red, r in sorted(best.items()):
                c = r["cfg"]
                line += (f" | {red} {1e3 * r['graph']:6.1f} ({bfd[(m, n, k)] / r['graph']:4.2f}x)"
                         f" n{c['BLOCK_N']} s{c['stages']} k{c['splits']}")
            print(line + (f" [{bad} failed/off]" if bad else ""))
    print("\n== decode (graph us; x = bf16 / this)")
    bfd = bf16_times("decode", "graph")
    for r in ROWS:
        if r.get("sec") == "decode" and r["impl"] != "bf16":
            key = (r["M"], r["N"], r["K"])
            if "fail" in r:
                print(f"{key} {r['impl']:22} FAILED {r['fail'][:100]}")
                continue
            print(f"{r['M']:>3} {r['N']:>6} {r['K']:>6} {r['impl']:22} {1e3 * r['graph']:7.1f} "
                  f"{bfd[key] / r['graph']:5.2f}x same={r['same']} replay={r['replay_same']} err={r['err']:.1e}")


if __name__ == "__main__":
    wanted = (sys.argv[1] if len(sys.argv) > 1 else "decode,large,quant,block").split(",")
    t0 = time.time()
    for sec in wanted:
        try:
            globals()[f"section_{sec}"]()
        except Exception as e:  # keep the other sections
            import traceback
            traceback.print_exc()
            add(sec=sec, fail=f"{type(e).__name__}: {e}"[:300])
        print(f"[{sec}] done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    table()
