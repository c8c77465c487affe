"""Where the decode kernel's fixed cost goes, and the M = 1 GEMV that replaced it for channel.

At 4096 x 4096, M = 1, the split-K decode kernel took 11.1-11.6 µs per call in a CUDA graph, of
which the FP8 weight's 16.8 MB account for 3.9 µs at 4.27 TB/s (BENCHMARKS.md, "Decode kernel's
launch config swept"). This probe times, in CUDA graphs of 8 calls on 8 weight copies (weights from
HBM, not L2), at M = 1:
- floors: `empty-1` / `empty-grid`, a Triton kernel that does nothing on 1 program and on the decode
  kernel's grid; `stream-flat-Px`, the FP8 weight read as bytes in P contiguous chunks per SM and
  summed (any Triton kernel reading this weight); `stream-tile`, the weight read with the decode
  kernel's tiles and grid, no MMA, no split reduction; `quantizer-token` / `-group` alone;
- the layer as `triton_fp8.linear` dispatches it, per scheme, with `GEMV_N` off (`<scheme>-decode`:
  the decode kernel, cuBLAS tensorwise for tensor, the fused or split-K block paths) and on
  (`<scheme>-gemv`), after checking that both give the same output (SPEC's rel_diff < 1e-4; the runs
  of 2026-12-04 used the norm-relative error instead, < 1e-4 except tensor, whose cuBLAS path
  rounds its bf16 output differently: ~1e-3 in that norm, rel_diff ~5e-7);
- `decode-prequant` / `cublas-tensorwise-prequant`: the decode kernel and cuBLAS on the FP8 row;
- `gemv-BNxBK-wW`: `triton_gemv` on the FP8 row at 6 launch configs (each checked against the
  float64 product of its FP8 operands, float32 output, rel < 1e-5); `channel-gemv-nopdl`; and
  `block-gemv-BNxBK` (group quantizer + the GEMV as a programmatic dependent launch);
- `bf16`: `F.linear`.

`PYTHONPATH=src:benchmarks python benchmarks/probe_decode_floor.py` (CUDA; env FLOOR_SHAPES, an N x K
list; OUT, where floor.json goes). `--check` runs only the kernels' checks on tiny shapes (on CPU
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import triton
import triton.language as tl

from bench_decode import rel
from bench_linear import graph_ms, varied
from tune_decode import exact

SHAPES = [(1024, 4096), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (57344, 8192),
          (8192, 28672)]
COPIES = 8
ACT = {"tensor": "token", "channel": "token", "block": "group"}
GEMVS = [(16, 512, 4), (8, 1024, 4), (4, 1024, 4), (8, 512, 2), (32, 256, 4), (16, 1024, 8)]


@triton.jit
def _empty_kernel(out_ptr):
    if tl.program_id(0) + tl.program_id(1) == 0:
        tl.store(out_ptr, 1)


@triton.jit
def _stream_flat_kernel(w_ptr, out_ptr, numel, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """out[pid] = sum of the bytes [pid * CHUNK, (pid + 1) * CHUNK) of w (as uint8)."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        idx = start + i + offs
        acc += tl.load(w_ptr + idx, mask=idx < numel, other=0).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _stream_tile_kernel(w_ptr, out_ptr, N, K, K_SPLIT, stride_wn, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """The decode kernel's weight loads ([BLOCK_K, BLOCK_N] tiles of its (tile, split) grid), summed."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        acc += tl.load(w_cols + kk[:, None], mask=(kk < k_end)[:, None] & (offs_n < N)[None, :],
                       other=0).to(tl.int32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, axis=1), axis=0))


def stream_flat(w: torch.Tensor, programs: int, out: torch.Tensor, block: int = 4096) -> torch.Tensor:
    flat = w.view(torch.uint8).reshape(-1)
    chunk = triton.cdiv(triton.cdiv(flat.numel(), programs), block) * block
    grid = triton.cdiv(flat.numel(), chunk)
    _stream_flat_kernel[(grid,)](flat, out, flat.numel(), CHUNK=chunk, BLOCK=block, num_warps=4)
    return out[:grid]


def decode_grid(n: int, k: int, device) -> tuple[int, int, int]:
    """(column tiles, splits, K per split) of the shipped decode kernel at M = 1."""
    from fp8now.kernels import triton_decode as td
    k_split, splits, tiles = td._default_plan(1, n, k, torch.device(device))
    return tiles, splits, k_split


def stream_tile(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    tiles, splits, k_split = decode_grid(n, k, w.device)
    flat = w.view(torch.uint8)
    _stream_tile_kernel[(tiles, splits)](flat, out, n, k, k_split, flat.stride(0), BLOCK_N=64,
                                         BLOCK_K=128, num_warps=4, num_stages=4)
    return out[:tiles * splits]


def gemv(x_q, x_s, w_q, w_s, block_n, block_k, warps, out_dtype=torch.bfloat16):
    """The shipped GEMV (per token / per channel, pre-quantized row) at one launch config."""
    from fp8now.kernels import triton_gemv as tv
    return tv.gemv(x_q, w_q, w_s, "channel", x_scale=x_s, out_dtype=out_dtype,
                   config=dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps))


def operands(n: int, k: int, device: str, seed: int):
    """A varied bf16 row and weight (bench_linear.varied), quantized per token / per channel."""
    from fp8now.numerics import quantize_activation, quantize_weight
    x, w = varied(1, k, seed, device), varied(n, k, seed + 1, device)
    return (x, w, *quantize_activation(x, "token"), *quantize_weight(w, "channel"))


@contextlib.contextmanager
def gemv_table(table: dict | None):
    """triton_fp8.GEMV_N replaced by `table` (None: left as shipped; a scheme missing: never) inside the
    block, restored after."""
    from fp8now.kernels import triton_fp8 as tf
    saved = {k: dict(v) for k, v in tf.GEMV_N.items()}
    if table is not None:
        tf.GEMV_N.clear()
        tf.GEMV_N.update({s: dict(table.get(s, {})) for s in saved})
    try:
        yield
    finally:
        tf.GEMV_N.clear()
        tf.GEMV_N.update(saved)


def env_shapes(var: str, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(N, K) shapes from env `var` ("NxK,NxK,..."), else `default`."""
    if not os.environ.get(var):
        return default
    return [tuple(int(v) for v in s.split("x")) for s in os.environ[var].split(",")]


def recorder(path: str):
    """(rows, add): add(**row) appends a result row and rewrites `path` (a device call cut off keeps them)."""
    rows: list[dict] = []

    def add(**r):
        rows.append(r)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows, add


def weight_copies(w: torch.Tensor):
    """COPIES clones of the bf16 weight, of its FP8 form per scheme, and split-K counters (HBM, not L2)."""
    from fp8now.kernels import split_counters
    from fp8now.numerics import quantize_weight
    ws = [w.clone() for _ in range(COPIES)]
    wq = {sch: [tuple(t.clone() for t in quantize_weight(w, sch)) for _ in range(COPIES)]
          for sch in ("tensor", "channel", "block")}
    return ws, wq, [split_counters(w.shape[0], w.device) for _ in range(COPIES)]


def layer_calls(x: torch.Tensor, wq: dict, cnt: list):
    """layer(scheme, i): the triton backend's call on weight copy i, as Fp8Linear makes it."""
    from fp8now.config import Scheme
    from fp8now.kernels import triton_fp8 as tf
    return lambda sch, i: (lambda: tf.linear(x, *wq[sch][i], None, Scheme(sch), ACT[sch], counters=cnt[i]))


def timer(add, base: dict):
    """timed(impl, make, table): GPU µs per call of make(i)() (weight copy i) in graphs of COPIES calls,
    with triton_fp8.GEMV_N = `table` while capturing (gemv_table); a failing variant records why."""
    def timed(impl, make, table=None):
        try:
            with gemv_table(table):
                add(impl=impl, us=1e3 * graph_ms(make, COPIES, 5, 30), **base)
        except Exception as e:  # one variant failing must not cost the rest of the call
            add(impl=impl, fail=f"{type(e).__name__}: {e}"[:300], **base)
    return timed


def gemv_vs_decode(add, base: dict, layer, sch: str, on: dict) -> None:
    """Records SPEC's rel_diff between the layer with the GEMV table `on` and without the GEMV."""
    from fp8now.numerics import rel_diff
    outs = []
    for table in ({}, on):
        with gemv_table(table):
            outs.append(layer(sch, 0)().float())
    err = rel_diff(outs[1], outs[0])   # both bf16 outputs of the same FP8 operands
    add(impl=f"{sch}-gemv-vs-decode", rel_diff=err, ok=err < 1e-4, **base)


def check(n: int, k: int, device: str, seed: int) -> list[dict]:
    """Every GEMV config against the float64 product, the stream sums against torch's: failures raise."""
    _, _, x_q, x_s, w_q, w_s = operands(n, k, device, seed)
    ref = exact(x_q, x_s, w_q, w_s, "channel")
    rows = []
    for bn, bk, warps in GEMVS:
        err = rel(gemv(x_q, x_s, w_q, w_s, bn, bk, warps, torch.float32), ref)
        if not err < 1e-5:
            raise AssertionError(f"gemv {bn}x{bk} w{warps} at {n}x{k}: rel {err:.2e}")
        rows.append(dict(impl=f"gemv-{bn}x{bk}-w{warps}", N=n, K=k, err=err))
    total = int(w_q.view(torch.uint8).to(torch.int64).sum())
    out = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    for p in (3 + w_q.numel() // (1 << 22), 7 + w_q.numel() // (1 << 22)):   # chunks < 4 MB: no int32 overflow
        got = int(stream_flat(w_q, p, out, block=256).to(torch.int64).sum())
        if got != total:
            raise AssertionError(f"stream-flat-{p} at {n}x{k}: {got} != {total}")
    got = int(stream_tile(w_q, out).to(torch.int64).sum())
    if got != total:
        raise AssertionError(f"stream-tile at {n}x{k}: {got} != {total}")
    return rows


def main() -> None:
    from fp8now.kernels import triton_decode as td, triton_gemv as tv, triton_quant as tq

    def gemv_token(x, wq, pdl):
        q, s = tq.quantize_act_token(x, early_launch=pdl)
        return tv.gemv(q, *wq, "channel", x_scale=s, out_dtype=x.dtype, pdl=pdl)

    def gemv_group(x, wq, config):
        q, s = tq.quantize_act_group(x, early_launch=True)
        return tv.gemv(q, *wq, "block", x_scale=s, out_dtype=x.dtype, config=config, pdl=True)

    if "--check" in sys.argv:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for n, k in ((64, 256), (80, 384)):
            for r in check(n, k, device, seed=n + k):
                print(r)
        print("checks passed")
        return
    shapes = env_shapes("FLOOR_SHAPES", SHAPES)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, add = recorder(os.path.join(os.environ.get("OUT", "."), "floor.json"))

    for n, k in shapes:
        rows += check(n, k, "cuda", seed=n + k)
        x, w, x_q, x_s, w_q, w_s = operands(n, k, "cuda", seed=n + 3 * k)
        ws, wq, cnt = weight_copies(w)
        sink = [torch.zeros(1 << 16, dtype=torch.int32, device="cuda") for _ in range(COPIES)]
        tiles, splits, _ = decode_grid(n, k, "cuda")
        base = dict(N=n, K=k, M=1, weight_mb=n * k / 1e6)
        timed, layer = timer(add, base), layer_calls(x, wq, cnt)

        timed("bf16", lambda i: (lambda: torch.nn.functional.linear(x, ws[i])))
        # floors
        timed("empty-1", lambda i: (lambda: _empty_kernel[(1,)](sink[i])))
        timed("empty-grid", lambda i: (lambda: _empty_kernel[(tiles, splits)](sink[i])))
        for per_sm in (2, 4, 8):
            timed(f"stream-flat-{per_sm}x", lambda i, p=per_sm * sms: (
                lambda: stream_flat(wq["channel"][i][0], p, sink[i])))
        timed("stream-tile", lambda i: (lambda: stream_tile(wq["channel"][i][0], sink[i])))
        timed("quantizer-token", lambda i: (lambda: tq.quantize_act_token(x)))
        timed("quantizer-group", lambda i: (lambda: tq.quantize_act_group(x)))
        # the layer as dispatched: split-K decode paths (GEMV off) against the GEMV; first their outputs
        for sch in ("tensor", "channel", "block"):
            gemv_vs_decode(add, base, layer, sch, {sch: {1: (0, 1 << 62)}})
        for sch in ("tensor", "channel", "block"):
            timed(f"{sch}-decode", lambda i, sch=sch: layer(sch, i), {})
            timed(f"{sch}-gemv", lambda i, sch=sch: layer(sch, i), {sch: {1: (0, 1 << 62)}})
        timed("decode-prequant", lambda i: (lambda: td.decode_linear(
            x_q, *wq["channel"][i], "channel", "token", x_scale=x_s, counters=cnt[i], out_dtype=torch.bfloat16)))
        timed("cublas-tensorwise-prequant", lambda i: (lambda: torch._scaled_mm(
            x_q, wq["tensor"][i][0].t(), x_s.reshape(()), wq["tensor"][i][1].reshape(()), out_dtype=torch.bfloat16)))
        # GEMV variants: launch configs on the FP8 row; block quantizing in-kernel or fed by the quantizer
        for bn, bk, warps in GEMVS:
            timed(f"gemv-{bn}x{bk}-w{warps}", lambda i, c=(bn, bk, warps): (
                lambda: gemv(x_q, x_s, *wq["channel"][i], *c)))
        timed("channel-gemv-nopdl", lambda i: (lambda: gemv_token(x, wq["channel"][i], pdl=False)))
        for bn, bk in ((4, 1024), (8, 1024), (16, 512), (8, 512)):
            timed(f"block-gemv-{bn}x{bk}", lambda i, c=dict(BLOCK_N=bn, BLOCK_K=bk): (
                lambda: gemv_group(x, wq["block"][i], c)))
        del ws, wq, cnt
        torch.cuda.empty_cache()
        print(f"{n}x{k} done", file=sys.stderr, flush=True)

    print("\n== decode floor, M = 1: graph µs per call (8 weight copies); x = bf16 / this")
    bf = {(r["N"], r["K"]): r["us"] for r in rows if r.get("impl") == "bf16" and "us" in r}
    for r in rows:
        if "us" in r and r["impl"] != "bf16":
            b = bf.get((r["N"], r["K"]))
            print(f"{r['N']:>6} {r['K']:>6} {r['impl']:22} {r['us']:7.1f} {b / r['us'] if b else 0:5.2f}x "
                  f"{r['weight_mb'] / r['us']:5.2f} TB/s of FP8 weight")
        elif "ok" in r:
            verdict = "ok" if r["ok"] else "MISMATCH"
            print(f"{r['N']:>6} {r['K']:>6} {r['impl']:22} rel_diff {r['rel_diff']:.1e} {verdict}")
        elif "fail" in r:
            print(f"{r['N']:>6} {r['K']:>6} {r['impl']:22} FAILED {r['fail'][:100]}")
    for (n, k), us in bf.items():
        print(f"{n:>6} {k:>6} {'bf16':22} {us:7.1f}  {2 * n * k / 1e6 / us:5.2f} TB/s of bf16 weight")


if __name__ == "__main__":
    main()
