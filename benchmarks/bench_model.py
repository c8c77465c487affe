"""Whole-model speed: a stack of Llama-3-8B-shaped decoder layers, bf16 against fp8now's schemes.

The per-layer tables (bench_linear.py) time one linear layer; a user runs a model. This script builds
`LlamaModel` from a config (Llama-3-8B dimensions, fewer layers, seeded random weights with rows of
varied magnitude; no download), makes one FP8 copy per scheme with `fp8now.quantize_`, and times the
decoder stack's forward (`inputs_embeds` in, last hidden state out: no embedding, no lm_head, no KV
cache) for decode-sized batches (B sequences of 1 token: every linear sees M = B) and prefill-sized
ones (1 or 4 sequences of T tokens), three ways:
- eager: the module called from Python (fp8now's own per-layer graphs replay the small calls);
- graph: the whole forward captured in one CUDA graph by the caller (GPU time, host removed), which
  is how small batches are served at speed;
- compiled (`--compile`): `torch.compile` of the whole stack (default mode "reduce-overhead", i.e. with
  inductor's CUDA graphs), then timed as called from Python.
With `--torchao`, torchao 0.18's float8 dynamic per-row model (`Float8DynamicActivationFloat8WeightConfig`)
runs the same ways, as the peer.

Every FP8 model is checked before it is timed: its graph replay gives the bytes of its eager call, and
its output against bf16 on fresh random inputs is reported (rel = |y - y_bf16| / |y_bf16|).

CUDA: `PYTHONPATH=src python benchmarks/bench_model.py [--layers 4] [--torchao] [--compile]`
(-> results/model_h200.json). CPU smoke run (tiny dims, eager only): `... --device cpu --preset tiny
--out FILE`. Rows: preset, layers, batch, seq, tokens, impl, mode, ms, rel; graph and compiled rows
also rel_to_eager; compiled rows enqueue_ms (the host time per call) and cudagraph_skips (how often
inductor ran a graph without CUDA graphs while compiling the case; the reasons go to stderr); with
`--profile` the GPU µs per kernel family of graph and compiled rows; `--host-profile` adds rows of
mode "host-profile" (each decode case) with call counts and the costliest Python functions of an
eager forward; a case that failed is a row with `error`. A table of speed-ups over bf16 (same mode,
same run) prints last.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch

import record
from bench_linear import TORCHAO_ACCUM
from timing import host_ms, kernels_of, l2_flushed_ms

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

PRESETS = {
    # Llama-3-8B: hidden 4096, 32 heads of 128 (8 key/value heads), MLP 14336
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8),
    # Llama-3-70B's layer: hidden 8192, 64 heads (8 key/value heads), MLP 28672
    "llama70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                     num_key_value_heads=8),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
}
DECODE_BATCHES = (1, 4, 16, 64)
PREFILL = ((1, 512), (1, 2048), (4, 2048))


def build(preset: str, layers: int, device: str) -> torch.nn.Module:
    """bf16 `LlamaModel` with seeded weights: N(0, 1/K) per matrix, each row scaled by exp(N(0, 0.5^2))."""
    from transformers import LlamaConfig, LlamaModel
    cfg = LlamaConfig(**PRESETS[preset], num_hidden_layers=layers, vocab_size=128,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaModel(cfg)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                rows = torch.exp(0.5 * torch.randn(p.shape[0], 1, generator=g))
                p.copy_(torch.randn(p.shape, generator=g) * rows / math.sqrt(p.shape[1]))
            else:  # norm weights around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    # Cast the parameters only: the RoPE inverse frequencies stay float32 (a whole-module .to would
    # cast them too, as loading in bf16 would not).
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64 (norms over all elements)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def bench_ms(fn, device: str, rep_ms: int) -> float:
    """L2-flushed median on the GPU; the CPU smoke run's wall-clock median."""
    return host_ms(fn) if device == "cpu" else l2_flushed_ms(fn, 5, rep_ms)


