"""The GEMV at M = 1 to 4 against the split-K decode kernel, and its launch configs.

`triton_gemv` takes up to 4 rows (ROWS = the next power of two of M). The runs of 2026-12-04 at
392d13a also timed PREFETCH (the first weight chunk read before the programmatic-dependent wait,
the next one while the current is multiplied): slower on all 16 tensor and channel rows, block mixed;
removed. This probe decides the dispatch
table `triton_fp8.GEMV_N` and the launch configs `triton_gemv.GEMV_CONFIGS` from GPU time in
CUDA graphs of 8 calls on 8 weight copies (weights from HBM, not L2), per shape and M:
- `bf16`: `F.linear`;
- `<scheme>-decode`: the layer as `triton_fp8.linear` dispatches it with the GEMV off;
- `<scheme>-gemv`: the same call with the GEMV on for this M (shipped config), after checking that
  both give the same output (SPEC's rel_diff < 1e-4, row `<scheme>-gemv-vs-decode`);
- `channel-gemv-BNxBK-wW`: the channel layer with other launch configs for this M's ROWS (at M = 1
  also `block-gemv-BNxBK-wW`).

`PYTHONPATH=src:benchmarks python benchmarks/probe_gemv_rows.py` (CUDA; env ROWS_SHAPES, an N x K
list; ROWS_M, a list of M; OUT, where gemv_rows.json goes).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from bench_linear import varied
from probe_decode_floor import SHAPES, env_shapes, gemv_vs_decode, layer_calls, recorder, timer, weight_copies

M_VALUES = [1, 2, 3, 4]
CONFIGS = {1: [(4, 1024, 4), (8, 1024, 4), (8, 512, 4), (16, 512, 4), (4, 512, 4), (8, 2048, 4), (8, 256, 2)],
           2: [(4, 512, 4), (2, 1024, 4), (8, 512, 4), (4, 1024, 8)],
           4: [(4, 256, 4), (2, 512, 4), (4, 1024, 4), (8, 256, 4)]}


@contextlib.contextmanager
def gemv_config(rows: int, **override):
    """triton_gemv.GEMV_CONFIGS' tables for `rows` (both scale kinds) replaced by one config for every N,
    their catch-all row updated by `override`, inside the block; restored after."""
    from fp8now.kernels import triton_gemv as tv
    saved = {key: table for key, table in tv.GEMV_CONFIGS.items() if key[0] == rows}
    tv.GEMV_CONFIGS.update({key: [(None, dict(table[-1][1], **override))] for key, table in saved.items()})
    try:
        yield
    finally:
        tv.GEMV_CONFIGS.update(saved)


def main() -> None:
    from fp8now.kernels import triton_gemv as tv

    shapes, ms = env_shapes("ROWS_SHAPES", SHAPES), M_VALUES
    if os.environ.get("ROWS_M"):
        ms = [int(v) for v in os.environ["ROWS_M"].split(",")]
    rows, add = recorder(os.path.join(os.environ.get("OUT", "."), "gemv_rows.json"))

    for n, k in shapes:
        ws, wq, cnt = weight_copies(varied(n, k, n + k, "cuda"))
        for m in ms:
            x = varied(m, k, n + 3 * k + m, "cuda")
            bucket = tv.rows_bucket(m)
            on = {sch: {bucket: (0, 1 << 62)} for sch in ("tensor", "channel", "block")}
            base = dict(N=n, K=k, M=m, weight_mb=n * k / 1e6)
            timed, layer = timer(add, base), layer_calls(x, wq, cnt)

            timed("bf16", lambda i: (lambda: torch.nn.functional.linear(x, ws[i])))
            for sch in ("tensor", "channel", "block"):
                gemv_vs_decode(add, base, layer, sch, on)
                timed(f"{sch}-decode", lambda i, sch=sch: layer(sch, i), {})
                timed(f"{sch}-gemv", lambda i, sch=sch: layer(sch, i), on)
            for bn, bk, warps in CONFIGS.get(bucket, []):
                with gemv_config(bucket, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps):
                    for sch in ("channel", "block") if m == 1 else ("channel",):
                        timed(f"{sch}-gemv-{bn}x{bk}-w{warps}", lambda i, sch=sch: layer(sch, i), on)
        del ws, wq, cnt
        torch.cuda.empty_cache()
        print(f"{n}x{k} done", file=sys.stderr, flush=True)

    print("\n== GEMV rows: graph µs per call (8 weight copies); x = bf16 / this")
    bf = {(r["N"], r["K"], r["M"]): r["us"] for r in rows if r.get("impl") == "bf16" and "us" in r}
    for r in rows:
        key = (r["N"], r["K"], r["M"])
        if "us" in r and r["impl"] != "bf16":
            b = bf.get(key)
            print(f"{r['N']:>6} {r['K']:>6} {r['M']:>2} {r['impl']:26} {r['us']:7.1f} {b / r['us'] if b else 0:5.2f}x")
        elif "ok" in r:
            print(f"{r['N']:>6} {r['K']:>6} {r['M']:>2} {r['impl']:26} rel_diff {r['rel_diff']:.1e} "
                  f"{'ok' if r['ok'] else 'MISMATCH'}")
        elif "fail" in r:
            print(f"{r['N']:>6} {r['K']:>6} {r['M']:>2} {r['impl']:26} FAILED {r['fail'][:100]}")
    for (n, k, m), us in bf.items():
        print(f"{n:>6} {k:>6} {m:>2} {'bf16':26} {us:7.1f}")


if __name__ == "__main__":
    main()
