"""Decode (M <= 16) on the H200: the one-launch decode kernel against the previous three-launch path.

For the seven benchmark shapes and M in {1, 4, 16}, per scheme:
- `old`: the Triton quantizer, then the split-K Triton GEMM whose splits a second kernel reduces
  (the path `triton` took before `triton_decode`; 3 launches when K is split),
- `fused`: `triton_decode.decode_linear` quantizing inside the kernel (1 launch),
- `pre`: the Triton quantizer, then `decode_linear` on the FP8 rows (2 launches),
- `layer`: `Fp8Linear` with the shipped dispatch (whatever `triton_fp8.linear` picks),
each checked first against the float64 product of the `numerics` operands (rel err), then timed in CUDA
graphs (8 calls on 8 weight copies per graph: weights stream from HBM, no host overhead) and eagerly
(`do_bench` median, L2 flushed), next to bf16 `F.linear` timed the same two ways.

CUDA only. `PYTHONPATH=src:benchmarks python benchmarks/bench_decode.py --out DIR [--shapes NxK,...]`
Writes DIR/decode.json (rows written as they come) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench_linear import SHAPES, bench, graph_ms, varied

COPIES = 8
M_VALUES = (1, 4, 16)
SCHEMES = ("channel", "tensor", "block")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="")
    ap.add_argument("--rep-ms", type=int, default=20)
    args = ap.parse_args()
    from fp8now import Fp8Config, Fp8Linear, Scheme
    from fp8now.kernels import split_counters, triton_decode as td, triton_gemm as tg, triton_quant as tq
    from fp8now.numerics import dequantize, quantize_activation, quantize_weight

    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: list[dict] = []
    path = os.path.join(args.out, "decode.json")
    rep = args.rep_ms
    t0 = time.time()

    def add(**r):
        rows.append(r)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    groups = {"channel": ((1, -1), (1, -1)), "tensor": ((1, -1), (-1, -1)), "block": ((1, 128), (128, 128))}
    for n, k in shapes:
        w = varied(n, k, seed=n + 3 * k, device="cuda")
        w_copies = [w.clone() for _ in range(COPIES)]
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        quant = {s: quantize_weight(w, s) for s in SCHEMES}
        wq = {s: [(q.clone(), sc.clone()) for _ in range(COPIES)] for s, (q, sc) in quant.items()}
        cnt = [split_counters(n, "cuda") for _ in range(COPIES)]
        layers = {s: [Fp8Linear.from_linear(lin, Fp8Config(scheme=Scheme(s))) for _ in range(COPIES)]
                  for s in SCHEMES}
        for m in M_VALUES:
            x = varied(m, k, seed=m + n, device="cuda")
            add(impl="bf16", M=m, N=n, K=k,
                graph=graph_ms(lambda i: (lambda: torch.nn.functional.linear(x, w_copies[i])), COPIES, 5, rep),
                eager=bench(lambda: torch.nn.functional.linear(x, w), 5, rep))
            for s in SCHEMES:
                act = "group" if s == "block" else "token"
                x_q, x_s = quantize_activation(x, act)
                ag, wg = groups[s]
                ref = (dequantize(x_q, x_s, ag).double() @ dequantize(*quant[s], wg).double().T)
                qfn = tq.quantize_act_group if s == "block" else tq.quantize_act_token
                gemm = tg.block_gemm if s == "block" else tg.rowwise_gemm
                calls = {
                    "old": lambda i, out=torch.bfloat16: gemm(*qfn(x), *wq[s][i], out_dtype=out),
                    "fused": lambda i, out=torch.bfloat16: td.decode_linear(
                        x, *wq[s][i], s, act, counters=cnt[i], out_dtype=out),
                    "layer": lambda i, out=None: layers[s][i](x),
                }
                def pre(i, out=torch.bfloat16, s=s, act=act, qfn=qfn):
                    x_q8, x_s8 = qfn(x)
                    return td.decode_linear(x_q8, *wq[s][i], s, act, x_scale=x_s8, counters=cnt[i],
                                            out_dtype=out)
                calls["pre"] = pre
                for name, call in calls.items():
                    try:
                        y = call(0, torch.float32) if name != "layer" else call(0)
                        err = rel(y, ref)
                        g = graph_ms(lambda i, call=call: (lambda: call(i)), COPIES, 5, rep)
                        e = bench(lambda call=call: call(0), 5, rep)
                        add(impl=f"{s}-{name}", M=m, N=n, K=k, graph=g, eager=e, err=err)
                    except Exception as ex:  # record and go on
                        add(impl=f"{s}-{name}", M=m, N=n, K=k, fail=f"{type(ex).__name__}: {ex}"[:300])
        print(f"{n}x{k} done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        del w_copies, wq, layers, cnt
        torch.cuda.empty_cache()

    bf = {(r["M"], r["N"], r["K"]): r for r in rows if r["impl"] == "bf16"}
    print(f"{'impl':16} {'M':>3} {'N':>6} {'K':>6} {'graph us':>9} {'x bf16':>7} {'eager us':>9} {'x bf16':>7} "
          f"{'rel err':>8}")
    for r in rows:
        if r["impl"] == "bf16" or "fail" in r:
            if "fail" in r:
                print(f"{r['impl']:16} {r['M']:>3} {r['N']:>6} {r['K']:>6} FAILED {r['fail'][:80]}")
            continue
        b = bf[(r["M"], r["N"], r["K"])]
        print(f"{r['impl']:16} {r['M']:>3} {r['N']:>6} {r['K']:>6} {1e3 * r['graph']:9.1f} "
              f"{b['graph'] / r['graph']:7.2f} {1e3 * r['eager']:9.1f} {b['eager'] / r['eager']:7.2f} "
              f"{r['err']:8.1e}")
    errs = [r["err"] for r in rows if "err" in r]
    print(f"max rel err vs float64 over {len(errs)} rows: {max(errs, default=float('nan')):.2e}; "
          f"failures: {sum('fail' in r for r in rows)}")


if __name__ == "__main__":
    main()
