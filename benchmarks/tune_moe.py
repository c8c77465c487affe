"""The triton experts backend's paths against each other, one MoE layer, on the GPU: what the plan runs now,
what it ran before issue 38 (sorted path at every size, 4-warp 32x128 / 64x128 tiles, the torch alignment
above 4096 slots), and one change at a time between them (the sorted path on the direct path's tiles, and up to
DIRECT_TRIED slots the direct kernels on the sorted path's; the torch alignment and the other Triton one; 4 warps),
so each change of the plan has its own measured effect.

`ms`: GPU time from one CUDA graph over separate weight copies (timing.GraphTimer, as bench_moe.py);
`host_ms`: host-launched calls with L2 flushed (the eager prefill's case: the torch alignment is ~20
launches). Every variant's output is compared with the plan's (`same_bytes`; the sorted and direct paths
on the same tiles must agree bit for bit).

    PYTHONPATH=src python benchmarks/tune_moe.py --out /tmp/out/moe_tune_h200.json
    ... --device cpu   # smoke run: tiny shapes in Triton's interpreter, wall time, no graphs
    ... --tokens 4096,16384 --tiles 128x128x4x3,128x256x8x3   # other tiles of the sorted path, same rows
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

import record
from bench_moe import CPU_SHAPES, SHAPES, floor_ms, hbm_tbps, touched_fp8_bytes
from moe_layers import randn, route
from timing import GraphTimer, copies_for, host_ms, l2_flushed_ms

# The table before issue 38: no direct kernels, 4 warps on the 32x128 and 64x128 tiles, M-blocks launched first.
BEFORE_ROWS = ((16, 16, 64, 4, 4), (64, 32, 128, 4, 4), (256, 64, 128, 4, 4), (None, 128, 128, 8, 4))
DIRECT_TRIED = 512   # routed slots up to which the direct kernels are timed where the plan runs the sorted path
ONE_PROGRAM_TRIED = 16384   # routed slots up to which the one-program alignment is timed where the plan chunks


def variants(scheme: str, t: int, k: int, e: int, tiles: tuple = ()) -> dict:
    """label -> MoePath: the plan now, the plan before, and single changes between them; where the plan runs the
    sorted path, also each of `tiles` ((BLOCK_M, BLOCK_N, num_warps, num_stages)) in its place."""
    from fp8now.kernels.plan import MoeTable, moe_plan
    now = moe_plan(scheme, t, k, e)
    before = moe_plan(scheme, t, k, e, table=MoeTable(rows=BEFORE_ROWS, direct_max_tokens=0, a_reuse_bytes=0))
    before = dataclasses.replace(before, align="triton" if t * k <= 4096 else "torch")
    out = {"now": now, "before": before}
    if now.kernel == "direct":
        out["sorted, same tiles"] = dataclasses.replace(now, kernel="sorted", align="triton")
    else:
        out["align=torch"] = dataclasses.replace(now, align="torch")
        # the other Triton alignment: the one-program counting sort took 37 µs a call at 512 slots inside
        # Qwen3's B = 64 decode step on the H100 (08a04df's profile); the chunked one spreads it over programs
        other = {"triton": "triton-chunked", "triton-chunked": "triton"}.get(now.align)
        if other is not None and (other == "triton-chunked" or t * k <= ONE_PROGRAM_TRIED):
            out[f"align={other}"] = dataclasses.replace(now, align=other)
        if t * k <= DIRECT_TRIED:   # around the plan's direct bound (plan.MoeTable.direct_max_tokens)
            out["direct, same tiles"] = dataclasses.replace(now, kernel="direct", align="none")
    if now.num_warps != 4:
        out["4 warps"] = dataclasses.replace(now, num_warps=4)
    if now.kernel == "sorted":
        out["no A reuse"] = dataclasses.replace(now, a_reuse_bytes=0)   # M-blocks fastest, as before
        for mib in (4, 64):   # the plan's 16 MiB of A rows per group against a quarter and four times it
            out[f"A reuse {mib} MiB"] = dataclasses.replace(now, a_reuse_bytes=mib << 20)
        for bm, bn, warps, stages in tiles:
            out[f"tile {bm}x{bn} w{warps} s{stages}"] = dataclasses.replace(now, block_m=bm, block_n=bn,
                                                                           num_warps=warps, num_stages=stages)
    return out


def run(args) -> list[dict]:
    from fp8now import Fp8Config, Fp8Experts
    from fp8now.kernels.triton_moe import experts_forward
    from fp8now.layers.moe_triton import expert_gate, expert_weights

    rows, gpu, rate = [], args.device == "cuda", hbm_tbps(args.device)
    for shape in args.shapes:
        _, e, k, h, i = (SHAPES if gpu else CPU_SHAPES)[shape]
        g = torch.Generator(device=args.device).manual_seed(e * 7 + h)
        n = copies_for(touched_fp8_bytes(torch.arange(min(k, e)), h, i)[1]) if gpu else 1
        w13, w2 = randn((e, 2 * i, h), g, h ** -0.5), randn((e, h, i), g, i ** -0.5)
        router = randn((e, h), g, h ** -0.5)
        for scheme in args.schemes:
            layers = []
            for _ in range(n):
                m = Fp8Experts(e, h, i, Fp8Config(scheme=scheme, backend="triton"), act_fn=torch.nn.SiLU(),
                               device=args.device)
                m.load_(w13, w2)
                layers.append(m)
            timer = GraphTimer(n, rep_ms=args.rep_ms) if gpu else None
            for t in args.tokens:
                x = randn((t, h), g, 1.0)
                idx, wts = route(x, router, k)
                hit, touched = touched_fp8_bytes(idx, h, i)
                ref = None
                for label, path in variants(scheme, t, k, e, args.tiles).items():
                    call = lambda m, p=path: experts_forward(x, idx, wts, expert_weights(m), expert_gate(m), p,  # noqa: E731
                                                             m.workspace)
                    y = call(layers[0])
                    ref = y if ref is None else ref
                    eager = lambda: call(layers[0])  # noqa: E731
                    rows.append(dict(shape=shape, scheme=scheme, tokens=t, variant=label, path=path.name,
                                     same_bytes=bool(torch.equal(y, ref)),
                                     ms=timer.ms(layers, call) if gpu else host_ms(eager, reps=1),
                                     host_ms=l2_flushed_ms(eager, rep_ms=args.rep_ms) if gpu else None,
                                     experts_hit=hit, floor_ms=floor_ms(touched, rate), hbm_tbps=rate, copies=n))
                    r = rows[-1]
                    print(f"{shape} {scheme} T={t:>5} {label:>20}: {r['ms'] * 1e3:8.1f} us {'GPU' if gpu else 'wall'}, "
                          f"{(r['host_ms'] or 0) * 1e3:8.1f} us host-launched, floor {r['floor_ms'] * 1e3:6.1f} us, "
                          f"same bytes as now: {r['same_bytes']}  [{path.name}]", flush=True)
                if args.out:
                    record.write(args.out, record.meta(args.device), rows)
            del layers
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes: a smoke run)")
    ap.add_argument("--out", default=None, help="results file ({meta, rows})")
    ap.add_argument("--shapes", default="", help=f"GPU: {', '.join(SHAPES)}; CPU: {', '.join(CPU_SHAPES)} (default all)")
    ap.add_argument("--schemes", default="channel", help="fp8now schemes (default channel)")
    ap.add_argument("--tokens", default="1,2,4,8,64,2048,4096", help="tokens per call (default 1,2,4,8,64,2048,4096)")
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--tiles", default="", help="more sorted-path tiles to time where the plan sorts, as "
                    "BMxBNxWARPSxSTAGES, comma-separated (e.g. 128x128x4x3,128x256x8x3,64x128x4x4)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --device cpu for the smoke run")
    table = SHAPES if args.device == "cuda" else CPU_SHAPES
    args.shapes = [s for s in args.shapes.split(",") if s] or list(table)
    unknown = [s for s in args.shapes if s not in table]
    if unknown:
        sys.exit(f"unknown shapes {unknown} on {args.device}; known: {', '.join(table)}")
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.tokens = [int(v) for v in args.tokens.split(",") if v]
    args.tiles = tuple(tuple(int(v) for v in tile.split("x")) for tile in args.tiles.split(",") if tile)
    if any(len(tile) != 4 for tile in args.tiles):
        sys.exit("--tiles: each tile is BMxBNxWARPSxSTAGES, e.g. 128x128x4x3")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
