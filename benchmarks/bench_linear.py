"""Time one linear layer per call: bf16, bare FP8 `_scaled_mm` (rowwise, tensorwise, blockwise on
pre-quantized inputs), fp8now's schemes (activation quantization included) and torchao's float8
dynamic configs, eager and compiled, in one run; and the GPU time (host removed) of bf16, fp8now and
bare `_scaled_mm` calls replayed from CUDA graphs (`-graph` rows).

CUDA only. `PYTHONPATH=src python benchmarks/bench_linear.py --out benchmarks/results/linear_h200_DATE.json`
Times are the median of `triton.testing.do_bench` (which flushes L2 before every call).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

M_VALUES = [1, 16, 64, 256, 1024, 4096, 16384]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (57344, 8192),
          (8192, 28672)]


def varied(rows: int, cols: int, seed: int, device: str) -> torch.Tensor:
    """bf16 data with row- and tile-varying magnitudes (as real weights and activations have)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16)
    r = 2.0 ** torch.randint(-3, 4, (rows, 1), generator=g, device=device).to(torch.bfloat16)
    t = 2.0 ** torch.randint(-3, 4, (1, math.ceil(cols / 128)), generator=g, device=device)
    t = t.to(torch.bfloat16).repeat_interleave(128, dim=1)[:, :cols]
    return x * r * t * 0.02


def bench(fn, warmup_ms: int, rep_ms: int) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernels_of(fn, calls=3) -> list[tuple[str, float]]:
    """(kernel name, mean device µs per layer call) of the CUDA kernels `fn` launches."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t > 0:
            out.append((e.key[:90], t / calls))
    return sorted(out, key=lambda r: -r[1])


def graph_ms(make_call, copies: int, warmup_ms: int, rep_ms: int) -> float:
    """GPU time per call without host launch overhead: `copies` calls (each on its own weight copy,
    so the weights stream from HBM and not L2) captured in one CUDA graph; replay time / copies."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return bench(graph.replay, warmup_ms, rep_ms) / copies


# torchao's GEMM accumulation: (name suffix, use_fast_accum) per choice of --torchao-accum. "fast" is
# its default on sm_90 (cuBLAS fast accumulation, partial sums not promoted to float32 along K);
# "f32" accumulates in float32, as SPEC §4 asks of fp8now.
TORCHAO_ACCUM = {"fast": (("", True),), "f32": (("-f32acc", False),),
                 "both": (("", True), ("-f32acc", False))}


def torchao_layers(lin: torch.nn.Linear, accum: str = "fast") -> dict[str, torch.nn.Module]:
    """The peer: torchao float8 dynamic activation + weight, per tensor / per row / 1x128-128x128.

    `accum`: a key of TORCHAO_ACCUM (float32 accumulation adds "-f32acc" to the names)."""
    import copy

    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    from torchao.quantization.granularity import PerBlock, PerRow, PerTensor
    grans = {"torchao-tensor": PerTensor(), "torchao-row": PerRow(),
             "torchao-block": [PerBlock([1, 128]), PerBlock([128, 128])]}
    out = {}
    for suffix, fast in TORCHAO_ACCUM[accum]:
        for name, gran in grans.items():
            m = torch.nn.Sequential(copy.deepcopy(lin))
            quantize_(m, Float8DynamicActivationFloat8WeightConfig(
                granularity=gran, mm_config=Float8MMConfig(use_fast_accum=fast)))
            out[name + suffix] = m
    return out


