"""Time one linear layer per call, every implementation in one run so that ratios are taken within it:
bf16, bare FP8 `_scaled_mm` on pre-quantized inputs (rowwise, tensorwise, blockwise), fp8now's schemes
(activation quantization included) and torchao's float8 dynamic configs, eager and compiled; and the
GPU time (host removed) of bf16, fp8now and bare `_scaled_mm` replayed from CUDA graphs (`-graph` rows),
each on the same number of separate weight copies (timing.GraphTimer).

CUDA only:
    PYTHONPATH=src python benchmarks/bench_linear.py                 # -> results/linear_h200.json
    PYTHONPATH=src python benchmarks/bench_linear.py --decode        # M = 1-16, graph rows only
                                                                     # -> results/decode_h200.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import record
from timing import GraphTimer, copies_for, kernels_of, l2_flushed_ms, separate_copies

M_VALUES = [1, 16, 64, 256, 1024, 4096, 16384]
DECODE_M = [1, 2, 4, 8, 16]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (57344, 8192),
          (8192, 28672)]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def varied(rows: int, cols: int, seed: int, device: str) -> torch.Tensor:
    """bf16 data with row- and tile-varying magnitudes (as real weights and activations have)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16)
    r = 2.0 ** torch.randint(-3, 4, (rows, 1), generator=g, device=device).to(torch.bfloat16)
    t = 2.0 ** torch.randint(-3, 4, (1, math.ceil(cols / 128)), generator=g, device=device)
    t = t.to(torch.bfloat16).repeat_interleave(128, dim=1)[:, :cols]
    return x * r * t * 0.02


def cublas_blockwise_takes(k: int) -> bool:
    """cuBLAS blockwise scaling wants the weight scale's leading dimension K/128 16-byte aligned."""
    return k % 512 == 0


# torchao's GEMM accumulation: (name suffix, use_fast_accum) per choice of --torchao-accum. "fast" is
# its default on sm_90 (partial sums not promoted to float32 along K); "f32" is what SPEC §4 asks of
# fp8now, the like-for-like peer.
TORCHAO_ACCUM = {"fast": (("", True),), "f32": (("-f32acc", False),),
                 "both": (("", True), ("-f32acc", False))}


def torchao_layers(lin: torch.nn.Linear, accum: str = "fast") -> dict[str, torch.nn.Module]:
    """The peer: torchao float8 dynamic activation + weight, per tensor / per row / 1x128-128x128."""
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


def graph_calls(x: torch.Tensor, blockwise: bool) -> dict:
    """impl -> (copies key, call on one copy) for the GPU-time rows; the copies are built per shape."""
    from fp8now import quantize_activation
    x_q, x_s = quantize_activation(x, "token")
    calls = {"bf16-graph": ("bf16", lambda c: torch.nn.functional.linear(x, c.weight)),
             **{f"fp8now-{s}-graph": (s, lambda c: c(x)) for s in ("tensor", "channel", "block")},
             "scaled_mm-graph": ("channel", lambda c: torch._scaled_mm(
                 x_q, c.weight.t(), x_s, c.weight_scale.reshape(1, -1), out_dtype=torch.bfloat16))}
    if blockwise:
        x_qb, x_sb = quantize_activation(x, "group")
        x_sb = x_sb.t().contiguous().t()     # column-major [M, K/128], as cuBLAS blockwise reads it
        calls["scaled_mm-blockwise-graph"] = ("block", lambda c: torch._scaled_mm(
            x_qb, c.weight.t(), x_sb, c.weight_scale.t(), out_dtype=torch.bfloat16))
    return calls


def eager_calls(x: torch.Tensor, lin: torch.nn.Linear, layers: dict, blockwise: bool) -> dict:
    """impl -> call for the host-launched rows: bf16, bare `_scaled_mm` on pre-quantized operands, fp8now."""
    from fp8now import quantize_activation
    x_q, x_s = quantize_activation(x, "token")
    x_qt, x_st = quantize_activation(x, "tensor")
    ch, te = layers["fp8now-channel"], layers["fp8now-tensor"]
    calls = {"bf16": lambda: torch.nn.functional.linear(x, lin.weight),
             "scaled_mm": lambda: torch._scaled_mm(x_q, ch.weight.t(), x_s, ch.weight_scale.reshape(1, -1),
                                                   out_dtype=torch.bfloat16),
             "scaled_mm-tensorwise": lambda: torch._scaled_mm(x_qt, te.weight.t(), x_st, te.weight_scale,
                                                              out_dtype=torch.bfloat16)}
    if blockwise:
        x_qb, x_sb = quantize_activation(x, "group")
        x_sb = x_sb.t().contiguous().t()
        bl = layers["fp8now-block"]
        calls["scaled_mm-blockwise"] = lambda: torch._scaled_mm(x_qb, bl.weight.t(), x_sb, bl.weight_scale.t(),
                                                                out_dtype=torch.bfloat16)
    return calls


