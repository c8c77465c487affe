"""Probe (issue 38, Llama-3.1-8B decode at B = 64): the Triton rowwise GEMM's tile, stage and split-K choices at
decode-batch M on the model's linear shapes, and the one-launch decode kernel (`triton_decode`, its K splits
reduced in the kernel by the ticket) on the same pre-quantized rows, against the plan's own config, cuBLAS
`_scaled_mm` rowwise on the same FP8 operands, and bf16 `F.linear`. GPU time from one CUDA graph over separate
weight copies (the same count for every variant of a shape: `timing.GraphTimer`); every output is checked against
the float64 product of the same FP8 operands (SPEC §4: rel_diff < 1e-4, NaN never passes). The GEMM alone: the
activation is quantized beforehand.

    PYTHONPATH=src python benchmarks/probe_rowwise.py --out /tmp/out/probe_rowwise_h200.json
    ... --smoke   # Triton's interpreter on the CPU: one tiny shape, two configs, no timing (checks the script)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import record
from timing import GraphTimer, copies_for

# Llama-3.1-8B's linears (N, K): q and o, k and v, gate and up, down
SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))
GRID = dict(BLOCK_N=(32, 64, 128), BLOCK_K=(128, 256), num_stages=(3, 5), SPLIT_K=(1, 2, 4, 0))
SMOKE_GRID = dict(BLOCK_N=(32,), BLOCK_K=(128,), num_stages=(2,), SPLIT_K=(1, 2))


def configs(grid: dict, m: int) -> list[dict]:
    """Every combination of `grid`, with one row-tile covering M (BLOCK_M = M rounded up to 16..64)."""
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    keys = list(grid)
    return [dict(BLOCK_M=block_m, GROUP_M=1, num_warps=4, **dict(zip(keys, values)))
            for values in itertools.product(*(grid[k] for k in keys))]


def run(args) -> list[dict]:
    from fp8now.kernels.triton_decode import decode_linear, ticket_counters
    from fp8now.kernels.triton_rowwise import rowwise_gemm
    from fp8now.numerics import quantize_activation, quantize_weight, rel_diff

    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = ((64, 256),) if args.smoke else SHAPES
    grid = SMOKE_GRID if args.smoke else GRID
    rows: list[dict] = []
    for (n, k), m in itertools.product(shapes, args.m):
        g = torch.Generator(device=dev).manual_seed(n + k + m)
        w = torch.randn(n, k, generator=g, device=dev) * k ** -0.5
        x = torch.randn(m, k, generator=g, device=dev)
        w_q, w_s = quantize_weight(w, "channel")
        x_q, x_s = quantize_activation(x, "token")
        ref = (x_q.double() @ w_q.double().T) * x_s.double().reshape(-1, 1) * w_s.double().reshape(1, -1)
        copies = 1 if args.smoke else copies_for(n * k)
        fp8 = [w_q.clone() for _ in range(copies)]
        bf16 = [w.to(torch.bfloat16) for _ in range(copies)] if not args.smoke else []
        timer = None if args.smoke else GraphTimer(copies, rep_ms=args.rep_ms)
        x_bf16, xs_col, ws_row = x.to(torch.bfloat16), x_s.reshape(-1, 1), w_s.reshape(1, -1)
        variants = {"plan": lambda wq: rowwise_gemm(x_q, x_s, wq, w_s)}
        if not args.smoke:
            variants["cublas"] = lambda wq: torch._scaled_mm(x_q, wq.t(), xs_col, ws_row, out_dtype=torch.bfloat16)
        counters = ticket_counters(n, dev)
        for cfg in configs(grid, m):
            label = " ".join(f"{key}={v}" for key, v in cfg.items())
            variants[f"rowwise {label}"] = lambda wq, cfg=cfg: rowwise_gemm(x_q, x_s, wq, w_s, config=cfg)
            if cfg["BLOCK_K"] == 128:   # the decode kernel: its K splits meet by the ticket, no second launch
                variants[f"decode {label}"] = lambda wq, cfg=cfg: decode_linear(
                    x_q, wq, w_s, "channel", "token", x_scale=x_s, counters=counters, out_dtype=torch.bfloat16,
                    config=cfg)
        base = dict(n=n, k=k, m=m, copies=copies, fp8_weight_bytes=n * k)
        if timer is not None:
            bf16_ms = timer.ms(bf16, lambda wb: torch.nn.functional.linear(x_bf16, wb))
            rows.append(dict(base, variant="bf16", ms=bf16_ms, rel_diff=None))
        for label, call in variants.items():
            try:
                y = call(fp8[0])
                diff = rel_diff(y, ref)
                ms = timer.ms(fp8, call) if timer is not None else None
            except Exception as e:   # a config past the GPU's shared memory: recorded, the others go on
                rows.append(dict(base, variant=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            rows.append(dict(base, variant=label, ms=ms, rel_diff=diff))
            if not diff < 1e-4:   # NaN included
                rows[-1]["error"] = f"rel_diff {diff:.2e} >= 1e-4"
        if args.out:
            record.write(args.out, record.meta("cpu" if args.smoke else "cuda"), rows)
        if timer is not None:
            del fp8, bf16
            torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> str:
    """Per shape and M: bf16, cuBLAS, the plan and the best config (µs, and the FP8 weight's read rate)."""
    out = [f"{'N x K':>12} {'M':>4} {'bf16':>7} {'cublas':>7} {'plan':>7} {'best':>7} {'TB/s':>5}  best config"]
    for key in sorted({(r["n"], r["k"], r["m"]) for r in rows}):
        mine = {r["variant"]: r for r in rows if (r["n"], r["k"], r["m"]) == key and r.get("ms") is not None
                and "error" not in r}
        tried = {v: r for v, r in mine.items() if v not in ("bf16", "cublas", "plan")}
        if not tried:
            continue
        best = min(tried, key=lambda v: tried[v]["ms"])
        us = {v: f"{mine[v]['ms'] * 1e3:7.1f}" if v in mine else f"{'-':>7}" for v in ("bf16", "cublas", "plan")}
        rate = key[0] * key[1] / (tried[best]["ms"] * 1e-3) / 1e12
        out.append(f"{key[0]:>5} x {key[1]:<5} {key[2]:>4} {us['bf16']} {us['cublas']} {us['plan']} "
                   f"{tried[best]['ms'] * 1e3:7.1f} {rate:5.2f}  {best}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results file ({meta, rows})")
    ap.add_argument("--m", default="64", help="rows per call, comma-separated (default 64)")
    ap.add_argument("--rep-ms", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke run (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    args.m = [int(v) for v in args.m.split(",") if v]
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: --smoke runs the script in Triton's interpreter")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = run(args)
    print(summary(rows) if not args.smoke else f"{len(rows)} rows, errors: {[r for r in rows if 'error' in r]}")


if __name__ == "__main__":
    main()
