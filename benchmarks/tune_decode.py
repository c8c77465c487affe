"""Tune the decode path (M <= 16: Triton quantizer + Triton GEMM with split-K) on the H200, in one call.

1. For every (N, K) of the linear benchmark and M in {1, 16}: each configuration of a small grid of
   `rowwise_gemm` (channel) and `block_gemm` (block), the quantizer included, checked against a float64
   product of the same FP8 operands, then timed in CUDA graphs (8 weight copies per graph, so the
   weights stream from HBM, no host launch overhead), next to bf16 `F.linear` in graphs.
2. Where the Triton GEMMs stop paying: at M in {16, 32, 64}, Triton (auto split) vs cuBLAS
   (`_scaled_mm` rowwise / blockwise), in graphs and eager.

CUDA only. `PYTHONPATH=src:benchmarks python benchmarks/tune_decode.py --out DIR [--budget-s 330]`
Writes DIR/tune_decode.json (all rows, written as it goes) and prints the best configs last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from bench_decode import rel
from bench_linear import SHAPES, bench, graph_ms, varied

COPIES = 8


def grid():
    """Configs in the order they are tried (likely winners first, in case the budget runs out)."""
    out = []
    for split, bn, (warps, stages) in itertools.product((0, 1, 2, 4, 8), (32, 64, 16), ((4, 4), (4, 3))):
        out.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=warps,
                        num_stages=stages, SPLIT_K=split))
    return out


def exact(x_q, x_s, w_q, w_s, scheme):
    """float64 product of the dequantized FP8 operands (exact for these K)."""
    n, k = w_q.shape
    if scheme == "block":
        xs = x_s.double().repeat_interleave(128, dim=1)[:, :k]
        ws = w_s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        xs, ws = x_s.double(), w_s.double()
    return (x_q.double() * xs) @ (w_q.double() * ws).t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    from fp8now.kernels import torch_mm, triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import quantize_weight

    t_start = time.time()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: list[dict] = []
    path = os.path.join(args.out, "tune_decode.json")

    def add(**r):
        rows.append(r)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    def left():
        return args.budget_s - (time.time() - t_start)

    best: dict[tuple[str, int, int, int], tuple[float, dict]] = {}
    for n, k in shapes:
        if left() < 30:
            print(f"budget spent before {n}x{k}", file=sys.stderr)
            break
        w = varied(n, k, seed=n + 3 * k, device="cuda")
        lin_copies = [w.clone() for _ in range(COPIES)]
        quant = {s: quantize_weight(w, s) for s in ("channel", "block")}
        wq = {s: [(q.clone(), sc.clone()) for _ in range(COPIES)] for s, (q, sc) in quant.items()}
        qfn = {"channel": tq.quantize_act_token, "block": tq.quantize_act_group}
        gfn = {"channel": tg.rowwise_gemm, "block": tg.block_gemm}
        for m in (1, 16):
            x = varied(m, k, seed=m + n, device="cuda")
            bf = graph_ms(lambda i: (lambda: torch.nn.functional.linear(x, lin_copies[i])), COPIES, 5, 20)
            add(kind="bf16-graph", M=m, N=n, K=k, ms=bf)
            for scheme in ("channel", "block"):
                x_q, x_s = qfn[scheme](x)
                ref = exact(x_q, x_s, *quant[scheme], scheme)
                for cfg in grid():
                    if left() < 20:
                        break
                    try:
                        err = rel(gfn[scheme](x_q, x_s, *quant[scheme], out_dtype=torch.float32, config=cfg), ref)
                        ms = graph_ms(lambda i: (lambda: gfn[scheme](*qfn[scheme](x), *wq[scheme][i], config=cfg)),
                                      COPIES, 5, 20)
                    except Exception as e:  # e.g. out of shared memory: record, try the next
                        add(kind=scheme, M=m, N=n, K=k, cfg=cfg, fail=f"{type(e).__name__}: {e}"[:200])
                        continue
                    add(kind=scheme, M=m, N=n, K=k, cfg=cfg, ms=ms, err=err, x_bf16=bf / ms)
                    key = (scheme, m, n, k)
                    if err < 1e-5 and (key not in best or ms < best[key][0]):
                        best[key] = (ms, cfg)
        # 2. crossover Triton (auto split) vs cuBLAS, M = 16, 32, 64 (graphs and eager)
        for m in (16, 32, 64):
            if left() < 15:
                break
            x = varied(m, k, seed=m + n, device="cuda")
            calls = {
                "triton-channel": lambda i: (lambda: tg.rowwise_gemm(*tq.quantize_act_token(x), *wq["channel"][i])),
                "cublas-channel": lambda i: (lambda: torch_mm.rowwise_mm(*tq.quantize_act_token(x),
                                                                        *wq["channel"][i], None, torch.bfloat16)),
                "triton-block": lambda i: (lambda: tg.block_gemm(*tq.quantize_act_group(x), *wq["block"][i])),
            }
            if torch_mm.blockwise_unfit(k) is None:
                calls["cublas-block"] = lambda i: (lambda: torch_mm.blockwise_mm(
                    *tq.quantize_act_group(x, col_major=True), *wq["block"][i], None, torch.bfloat16))
            add(kind="cross-bf16-graph", M=m, N=n, K=k,
                ms=graph_ms(lambda i: (lambda: torch.nn.functional.linear(x, lin_copies[i])), COPIES, 5, 20))
            add(kind="cross-bf16-eager", M=m, N=n, K=k, ms=bench(lambda: torch.nn.functional.linear(x, w), 5, 20))
            for name, make in calls.items():
                try:
                    add(kind=f"cross-{name}-graph", M=m, N=n, K=k, ms=graph_ms(make, COPIES, 5, 20))
                    add(kind=f"cross-{name}-eager", M=m, N=n, K=k, ms=bench(make(0), 5, 20))
                except Exception as e:
                    add(kind=f"cross-{name}", M=m, N=n, K=k, fail=f"{type(e).__name__}: {e}"[:200])
        del lin_copies, wq, quant
        torch.cuda.empty_cache()
        print(f"{n}x{k} done at {time.time() - t_start:.0f}s", file=sys.stderr, flush=True)

    for r in rows:
        if r["kind"].startswith("cross-") and r.get("ms"):
            print(f"{r['kind']:28} M={r['M']:<6} {r['N']}x{r['K']}: {1e3 * r['ms']:9.1f} us")

    print(f"{'scheme':8} {'M':>3} {'N':>6} {'K':>6} {'bf16 us':>8} {'best us':>8} {'x bf16':>7}  config")
    bf = {(r["M"], r["N"], r["K"]): r["ms"] for r in rows if r["kind"] == "bf16-graph"}
    for (scheme, m, n, k), (ms, cfg) in sorted(best.items(), key=lambda t: (t[0][0], t[0][2], t[0][3], t[0][1])):
        c = {key: v for key, v in cfg.items() if key not in ("BLOCK_M", "BLOCK_K", "GROUP_M")}
        print(f"{scheme:8} {m:>3} {n:>6} {k:>6} {1e3 * bf[(m, n, k)]:8.1f} {1e3 * ms:8.1f} "
              f"{bf[(m, n, k)] / ms:7.2f}  {c}")
    for scheme in ("channel", "block"):
        errs = [r["err"] for r in rows if r["kind"] == scheme and "err" in r]
        bad = [r for r in rows if r["kind"] == scheme and r.get("err", 0) >= 1e-5]
        print(f"{scheme}: {len(errs)} configs timed, max rel err vs float64 {max(errs, default=0):.2e}, "
              f"{len(bad)} above 1e-5" + (f" e.g. {bad[0]['cfg']} {bad[0]['err']:.1e}" if bad else ""))


if __name__ == "__main__":
    main()