def added_to(path: str, info: dict, shapes) -> tuple[dict, list[dict]]:
    """(meta, rows) to continue a grid split over several calls: the rows of `path` for other shapes,
    which must come from the same commit and GPU (ratios are only taken between rows of one shape)."""
    shapes = set(shapes)
    return record.continued(path, info, lambda r: (r["N"], r["K"]) not in shapes)


def run(out_path: str, m_values=M_VALUES, shapes=SHAPES, warmup_ms=5, rep_ms=25, with_torchao=True,
        with_compiled=True, with_graphs=True, with_eager=True, with_kernels=False, torchao_accum="fast",
        with_fp8now_compiled=False, add=False) -> list[dict]:
    from fp8now import Fp8Config, Fp8Linear, Scheme
    dev = "cuda"
    torch._dynamo.config.recompile_limit = 1024      # the compiled peers must not fall back to eager
    torch._dynamo.config.accumulated_recompile_limit = 4096
    info, rows = record.meta(), []
    if add:
        info, rows = added_to(out_path, info, shapes)

    def measure(m, n, k, impl, fn, extra=None):
        """One row: fn() -> ms (fn may fill `extra`), or the error that stopped it (a gap in the table)."""
        try:
            ms = fn()
            rows.append(dict(M=m, N=n, K=k, impl=impl, ms=ms, **(extra or {})))
        except Exception as e:  # noqa: BLE001 - a failed row is a result worth recording
            rows.append(dict(M=m, N=n, K=k, impl=impl, ms=None, error=f"{type(e).__name__}: {str(e)[:300]}"))

    for n, k in shapes:
        t0 = time.time()
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(varied(n, k, seed=n * 7 + k, device=dev))
        blockwise = cublas_blockwise_takes(k)
        # One copy count per shape, from the smallest weight (FP8): every graph row of this shape gets it.
        timer = GraphTimer(copies_for(n * k), warmup_ms, rep_ms)
        copies = {}
        if with_graphs:   # copied before any call: a layer's first call allocates its workspace
            copies["bf16"] = separate_copies(lin, timer.copies)
            copies.update({s.value: [Fp8Linear.from_linear(c, Fp8Config(scheme=s)) for c in copies["bf16"]]
                           for s in Scheme})
        layers, peers, compiled = {}, {}, {}
        if with_eager:
            layers = {f"fp8now-{s.value}": Fp8Linear.from_linear(lin, Fp8Config(scheme=s)) for s in Scheme}
            torch_layers = {}
            for s in Scheme:   # the torch backend refuses some shapes: the row records why
                try:
                    torch_layers[f"fp8now-{s.value}@torch"] = Fp8Linear.from_linear(
                        lin, Fp8Config(scheme=s, backend="torch"))
                except RuntimeError as e:
                    rows.append(dict(M=None, N=n, K=k, impl=f"fp8now-{s.value}@torch", ms=None,
                                     error=str(e)[:300]))
            layers.update(torch_layers)
            if with_torchao:
                try:
                    peers = torchao_layers(lin, torchao_accum)
                except Exception as e:  # noqa: BLE001 - the rows say why the peer is missing
                    rows.append(dict(M=None, N=n, K=k, impl="torchao", ms=None,
                                     error=f"{type(e).__name__}: {e}"[:300]))
            if with_compiled:   # one compile per module: M is dynamic, the weight shape static
                compiled = {name + "-compiled": torch.compile(mod, dynamic=True) for name, mod in peers.items()}
            if with_fp8now_compiled:
                compiled.update({f"fp8now-{s.value}-compiled": torch.compile(layers[f"fp8now-{s.value}"],
                                                                             dynamic=True) for s in Scheme})
        for m in m_values:
            x = varied(m, k, seed=m + k, device=dev)
            if with_graphs:
                for impl, (key, call) in graph_calls(x, blockwise and m % 4 == 0).items():
                    measure(m, n, k, impl, lambda: timer.ms(copies[key], call), {"copies": timer.copies})
            if not with_eager:
                continue
            # (fp8now pads M to a multiple of 4 for cuBLAS blockwise; the bare call needs it as given)
            for impl, call in eager_calls(x, lin, layers, blockwise and m % 4 == 0).items():
                measure(m, n, k, impl, lambda: l2_flushed_ms(call, warmup_ms, rep_ms))
            for impl, mod in list(layers.items()) + list(peers.items()) + list(compiled.items()):
                extra = {"backend": mod.backend} if impl in layers else {}

                def timed(mod=mod, extra=extra):
                    with torch.no_grad():
                        mod(x)
                        if with_kernels and m >= 1024:
                            extra["kernels"] = kernels_of(lambda: mod(x))
                        return l2_flushed_ms(lambda: mod(x), warmup_ms, rep_ms)
                measure(m, n, k, impl, timed, extra)
        del layers, peers, compiled, copies
        torch.cuda.empty_cache()
        record.write(out_path, info, rows)   # after every shape: a run cut short keeps what it measured
        print(f"  {n}x{k} done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """Speed-up over bf16 per (shape, M): graph rows against bf16-graph, host-launched rows against bf16."""
    seen = {r["impl"] for r in rows if r["ms"] is not None}
    impls = [i for i in ("scaled_mm", "fp8now-tensor", "fp8now-channel", "fp8now-block", "torchao-row",
                         "torchao-row-compiled", "torchao-row-f32acc-compiled", "torchao-block-compiled",
                         "fp8now-channel-compiled", "fp8now-tensor-graph", "fp8now-channel-graph",
                         "fp8now-block-graph", "scaled_mm-graph") if i in seen]
    ms = {(r["M"], r["N"], r["K"], r["impl"]): r["ms"] for r in rows if r["ms"] is not None}
    keys = sorted({(m, n, k) for m, n, k, _ in ms}, key=lambda t: (t[1], t[2], t[0]))
    lines = [f"{'M':>6} {'N':>6} {'K':>6} {'bf16 ms':>8} " + " ".join(f"{i[:14]:>14}" for i in impls)]
    for m, n, k in keys:
        cells = []
        for i in impls:
            base = ms.get((m, n, k, "bf16-graph" if i.endswith("-graph") else "bf16"))
            t = ms.get((m, n, k, i))
            cells.append(f"{base / t:14.2f}" if base and t else f"{'-':>14}")
        bf = ms.get((m, n, k, "bf16"), ms.get((m, n, k, "bf16-graph"), float("nan")))
        lines.append(f"{m:>6} {n:>6} {k:>6} {bf:8.4f} " + " ".join(cells))
    failed = [r for r in rows if "error" in r]
    lines += [f"failed: {r['impl']} M={r['M']} {r['N']}x{r['K']}: {r['error'][:120]}" for r in failed]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default results/linear_h200.json (results/decode_h200.json "
                                                "with --decode)")
    ap.add_argument("--decode", action="store_true", help="M = 1, 2, 4, 8, 16, GPU-time (graph) rows only")
    ap.add_argument("--quick", action="store_true", help="two shapes, four M values")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--fp8now-compiled", action="store_true",
                    help="also time fp8now's layers under torch.compile (rows fp8now-<scheme>-compiled)")
    ap.add_argument("--torchao-accum", default="fast", choices=sorted(TORCHAO_ACCUM),
                    help="torchao's GEMM accumulation: its default fast, float32, or both sets of peers")
    ap.add_argument("--shapes", default="", help="subset, e.g. 4096x4096,28672x4096 (N x K)")
    ap.add_argument("--m-values", default="", help="subset of M, e.g. 1024,4096,16384")
    ap.add_argument("--rep-ms", type=int, default=25, help="do_bench time per measurement")
    ap.add_argument("--add", action="store_true", help="keep the other shapes' rows of --out (same commit "
                    "and GPU): a grid split over several calls")
    ap.add_argument("--kernels", action="store_true",
                    help="record each eager row's CUDA kernels (torch.profiler, M >= 1024)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear.py needs a CUDA GPU")
    out = args.out or os.path.join(RESULTS, "decode_h200.json" if args.decode else "linear_h200.json")
    kw: dict = dict(m_values=DECODE_M, with_eager=False) if args.decode else {}
    if args.quick:
        kw.update(m_values=[1, 16, 1024, 16384], shapes=[(4096, 4096), (28672, 4096)])
    if args.shapes:   # one shape with torchao compiled takes ~3 min on the H200: split long runs
        kw["shapes"] = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    if args.m_values:
        kw["m_values"] = [int(v) for v in args.m_values.split(",")]
    rows = run(out, with_torchao=not args.no_torchao, rep_ms=args.rep_ms, with_kernels=args.kernels,
               torchao_accum=args.torchao_accum, with_fp8now_compiled=args.fp8now_compiled, add=args.add, **kw)
    print(summary(rows))


if __name__ == "__main__":
    main()