def enqueue_ms(fn, calls: int = 20) -> float:
    """Host ms per call of fn without waiting for the GPU: when it is close to the timed ms, the row
    measures the host (the compiled forward's guards and graph replay), not the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e3 * t / calls


def capture(fn):
    """fn() captured in one CUDA graph (after warm-up on a side stream); returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# Kernel families by name (torch.profiler's CUDA kernel names), first match wins.
KERNEL_KINDS = (
    ("quantizer", ("_quant_kernel", "_amax_kernel")),
    ("fp8now GEMM", ("_decode_kernel", "_rowwise_gemm_kernel", "_block_gemm_kernel", "_split_reduce_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("cuBLAS/CUTLASS GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90", "matmul", "cublas")),
)


def kernel_times(fn) -> dict:
    """GPU µs per call of fn, per kernel family and for the 8 longest kernels (torch.profiler)."""
    kinds: dict[str, float] = {}
    top = []
    for key, us in kernels_of(fn):
        low = key.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p.lower() in low for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us
        top.append((us, key))
    top.sort(reverse=True)
    return dict(kinds={k: round(v, 1) for k, v in kinds.items()},
                top=[dict(name=n, us=round(t, 1)) for t, n in top[:8]])


def torchao_model(model: torch.nn.Module, fast_accum: bool) -> torch.nn.Module:
    """torchao's float8 per-row copy. Its default on sm_90 is cuBLAS fast accumulation (the FP8 tensor
    cores' partial sums are not promoted to float32 along K); `fast_accum=False` accumulates in
    float32, as SPEC §4 asks of fp8now."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    from torchao.quantization.granularity import PerRow
    peer = copy.deepcopy(model)
    quantize_(peer, Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), mm_config=Float8MMConfig(use_fast_accum=fast_accum)))
    return peer


def case_input(batch: int, seq: int, hidden: int, device: str) -> torch.Tensor:
    """The seeded bf16 `inputs_embeds` [batch, seq, hidden] of one case (the same in every mode)."""
    g = torch.Generator(device="cpu").manual_seed(batch * 10007 + seq)
    return torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16)


def forward_of(model: torch.nn.Module, x: torch.Tensor):
    """The timed call: the decoder stack's last hidden state for `x`, without autograd or KV cache."""
    def call():
        with torch.no_grad():
            return model(inputs_embeds=x, use_cache=False).last_hidden_state
    return call


def run(args) -> list[dict]:
    import fp8now
    dev = args.device
    base = build(args.preset, args.layers, dev)
    models: dict[str, torch.nn.Module] = {}
    info = record.meta(args.device)
    rows: list[dict] = []
    for scheme in args.schemes.split(","):
        m = copy.deepcopy(base)
        fp8now.quantize_(m, fp8now.Fp8Config(scheme=scheme), measure_error=False)
        models[f"fp8now-{scheme}"] = m
    if args.torchao:
        try:
            for suffix, fast in TORCHAO_ACCUM[args.torchao_accum]:
                models["torchao-row" + suffix] = torchao_model(base, fast)
        except Exception as e:  # say why the peer is missing rather than dropping it silently
            rows.append(dict(preset=args.preset, layers=args.layers, impl="torchao",
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
    models = {"bf16": base, **models}
    sizes = {name: weight_bytes(m) for name, m in models.items()}
    cases = [(b, 1) for b in args.decode] + list(args.prefill)
    eager_out: dict[tuple, torch.Tensor] = {}  # for the compiled rows' check
    hidden = PRESETS[args.preset]["hidden_size"]
    def row_of(batch: int, seq: int, name: str, **fields) -> dict:
        return dict(preset=args.preset, layers=args.layers, batch=batch, seq=seq, tokens=batch * seq,
                    impl=name, weight_bytes=sizes[name], **fields)

    for batch, seq in cases:
        x = case_input(batch, seq, hidden, dev)
        outs: dict[str, torch.Tensor] = {}
        for name, model in models.items():
            call = forward_of(model, x)
            row = row_of(batch, seq, name)
            try:
                y = call().clone()
                outs[name] = eager_out[(name, batch, seq)] = y
                row_rel = None if name == "bf16" else rel(y, outs["bf16"])
                if args.compiled_only:
                    continue
                rows.append(dict(row, mode="eager", ms=bench_ms(call, dev, args.rep_ms), rel=row_rel))
                if dev != "cpu":
                    graph, y_graph = capture(call)
                    graph.replay()
                    same = bool(torch.equal(y_graph, y))
                    rows.append(dict(row, mode="graph", ms=bench_ms(graph.replay, dev, args.rep_ms),
                                     rel=row_rel, same_as_eager=same, rel_to_eager=rel(y_graph, y)))
                    if args.profile and (batch, seq) in (cases[0], cases[-1]):
                        rows[-1]["kernels"] = kernel_times(graph.replay)
                    del graph, y_graph
            except Exception as e:
                rows.append(dict(row, mode="eager", error=f"{type(e).__name__}: {str(e)[:300]}"))
        del outs, x
        if dev != "cpu":
            torch.cuda.empty_cache()
        print(f"  B={batch} T={seq} done", file=sys.stderr, flush=True)
        record.write(args.out, info, rows)
    if args.host_profile:
        for case in [c for c in cases if c[1] == 1] or cases[:1]:   # the decode cases
            rows.extend(row_of(*case, name, **fields) for name, fields in host_profile(models, case, hidden, args))
        record.write(args.out, info, rows)
    if args.compile and dev != "cpu":
        from torch._dynamo.utils import counters
        torch._logging.set_logs(cudagraphs=True)      # inductor says why it skips CUDA graphs (stderr)
        torch._dynamo.config.recompile_limit = 1024   # no model may fall back to eager
        torch._dynamo.config.accumulated_recompile_limit = 4096
        for name, model in models.items():
            torch._dynamo.reset()  # the models share transformers' forward code: count each on its own
            compiled = torch.compile(model, mode=args.compile_mode)
            for batch, seq in cases:
                call = forward_of(compiled, case_input(batch, seq, hidden, dev))
                try:
                    skips = counters["inductor"]["cudagraph_skips"]
                    for _ in range(3):  # reduce-overhead records its graph after warm-up calls
                        y = call().clone()
                    skips = counters["inductor"]["cudagraph_skips"] - skips
                    eager = eager_out.get((name, batch, seq))
                    bf16 = eager_out.get(("bf16", batch, seq))
                    rows.append(row_of(batch, seq, name, mode="compiled", ms=bench_ms(call, dev, args.rep_ms),
                                     rel=None if name == "bf16" or bf16 is None else rel(y, bf16),
                                     rel_to_eager=None if eager is None else rel(y, eager),
                                     enqueue_ms=enqueue_ms(call), cudagraph_skips=skips))
                    if args.profile and (batch, seq) in (cases[0], cases[-1]):
                        rows[-1]["kernels"] = kernel_times(call)
                except Exception as e:
                    rows.append(row_of(batch, seq, name, mode="compiled",
                                       error=f"{type(e).__name__}: {str(e)[:300]}"))
            record.write(args.out, info, rows)
    return rows


# Functions whose call counts say which path an eager FP8 call took (decode_graphs: replayed, captured,
# or plain).
COUNTED = (("fp8now/decode_graphs.py", "_replay"), ("fp8now/decode_graphs.py", "_capture"),
           ("fp8now/linear.py", "forward"))


def host_profile(models: dict, case: tuple[int, int], hidden: int, args,
                 calls: int = 20) -> list[tuple[str, dict]]:
    """(model name, row fields) of a cProfile of `calls` eager forwards per model at one (batch, seq)
    case: ms per forward (the wall time of the profiled calls, profiler overhead included), calls per
    forward of COUNTED, the 12 costliest functions."""
    import cProfile
    import pstats
    x = case_input(*case, hidden, args.device)
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    out = []
    for name, model in models.items():
        call = forward_of(model, x)
        for _ in range(3):   # compile the kernels and capture fp8now's graphs first
            call()
        sync()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            call()
        sync()
        prof.disable()
        ms = 1e3 * (time.perf_counter() - t0) / calls
        stats = pstats.Stats(prof).stats   # {(file, line, func): (primitive calls, calls, tottime, cumtime, callers)}
        counts = {f"{f}:{fn}": sum(v[1] for k, v in stats.items() if k[0].endswith(f) and k[2] == fn) / calls
                  for f, fn in COUNTED}
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
        out.append((name, dict(mode="host-profile", ms=ms, rel=None, calls_per_forward=counts,
                               top=[dict(fn=f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", calls=v[1] / calls,
                                         us=1e6 * v[2] / calls) for k, v in top])))
    return out


def summary(rows: list[dict]) -> str:
    """ms of bf16 and speed-up of every other impl over bf16, per (mode, batch, seq); then the failures."""
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    impls = sorted({r["impl"] for r in rows} - {"bf16"})
    base = {(r["mode"], r["batch"], r["seq"]): r["ms"] for r in rows
            if r["impl"] == "bf16" and r["mode"] != "host-profile"}
    got = {(r["mode"], r["batch"], r["seq"], r["impl"]): r for r in rows}
    lines = [f"{'mode':>8} {'B':>4} {'T':>5} {'bf16 ms':>8} " + " ".join(f"{i[:15]:>15}" for i in impls)
             + "   max rel vs bf16"]
    for (mode, b, t), ms in sorted(base.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        cells, rels = [], []
        for i in impls:
            r = got.get((mode, b, t, i))
            cells.append(f"{ms / r['ms']:14.2f}x" if r else f"{'-':>15}")
            if r and r.get("rel") is not None:
                rels.append(r["rel"])
        lines.append(f"{mode:>8} {b:>4} {t:>5} {ms:8.3f} " + " ".join(cells)
                     + (f"   {max(rels):.3f}" if rels else ""))
    for r in rows:
        if r["mode"] == "host-profile":
            lines.append(f"  {r['impl']:>15} B={r['batch']} T={r['seq']} host-profiled eager {r['ms']:8.3f} ms: "
                         + ", ".join(f"{k.rsplit(':', 1)[1]} {v:g}" for k, v in r["calls_per_forward"].items())
                         + " calls per forward")
    for r in rows:
        if "kernels" in r:
            lines.append(f"  {r['impl']:>15} B={r['batch']} T={r['seq']} graph {r['ms'] * 1e3:9.1f} us: "
                         + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["kernels"]["kinds"].items())))
    lines += [f"failed: {r['impl']} {r.get('mode', '')} B={r.get('batch')} T={r.get('seq')}: {r['error'][:150]}"
              for r in failed]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(RESULTS, "model_h200.json"))
    ap.add_argument("--preset", default="llama8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--schemes", default="tensor,channel,block")
    ap.add_argument("--decode", default=",".join(map(str, DECODE_BATCHES)),
                    help="batch sizes of one-token calls, e.g. 1,16")
    ap.add_argument("--prefill", default=",".join(f"{b}x{t}" for b, t in PREFILL),
                    help="BxT prefill calls, e.g. 1x2048,4x2048")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--torchao", action="store_true")
    ap.add_argument("--torchao-accum", default="fast", choices=sorted(TORCHAO_ACCUM),
                    help="torchao's GEMM accumulation: its default fast, float32 (f32), or both models")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compiled-only", action="store_true",
                    help="time compiled rows only (the eager call still runs once, for the checks)")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    help="torch.compile mode of the compiled rows (reduce-overhead: inductor's CUDA graphs)")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile of eager forwards at each decode case: which path each FP8 call took")
    ap.add_argument("--profile", action="store_true",
                    help="GPU time per kernel family of the graph replay, first and last case")
    args = ap.parse_args()
    args.decode = [int(v) for v in args.decode.split(",") if v]
    args.prefill = [tuple(int(v) for v in p.split("x")) for p in args.prefill.split(",") if p]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA GPU (or --device cpu --preset tiny for a smoke run)")
    rows = run(args)
    print(summary(rows))


if __name__ == "__main__":
    main()