def run(out_path: str, m_values=M_VALUES, shapes=SHAPES, warmup_ms=5, rep_ms=25,
        with_torchao=True, with_compiled=True, with_graphs=True, with_kernels=False,
        torchao_accum="fast", with_fp8now_compiled=False) -> list[dict]:
    from fp8now import Fp8Config, Fp8Linear, Scheme
    from fp8now.kernels import torch_mm
    from fp8now.numerics import quantize_activation, quantize_weight
    dev = "cuda"
    torch._dynamo.config.recompile_limit = 1024      # the compiled peers must not fall back to eager
    torch._dynamo.config.accumulated_recompile_limit = 4096
    # The compiled peers: M is dynamic; the weight shapes stay static (torch's default). Dynamic weight
    # shapes (one compile for all shapes) were tried on the H200, 2026-12-02: they saved no time and
    # made torchao-tensor-compiled 4.5x slower at M=16384, an unfair peer.
    rows: list[dict] = []
    notes: list[str] = []

    def add(m, n, k, impl, ms, **extra):
        rows.append(dict(M=m, N=n, K=k, impl=impl, ms=ms, **extra))

    for n, k in shapes:
        t0 = time.time()
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(varied(n, k, seed=n * 7 + k, device=dev))
        layers = {f"fp8now-{s.value}": Fp8Linear.from_linear(lin, Fp8Config(scheme=s)) for s in Scheme}
        for s in Scheme:  # the torch backend refuses some shapes (blockwise for K > 8192): say so
            try:
                layers[f"fp8now-{s.value}@torch"] = Fp8Linear.from_linear(lin, Fp8Config(scheme=s, backend="torch"))
            except RuntimeError as e:
                notes.append(f"fp8now-{s.value}@torch {n}x{k}: {str(e)[:200]}")
        backends = {name: layer.backend for name, layer in layers.items()}
        peers: dict[str, torch.nn.Module] = {}
        if with_torchao:
            try:
                peers = torchao_layers(lin, torchao_accum)
            except Exception as e:  # record why; the table then lacks these rows
                notes.append(f"torchao unavailable for {n}x{k}: {type(e).__name__}: {e}")
        compiled = {}
        if with_compiled:
            for name, mod in peers.items():  # one compile per module: M is dynamic
                compiled[name + "-compiled"] = torch.compile(mod, dynamic=True)
        if with_fp8now_compiled:  # fp8now's own layers compiled the same way (quantizer in inductor)
            for s in Scheme:
                compiled[f"fp8now-{s.value}-compiled"] = torch.compile(layers[f"fp8now-{s.value}"], dynamic=True)
        w_q, w_s = quantize_weight(lin.weight, "channel")
        w_qt, w_st = quantize_weight(lin.weight, "tensor")
        w_qb, w_sb = quantize_weight(lin.weight, "block")
        blockwise = torch_mm.blockwise_unfit(k) is None   # cuBLAS blockwise takes this K
        graph_copies = 8 if with_graphs else 0
        lin_copies = [lin] + [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
                              for _ in range(graph_copies - 1)]
        for c in lin_copies[1:]:
            with torch.no_grad():
                c.weight.copy_(lin.weight)
        fp8_copies = {s: [Fp8Linear.from_linear(c, Fp8Config(scheme=s)) for c in lin_copies]
                      for s in Scheme} if graph_copies else {}
        for m in m_values:
            x = varied(m, k, seed=m + k, device=dev)
            x_q, x_s = quantize_activation(x, "token")
            x_qb, x_sb = quantize_activation(x, "group")
            x_sb = x_sb.t().contiguous().t()        # column-major [M, K/128], as cuBLAS blockwise reads it
            bare_block = blockwise and m % 4 == 0   # (fp8now pads other M to a multiple of 4)
            if graph_copies:  # GPU time, host removed; fewer copies at M > 256, where a call is long
                copies_m = graph_copies if m <= 256 else graph_copies // 2
                chan = fp8_copies[Scheme.CHANNEL]
                graphed = {"bf16-graph": lambda i: (lambda: torch.nn.functional.linear(x, lin_copies[i].weight)),
                           **{f"fp8now-{s.value}-graph": (lambda i, c=c: (lambda: c[i](x)))
                              for s, c in fp8_copies.items()},
                           "scaled_mm-graph": lambda i: (lambda: torch._scaled_mm(
                               x_q, chan[i].weight.t(), x_s, chan[i].weight_scale.reshape(1, -1),
                               out_dtype=torch.bfloat16))}
                if bare_block:
                    blk = fp8_copies[Scheme.BLOCK]
                    graphed["scaled_mm-blockwise-graph"] = lambda i: (lambda: torch._scaled_mm(
                        x_qb, blk[i].weight.t(), x_sb, blk[i].weight_scale.t(), out_dtype=torch.bfloat16))
                for name, make_call in graphed.items():
                    try:
                        add(m, n, k, name, graph_ms(make_call, copies_m, warmup_ms, rep_ms), copies=copies_m)
                    except Exception as e:
                        notes.append(f"{name} M={m} {n}x{k}: {type(e).__name__}: {str(e)[:200]}")
            add(m, n, k, "bf16", bench(lambda: torch.nn.functional.linear(x, lin.weight), warmup_ms, rep_ms))
            add(m, n, k, "scaled_mm", bench(lambda: torch._scaled_mm(
                x_q, w_q.t(), x_s, w_s.reshape(1, -1), out_dtype=torch.bfloat16), warmup_ms, rep_ms))
            x_qt, x_st = quantize_activation(x, "tensor")
            add(m, n, k, "scaled_mm-tensorwise", bench(lambda: torch._scaled_mm(
                x_qt, w_qt.t(), x_st, w_st, out_dtype=torch.bfloat16), warmup_ms, rep_ms))
            if bare_block:
                try:
                    add(m, n, k, "scaled_mm-blockwise", bench(lambda: torch._scaled_mm(
                        x_qb, w_qb.t(), x_sb, w_sb.t(), out_dtype=torch.bfloat16), warmup_ms, rep_ms))
                except Exception as e:
                    notes.append(f"scaled_mm-blockwise M={m} {n}x{k}: {type(e).__name__}: {str(e)[:200]}")
            for name, layer in layers.items():
                try:
                    extra = dict(kernels=kernels_of(lambda: layer(x))) if with_kernels and m >= 1024 else {}
                    add(m, n, k, name, bench(lambda: layer(x), warmup_ms, rep_ms), backend=backends[name], **extra)
                except Exception as e:
                    notes.append(f"{name} M={m} {n}x{k}: {type(e).__name__}: {str(e)[:200]}")
            for name, mod in list(peers.items()) + list(compiled.items()):
                try:
                    with torch.no_grad():
                        mod(x)
                        extra = dict(kernels=kernels_of(lambda: mod(x))) if with_kernels and m >= 1024 else {}
                        add(m, n, k, name, bench(lambda: mod(x), warmup_ms, rep_ms), **extra)
                except Exception as e:
                    notes.append(f"{name} M={m} {n}x{k}: {type(e).__name__}: {str(e)[:200]}")
        del layers, peers, compiled, lin_copies, fp8_copies
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump(rows, f, indent=1)
        print(f"  {n}x{k} done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    notes.append("transformers FineGrainedFP8 (5.17) needs the `kernels` hub package and fails offline; "
                 "not timed")
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    with open(out_path.replace(".json", "_notes.txt"), "w") as f:
        f.write("\n".join(notes) + "\n")
    return rows


