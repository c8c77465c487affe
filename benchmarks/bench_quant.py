"""Benchmark the Triton FP8 quantizers against eager torch (`fp8now.numerics`) on a CUDA GPU.

    PYTHONPATH=src python benchmarks/bench_quant.py [--out benchmarks/results/quant_h200.json] [--quick]

For every shape the Triton result is first checked byte for byte against the reference computed on
the CPU (the spec's arithmetic: true float32 division). Whether eager torch on the GPU gives the same
bytes is recorded too (`torch_cuda_equal`): torch's CUDA `tensor / python_float` multiplies by a
rounded reciprocal instead of dividing, so its scales can differ from the CPU's in the last bit.

Timing (timing.py): L2-flushed medians of host-launched calls. For activation shapes up to 16M
elements also the GPU time per call of 20 calls on one input captured in one CUDA graph (no launch
cost; the input stays in L2, as an activation just written by its producer does); the replayed output
is compared with the reference too, so this doubles as a graph-capture check.
Effective bandwidth = (bytes read + bytes written) / time = (numel * in_bytes + numel + scale bytes) / t.
The layers' quantizers only: per token and per 1x128 group for activations (the per-tensor activation
scale is the torch backend's), per tensor / channel / 128x128 block for weights.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import record
from timing import event_ms, l2_flushed_ms

try:
    import fp8now  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from fp8now import numerics  # noqa: E402

ACT_SHAPES = [(1, 4096), (16, 4096), (1024, 4096), (4096, 4096), (16384, 8192), (16384, 28672)]
WEIGHT_SHAPES = [(4096, 4096), (28672, 4096), (57344, 8192)]
ACT_KINDS = ("token", "group")
SCHEMES = ("tensor", "channel", "block")
GRAPH_MAX_NUMEL = 4096 * 4096
GRAPH_REPS = 20
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quant_h200.json")


def _make(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 test data with outliers: a x1e3 row, a x1e-3 row, a zero row (where there are rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    if rows >= 4:
        x[1] *= 1000
        x[2] *= 1e-3
        x[3] = 0
    return x


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal FP8 bytes and bit-equal scales (both moved to the CPU)."""
    qa, sa = (t.cpu() for t in a)
    qb, sb = (t.cpu() for t in b)
    return (qa.shape == qb.shape and sa.shape == sb.shape
            and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
            and torch.equal(sa.contiguous().view(torch.int32), sb.contiguous().view(torch.int32)))


def _bench(fn) -> float:
    """Median microseconds of host-launched calls of `fn`, L2 flushed before each."""
    return 1e3 * l2_flushed_ms(fn, warmup_ms=25, rep_ms=100)


