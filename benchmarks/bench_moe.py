"""Time one MoE experts layer: transformers' experts module (each of its experts implementations), a plain
bf16 `torch._grouped_mm` implementation, and fp8now's `Fp8Experts` per scheme, all in one run.

Shapes: Qwen3-30B-A3B (E = 128, top-8, H = 2048, I = 768) and Mixtral-8x7B (E = 8, top-2, H = 4096,
I = 14336), at 1, 8, 64, 4096 and 16384 tokens. Routing comes from a random router: softmax over the
experts in float32, top-k, the k weights renormalised to sum to 1 (Qwen3's norm_topk_prob; Mixtral's
softmax over its top-k is the same thing), the same tokens and routing for every implementation.
Implementations (rows' `impl`):
- `bf16-transformers`: the family's experts module (Qwen3MoeExperts / MixtralExperts) taken from a model
  built from its config, with the experts implementation transformers gives that model by default (the
  row's `experts_implementation`); `bf16-transformers-<impl>`: each other implementation transformers offers;
- `bf16-grouped_mm`: ours, sort the (token, slot) pairs by expert, offsets, w13 grouped mm, silu(gate) * up,
  w2 grouped mm, unsort, weighted sum over the k slots in float32;
- `fp8now-<scheme>`: `fp8now.Fp8Experts` loaded with `load_` from the same bf16 weights, called through its
  public forward (whatever backend its "auto" picks; the row's `backend`).
Before timing, each output is compared with transformers' default's output (rel = |y - y_ref| / |y_ref|); an
implementation off by more than REL_MAX, or one that raises, is a row with `error` instead of a time.
Timing (GPU): `ms` is GPU time per call from one CUDA graph of `copies` calls, each on its own copy of the
weights (timing.GraphTimer; the same copies for every implementation of a shape, sized so the copies fit
--mem-gb); `host_ms` the host-launched call with L2 flushed (timing.l2_flushed_ms). Floors: the FP8 weight
bytes the routing touches (experts hit x their w13 and w2) and their time at the GPU's HBM rate (`hbm_tbps`).

CUDA: `PYTHONPATH=src python benchmarks/bench_moe.py [--shapes mixtral-8x7b --add] [--tokens 1,8]`
(-> results/moe_h200.json; `--add` keeps its rows of the other shapes). CPU smoke run (tiny shapes,
wall time, no graphs): `... --device cpu --out FILE`. The layers themselves: moe_layers.py.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # an implementation that needs a Hub kernel fails as a row, not a hang

import torch  # noqa: E402

import record  # noqa: E402
from moe_layers import family_experts, implementations, materialized, other_implementations, randn, route  # noqa: E402
from timing import GraphTimer, copies_for, host_ms, l2_flushed_ms  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# HBM rate of the floors, TB/s: the fastest device copy measured on each GPU (H200 4.27, H100 ~3.0); others (the CPU
# smoke runs) the H200's
HBM_TBPS = {"h100": 3.0, "h200": 4.27}
REL_MAX = {"bf16": 0.02, "fp8": 0.1}   # loose: a broken kernel is off by ~1, FP8 rounding by a few %
TOKENS = (1, 8, 64, 4096, 16384)
SCHEMES = ("tensor", "channel", "block")
# name -> (transformers family, experts E, top-k, hidden H, expert intermediate I)
SHAPES = {"qwen3-30b-a3b": ("qwen3_moe", 128, 8, 2048, 768), "mixtral-8x7b": ("mixtral", 8, 2, 4096, 14336)}
CPU_SHAPES = {"qwen3-tiny": ("qwen3_moe", 16, 4, 64, 32), "mixtral-tiny": ("mixtral", 4, 2, 128, 96)}


def hbm_tbps(device: str) -> float:
    """The floors' HBM rate on `device`'s GPU (HBM_TBPS by `record.gpu_tag`, else the H200's)."""
    return HBM_TBPS.get(record.gpu_tag(device), HBM_TBPS["h200"])


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    """|y - ref| / |ref| over all elements (bench_model.py's measure, here in float32)."""
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def touched_fp8_bytes(index: torch.Tensor, h: int, i: int) -> tuple[int, int]:
    """(experts hit, FP8 weight bytes of their w13 and w2: one byte per weight; scales left out)."""
    hit = int(index.unique().numel())
    return hit, hit * 3 * h * i


def floor_ms(fp8_bytes: int, rate_tbps: float) -> float:
    """Milliseconds to read `fp8_bytes` once at `rate_tbps` (the rows' byte floor)."""
    return fp8_bytes / (rate_tbps * 1e12) * 1e3


def weight_copies(wanted: int, bf16_bytes: int, fp8_bytes: int, schemes: int, mem_gb: float) -> int:
    """`wanted` copies, fewer if a bf16 and `schemes` FP8 copies each would not fit `mem_gb`; at least 2."""
    per_copy = bf16_bytes + schemes * fp8_bytes
    fit = int(mem_gb * 1e9 // per_copy)
    if fit < 2:
        raise SystemExit(f"two weight copies need {2 * per_copy / 1e9:.1f} GB, more than --mem-gb {mem_gb}")
    return min(wanted, fit)


def added_to(path: str, info: dict, shapes: list[str]) -> tuple[dict, list[dict]]:
    """(meta, rows) continuing `path` over several calls: its rows of other shapes, which must come from
    the same commit and GPU (speed-ups are only taken within one shape and token count)."""
    old, rows = record.read(path)
    if (old["commit"], old["gpu"]) != (info["commit"], info["gpu"]):
        raise SystemExit(f"{path} was measured at {old['commit']} on {old['gpu']}, this run is {info['commit']} "
                         f"on {info['gpu']}: run without --add")
    return dict(info, command=f"{old['command']} ; {info['command']}"), [r for r in rows if r["shape"] not in shapes]


def measure(row: dict, copies: list, call, case: tuple, ref: torch.Tensor, timer: GraphTimer | None,
            rep_ms: int) -> None:
    """Fill `row`: rel to `ref`, then (if within REL_MAX) `ms` (graph; CPU: wall) and `host_ms`; or `error`."""
    try:
        with torch.no_grad():
            y = call(copies[0], *case)
            if row["impl"].startswith("fp8now"):
                row["backend"] = copies[0].backend
            row["rel"] = rel(y, ref)
            kind = "fp8" if row["impl"].startswith("fp8now") else "bf16"
            if not row["rel"] <= REL_MAX[kind]:
                raise ValueError(f"output off the bf16 reference: rel {row['rel']:.3g} > {REL_MAX[kind]}")
            if timer is None:
                row["ms"] = host_ms(lambda: call(copies[0], *case))
                return
            row["host_ms"] = l2_flushed_ms(lambda: call(copies[0], *case), rep_ms=rep_ms)
            try:
                row["ms"] = timer.ms(copies, lambda c: call(c, *case))
            except Exception as err:  # noqa: BLE001 - e.g. a host sync inside the capture
                row["graph_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a failing implementation is a row, not a crash
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        if timer is not None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def run(args) -> list[dict]:
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    table = SHAPES if gpu else CPU_SHAPES
    rate = hbm_tbps(args.device)
    info, rows = record.meta(args.device), []
    if args.add:
        info, rows = added_to(args.out, info, args.shapes or list(table))
    for shape in args.shapes or list(table):
        if shape not in table:
            raise SystemExit(f"unknown shape {shape!r} on {dev.type}; known: {', '.join(table)}")
        family, e, k, h, i = table[shape]
        proto, default = family_experts(family, e, k, h, i)
        others = [] if args.no_other_impls else other_implementations(default)
        g = torch.Generator(device=dev).manual_seed(e * 7 + h)
        bf16_bytes, fp8_bytes = 2 * 3 * e * h * i, 3 * e * h * i
        hit_least = touched_fp8_bytes(torch.arange(min(k, e)), h, i)[1]   # T = 1: k experts
        n = weight_copies(copies_for(hit_least), bf16_bytes, fp8_bytes, len(args.schemes), args.mem_gb) if gpu else 1
        print(f"{shape}: {n} weight copies x ({bf16_bytes / 1e9:.2f} GB bf16 + {len(args.schemes)} x "
              f"{fp8_bytes / 1e9:.2f} GB FP8) = {n * (bf16_bytes + len(args.schemes) * fp8_bytes) / 1e9:.1f} GB "
              f"(--mem-gb {args.mem_gb}); transformers' default experts implementation: {default}", file=sys.stderr)
        w13, w2 = randn((e, 2 * i, h), g, h ** -0.5), randn((e, h, i), g, i ** -0.5)
        experts = [materialized(proto, w13.clone(), w2.clone()) for _ in range(n)]   # the same values, apart
        del w13, w2
        router = randn((e, h), g, h ** -0.5)
        impls = {name: v for name, v in implementations(experts, others, args.schemes).items()
                 if not args.impls or any(name.startswith(p) for p in args.impls)}
        timer = GraphTimer(n, rep_ms=args.rep_ms) if gpu else None
        for tokens in args.tokens:
            x = randn((tokens, h), g, 1.0)
            index, weights = route(x, router, k)
            hit, touched = touched_fp8_bytes(index, h, i)
            with torch.no_grad():
                ref = experts[0](x, index, weights)   # transformers' default implementation
            for name, (copies, call) in impls.items():
                row = dict(shape=shape, tokens=tokens, impl=name, ms=None, host_ms=None, rel=None, experts_hit=hit,
                           fp8_bytes=touched, floor_ms=floor_ms(touched, rate), hbm_tbps=rate, copies=n)
                if name == "bf16-transformers":
                    row["experts_implementation"] = default
                rows.append(row)
                if callable(copies):   # built once per shape, on first use
                    try:
                        copies = copies()
                    except Exception as err:  # noqa: BLE001 - e.g. a scheme the experts refuse
                        copies = err
                    impls[name] = (copies, call)
                if isinstance(copies, Exception):
                    row["error"] = f"{type(copies).__name__}: {str(copies)[:300]}"
                    continue
                measure(row, copies, call, (x, index, weights), ref, timer, args.rep_ms)
            if args.out:
                record.write(args.out, info, rows)   # after every case: a run cut short keeps what it measured
        del experts, impls
        if gpu:
            torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], key: str = "ms") -> str:
    """Speed-up over the faster of bf16-transformers and bf16-grouped_mm, per (shape, tokens), by `key`."""
    impls = list(dict.fromkeys(r["impl"] for r in rows if r.get(key) is not None))
    cases = list(dict.fromkeys((r["shape"], r["tokens"]) for r in rows))
    t = {(r["shape"], r["tokens"], r["impl"]): r[key] for r in rows if r.get(key) is not None}
    first = {(r["shape"], r["tokens"]): r for r in rows}
    short = [i.replace("bf16-transformers", "tf") for i in impls]   # tf: transformers' experts module
    head = f"{'shape':>14} {'tokens':>6} {'base ' + key:>12} {'FP8 MB':>8} {'floor us':>8} "
    lines = [f"speed-up over the faster of bf16-transformers (tf) and bf16-grouped_mm, by {key}:",
             head + " ".join(f"{i:>{len(i)}}" for i in short)]
    for s, tok in cases:
        bases = [t[s, tok, b] for b in ("bf16-transformers", "bf16-grouped_mm") if (s, tok, b) in t]
        base = min(bases) if bases else None
        c = first[s, tok]
        cells = [f"{base / t[s, tok, i]:>{len(n)}.2f}" if base and (s, tok, i) in t else f"{'-':>{len(n)}}"
                 for i, n in zip(impls, short)]
        lines.append(f"{s:>14} {tok:>6} {base if base else float('nan'):12.4f} {c['fp8_bytes'] / 1e6:8.1f} "
                     f"{c['floor_ms'] * 1e3:8.1f} " + " ".join(cells))
    lines += [f"failed: {r['shape']} T={r['tokens']} {r['impl']}: {r['error'][:150]}" for r in rows if "error" in r]
    lines += [f"no graph: {r['shape']} T={r['tokens']} {r['impl']}: {r['graph_error'][:150]}"
              for r in rows if "graph_error" in r and key == "ms"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes: a smoke run)")
    ap.add_argument("--out", default=None, help="results file (default on cuda: results/moe_h200.json)")
    ap.add_argument("--shapes", default="", help=f"subset, e.g. mixtral-8x7b (GPU: {', '.join(SHAPES)}; "
                                                 f"CPU: {', '.join(CPU_SHAPES)})")
    ap.add_argument("--tokens", default="", help="subset of tokens per call, e.g. 1,8,64 (default: 1,8,64,4096,16384;"
                                                 " CPU: 1,8,64)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="fp8now schemes (default: all three)")
    ap.add_argument("--impls", default="", help="only implementations whose names start with these, e.g. "
                                                "bf16-grouped_mm,fp8now-channel")
    ap.add_argument("--no-other-impls", action="store_true", help="only transformers' default implementation")
    ap.add_argument("--mem-gb", type=float, default=100.0, help="GPU memory the weight copies may take (default 100)")
    ap.add_argument("--rep-ms", type=int, default=25, help="timing time per measurement (default 25)")
    ap.add_argument("--add", action="store_true", help="keep the other shapes' rows of --out (same commit and GPU): "
                                                       "one shape per call")
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --device cpu for the smoke run")
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.tokens = [int(v) for v in args.tokens.split(",") if v] or (list(TOKENS) if gpu else [1, 8, 64])
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.impls = [s for s in args.impls.split(",") if s]
    args.out = args.out or (os.path.join(RESULTS, "moe_h200.json") if gpu else None)
    rows = run(args)
    print(summary(rows, "ms"))
    if gpu:
        print(summary(rows, "host_ms"))


if __name__ == "__main__":
    main()