def summary(rows: list[dict]) -> str:
    """Speed-up over bf16 per (shape, M) for the main impls."""
    impls = ["scaled_mm", "fp8now-tensor", "fp8now-channel", "fp8now-block", "torchao-row",
             "torchao-row-compiled", "torchao-block-compiled", "fp8now-channel-graph"]
    seen = {r["impl"] for r in rows}
    impls += [i + "-f32acc" + c for i in ("torchao-row", "torchao-block") for c in ("", "-compiled")
              if i + "-f32acc" + c in seen]
    impls += [i for i in ("fp8now-channel-compiled", "fp8now-block-compiled") if i in seen]
    base = {(r["M"], r["N"], r["K"]): r["ms"] for r in rows if r["impl"] == "bf16"}
    graph_base = {(r["M"], r["N"], r["K"]): r["ms"] for r in rows if r["impl"] == "bf16-graph"}
    table = {}
    for r in rows:  # graph rows compare with the bf16 graph row; all others with eager bf16
        ref = graph_base if r["impl"].endswith("-graph") else base
        key = (r["M"], r["N"], r["K"])
        if key in ref:
            table[(*key, r["impl"])] = ref[key] / r["ms"]
    lines = [f"{'M':>6} {'N':>6} {'K':>6} {'bf16 ms':>8} " + " ".join(f"{i[:14]:>14}" for i in impls)]
    for (m, n, k), b in sorted(base.items(), key=lambda t: (t[0][1], t[0][2], t[0][0])):
        cells = [f"{table[(m, n, k, i)]:14.2f}" if (m, n, k, i) in table else f"{'-':>14}" for i in impls]
        lines.append(f"{m:>6} {n:>6} {k:>6} {b:8.4f} " + " ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="linear_h200.json")
    ap.add_argument("--quick", action="store_true", help="two shapes, four M values")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--fp8now-compiled", action="store_true",
                    help="also time fp8now's layers under torch.compile (rows fp8now-<scheme>-compiled)")
    ap.add_argument("--torchao-accum", default="fast", choices=sorted(TORCHAO_ACCUM),
                    help="torchao's GEMM accumulation: its default fast, float32, or both sets of peers")
    ap.add_argument("--shapes", default="", help="subset, e.g. 4096x4096,28672x4096 (N x K)")
    ap.add_argument("--rep-ms", type=int, default=25, help="do_bench time per measurement")
    ap.add_argument("--m-values", default="", help="subset of M, e.g. 1024,4096,16384")
    ap.add_argument("--kernels", action="store_true",
                    help="record each fp8now and peer row's CUDA kernels (torch.profiler, M >= 1024)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear.py needs a CUDA GPU")
    kw = {}
    if args.quick:
        kw = dict(m_values=[1, 16, 1024, 16384], shapes=[(4096, 4096), (28672, 4096)])
    if args.shapes:  # one shape with torchao compiled takes ~3 min on the H200: split long runs
        kw["shapes"] = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    if args.m_values:
        kw["m_values"] = [int(v) for v in args.m_values.split(",")]
    result = run(args.out, with_torchao=not args.no_torchao, rep_ms=args.rep_ms, with_kernels=args.kernels,
                 torchao_accum=args.torchao_accum, with_fp8now_compiled=args.fp8now_compiled, **kw)
    print(summary(result))