def _bench_graph(fn, expect) -> tuple[float | str, bool | None]:
    """Capture GRAPH_REPS calls of `fn` in one CUDA graph, replay it; median microseconds per call
    (L2 not flushed: the decode-time situation) and whether the replayed output equals `expect`.
    A capture failure (e.g. a host sync in the wrapper) is returned as its error text."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fn() for _ in range(GRAPH_REPS)]
        graph.replay()
        torch.cuda.synchronize()
        ok = _same(outs[-1], expect)
        us = 1e3 * event_ms(graph.replay) / GRAPH_REPS
        del graph, outs
        return us, ok
    except Exception as e:  # noqa: BLE001 - a capture failure is a result worth recording
        return f"graph capture failed: {type(e).__name__}: {e}"[:300], None


def _row(**kw) -> dict:
    t_tr, t_th, nbytes = kw["triton_us"], kw.get("torch_us"), kw["bytes"]
    kw["triton_gbps"] = round(nbytes / (t_tr * 1e3), 1)
    if t_th is not None:
        kw["torch_gbps"] = round(nbytes / (t_th * 1e3), 1)
        kw["speedup_vs_torch"] = round(t_th / t_tr, 2)
    for k in ("triton_us", "torch_us", "triton_graph_us"):
        if isinstance(kw.get(k), float):
            kw[k] = round(kw[k], 2)
    return kw


def _print_row(r: dict) -> None:
    shape = "x".join(str(d) for d in r["shape"])
    graph = r.get("triton_graph_us")
    graph = f"{graph:9.1f}" if isinstance(graph, float) else f"{'-' if graph is None else 'FAIL':>9}"
    print(f"{r['what']:<7} {r['op']:<8} {shape:>12} {r['triton_us']:10.1f} {graph} "
          f"{r.get('torch_us', float('nan')):10.1f} {r.get('speedup_vs_torch', float('nan')):7.2f} "
          f"{r['triton_gbps']:9.1f} {r.get('torch_gbps', float('nan')):9.1f} "
          f"{'yes' if r['exact'] else 'NO':>5} {'yes' if r['torch_cuda_equal'] else 'no':>9}", flush=True)


def run(out_path: str = DEFAULT_OUT, quick: bool = False) -> list[dict]:
    """Verify, time and record every quantizer; returns the JSON rows (also written to `out_path`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_quant needs a CUDA GPU (the Triton quantizers do not run on the CPU "
                           "outside the interpreter)")
    from fp8now.kernels import triton_quant as tq   # the kernels themselves: no public API times them
    from fp8now.kernels import triton_wquant as twq

    reason = tq.available(torch.device("cuda"))
    if reason is not None:
        raise RuntimeError(f"Triton quantizers unavailable here: {reason}")
    info = record.meta()
    act_fns = {"token": tq.quantize_act_token, "group": tq.quantize_act_group}
    act_shapes = ACT_SHAPES[:3] if quick else ACT_SHAPES
    weight_shapes = WEIGHT_SHAPES[:1] if quick else WEIGHT_SHAPES
    rows: list[dict] = []
    print(f"{info['gpu']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}")
    print(f"{'what':<7} {'op':<8} {'shape':>12} {'triton_us':>10} {'graph_us':>9} {'torch_us':>10} "
          f"{'speedup':>7} {'tr_GB/s':>9} {'th_GB/s':>9} {'exact':>5} {'torch_gpu':>9}")

    for i, (M, K) in enumerate(act_shapes):
        x = _make(M, K, seed=i)
        x_cpu = x.cpu()
        for kind in ACT_KINDS:
            fn = act_fns[kind]
            t0 = time.perf_counter()
            ref = numerics.quantize_activation(x_cpu, kind)
            out = fn(x)
            exact = _same(out, ref)
            torch_cuda_equal = _same(numerics.quantize_activation(x, kind), ref)
            verify_s = time.perf_counter() - t0
            n_scales = {"token": M, "group": M * math.ceil(K / 128)}[kind]
            nbytes = M * K * x.element_size() + M * K + 4 * n_scales
            graph_us, graph_ok = _bench_graph(lambda: fn(x), ref) if M * K <= GRAPH_MAX_NUMEL else (None, None)
            r = _row(what="act", op=kind, shape=[M, K], dtype="bfloat16", bytes=nbytes,
                     triton_us=_bench(lambda: fn(x)), triton_graph_us=graph_us, graph_exact=graph_ok,
                     torch_us=_bench(lambda: numerics.quantize_activation(x, kind)),
                     exact=exact, torch_cuda_equal=torch_cuda_equal, verify_s=round(verify_s, 1))
            rows.append(r)
            _print_row(r)
            record.write(out_path, info, rows)
            del out, ref
        del x, x_cpu
        torch.cuda.empty_cache()

    for i, (N, K) in enumerate(weight_shapes):
        w = _make(N, K, seed=100 + i)
        w_cpu = w.cpu()
        for scheme in SCHEMES:
            t0 = time.perf_counter()
            ref = numerics.quantize_weight(w_cpu, scheme)
            out = twq.quantize_weight(w, scheme)
            exact = _same(out, ref)
            torch_cuda_equal = _same(numerics.quantize_weight(w, scheme), ref)
            verify_s = time.perf_counter() - t0
            n_scales = {"tensor": 1, "channel": N, "block": math.ceil(N / 128) * math.ceil(K / 128)}[scheme]
            nbytes = N * K * w.element_size() + N * K + 4 * n_scales
            r = _row(what="weight", op=scheme, shape=[N, K], dtype="bfloat16", bytes=nbytes,
                     triton_us=_bench(lambda: twq.quantize_weight(w, scheme)),
                     triton_graph_us=None,
                     torch_us=_bench(lambda: numerics.quantize_weight(w, scheme)),
                     exact=exact, torch_cuda_equal=torch_cuda_equal, verify_s=round(verify_s, 1))
            rows.append(r)
            _print_row(r)
            record.write(out_path, info, rows)
            del out, ref
        finite = bool(twq.weight_all_finite(w))
        t_fin = _bench(lambda: twq.weight_all_finite(w))
        r = _row(what="weight", op="finite", shape=[N, K], dtype="bfloat16", bytes=N * K * w.element_size(),
                 triton_us=t_fin, triton_graph_us=None, exact=finite, torch_cuda_equal=finite)
        rows.append(r)
        _print_row(r)
        record.write(out_path, info, rows)
        del w, w_cpu
        torch.cuda.empty_cache()

    bad = [f"{r['what']} {r['op']} {r['shape']}" for r in rows
           if not r["exact"] or r.get("graph_exact") is False]
    print(f"wrote {len(rows)} rows to {out_path}")
    if bad:
        print("NOT bit-exact vs the CPU reference (eagerly or in the graph): " + "; ".join(bad))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="only the three smallest activation shapes "
                        "and the smallest weight")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant: no CUDA GPU visible; this benchmark only runs on a GPU (e.g. the H200).",
              file=sys.stderr)
        return 2
    rows = run(args.out, quick=args.quick)
    return 0 if all(r["exact"] and r.get("graph_exact") is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
