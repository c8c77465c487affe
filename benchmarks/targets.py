"""Issue 4's targets scored from benchmark results, each row beside the floor its bytes and FLOPs allow.

    python3 benchmarks/targets.py LINEAR.json [LINEAR.json ...] [--quant QUANT.json] [--json OUT.json] [--all]

LINEAR files are `bench_linear.py` results (rows M, N, K, impl, ms; `-graph` impls are GPU time in CUDA
graphs, the others eager calls); `probe_kernels.py decodex` results (GPU time under `graph`) are read
as the graph rows they are. A file's eager rows form one set and its graph rows another, and every
ratio is taken inside one set (one run); where several files hold a row, the last one named wins and
the row names its file. Only the issue's grid (bench_linear's SHAPES x M_VALUES) is scored unless
--all. QUANT is a `bench_quant.py` result. Prints one markdown table per target and timing, misses first.

How a miss is explained (METHOD.md of the device tool: count the bytes and FLOPs first):
- `floor` is the least time the FP8 call can take as fp8now builds it. M >= 1024: a quantizer pass
  (read the bf16 activation, write FP8 + scales) then the GEMM (read FP8 activation and weight, write
  bf16 output), each the larger of its bytes over HBM and its FLOPs over the FP8 tensor-core rate.
  M <= 16: one kernel that only streams its operands, with the fixed cost every launch pays.
- `bound` is the same run's bf16 time over that floor: the best speed-up the design allows. A target
  above the bound is out of reach by arithmetic; below it, the row says how far the call is from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from bench_linear import M_VALUES, SHAPES

# H200 ceilings, the fastest measured through the device tool (BENCHMARKS.md); floors take the top of
# each measured range, so no floor is above what the GPU was seen to do.
HBM_BYTES_PER_S = 4.27e12    # device-to-device copy, bytes read + written
FP8_FLOPS_PER_S = 1.28e15    # cuBLAS `_scaled_mm` tensorwise, large shapes (1.20-1.28e15 measured)
# A Triton kernel that only reads a buffer, in a CUDA graph (results/floor_h200_2026-12-04_run7_5ea2ca3,
# `stream-flat-8x`, 8 buffers of 4.2-470 MB): each took at least STREAM_FIXED_S + bytes / STREAM_BYTES_PER_S.
STREAM_FIXED_S = 2.9e-6
STREAM_BYTES_PER_S = 4.36e12
QUANT_MIN_BYTES = 256e6      # quantizer rows below this are launch-bound and not scored

SCHEMES = ("tensor", "channel", "block")
PEER = {"tensor": "torchao-tensor", "channel": "torchao-row", "block": "torchao-block"}
BARE = {"tensor": "scaled_mm", "channel": "scaled_mm", "block": "scaled_mm-blockwise"}  # cuBLAS, pre-quantized
TARGET_LARGE = {"tensor": (1.6, 0.93), "channel": (1.6, 0.93), "block": (1.4, None)}  # x bf16, of bare GEMM
TIMINGS = {"-graph": "GPU time", "": "eager"}   # impl suffix -> what the time is
# probe_kernels.py decodex impl names -> bench_linear.py graph-row names
DECODEX_IMPLS = {"bf16": "bf16-graph", **{f"{s}-shipped": f"fp8now-{s}-graph" for s in SCHEMES}}

Sets = list[tuple[str, dict[str, float]]]       # (file stem, impl -> seconds), oldest first


def act_scales(m: int, k: int, scheme: str) -> int:
    """Activation scales of one call: one per token, or per 1x128 group for block (SPEC §3)."""
    return m * (math.ceil(k / 128) if scheme == "block" else 1)


def scale_bytes(m: int, n: int, k: int, scheme: str) -> int:
    """float32 weight + activation scale bytes of one call."""
    weight = {"tensor": 1, "channel": n, "block": math.ceil(n / 128) * math.ceil(k / 128)}[scheme]
    return 4 * (weight + act_scales(m, k, scheme))


def quant_s(m: int, k: int, scheme: str) -> float:
    """Least time of the activation quantizer pass: read bf16 [M, K], write FP8 [M, K] and its scales."""
    return (3 * m * k + 4 * act_scales(m, k, scheme)) / HBM_BYTES_PER_S


def gemm_s(m: int, n: int, k: int, scheme: str) -> float:
    """Least time of the FP8 GEMM on quantized operands: bytes (x_q, w_q, scales, bf16 y) or MMA work."""
    nbytes = m * k + n * k + 2 * m * n + scale_bytes(m, n, k, scheme)
    return max(nbytes / HBM_BYTES_PER_S, 2 * m * n * k / FP8_FLOPS_PER_S)


def stream_s(m: int, n: int, k: int, scheme: str) -> float:
    """Least time of one kernel that reads bf16 x, FP8 w and the scales and writes bf16 y, and no more."""
    nbytes = 2 * m * k + n * k + 2 * m * n + scale_bytes(m, n, k, scheme)
    return STREAM_FIXED_S + nbytes / STREAM_BYTES_PER_S


def read_rows(path: str, keys: tuple[str, ...]) -> list[dict]:
    """A results file's rows; a clear error naming the file when it is not a list of such rows."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"targets.py: cannot read {path}: {e}") from None
    bad = next((r for r in rows if not isinstance(r, dict) or not all(k in r for k in keys)), None) \
        if isinstance(rows, list) else rows
    if bad is not None:
        raise SystemExit(f"targets.py: {path} is not a list of result rows with {', '.join(keys)}: "
                         f"found {str(bad)[:120]}; pass bench_linear.py / probe_kernels.py decodex / "
                         f"bench_quant.py results")
    return rows


def load(paths: list[str], grid_only: bool = True) -> dict[tuple[int, int, int], Sets]:
    """(M, N, K) -> the row sets measured for it, oldest first: per file, its eager and its graph rows;
    with `grid_only`, just the issue's shapes and M values."""
    runs: dict[tuple[int, int, int], Sets] = {}
    for path in paths:
        stem = os.path.basename(path).removesuffix(".json")
        rows = read_rows(path, ("M", "N", "K", "impl"))
        found: dict[tuple[int, int, int, bool], dict[str, float]] = {}
        for r in rows:
            if grid_only and (r["M"] not in M_VALUES or (r["N"], r["K"]) not in SHAPES):
                continue
            if "ms" in r:
                impl, ms = r["impl"], r["ms"]
            elif "graph" in r and r["impl"] in DECODEX_IMPLS:
                impl, ms = DECODEX_IMPLS[r["impl"]], r["graph"]
            else:
                continue
            found.setdefault((r["M"], r["N"], r["K"], impl.endswith("-graph")), {})[impl] = ms * 1e-3
        for (m, n, k, _), impls in found.items():
            runs.setdefault((m, n, k), []).append((stem, impls))
    return runs


def pick(sets: Sets, *need: str) -> tuple[str, dict[str, float]] | None:
    """The newest row set holding every impl in `need` (a name ending in '*' matches by prefix)."""
    def has(t: dict[str, float], name: str) -> bool:
        return any(i.startswith(name[:-1]) for i in t) if name.endswith("*") else name in t
    return next(((stem, t) for stem, t in reversed(sets) if all(has(t, n) for n in need)), None)


def us(s: float) -> str:
    return f"{s * 1e6:.1f}"


def score_large(runs: dict[tuple[int, int, int], Sets], out: list[dict]) -> None:
    """M >= 1024: channel / tensor >= 1.6x bf16 and >= 0.93 of bare `_scaled_mm`; block >= 1.4x bf16.
    Each scheme is set beside its bare cuBLAS GEMM on pre-quantized inputs where the run timed it."""
    for (m, n, k), sets in sorted(runs.items()):
        for s in SCHEMES:
            for sfx, timing in TIMINGS.items():
                need, bare = ("bf16" + sfx, f"fp8now-{s}{sfx}"), BARE[s] + sfx
                got = m >= 1024 and (pick(sets, *need, bare) or pick(sets, *need))
                if not got:
                    continue
                src, t = got
                bf16, fp8 = t["bf16" + sfx], t[f"fp8now-{s}{sfx}"]
                q, g = quant_s(m, k, s), gemm_s(m, n, k, s)
                want, of_bare = TARGET_LARGE[s]
                row = dict(target=f"{s}, M >= 1024", timing=timing, M=m, N=n, K=k, src=src, bf16_us=bf16 * 1e6,
                           us=fp8 * 1e6, x=bf16 / fp8, floor_us=(q + g) * 1e6, bound=bf16 / (q + g),
                           want=f">= {want}x bf16" + (f", >= {of_bare} of {BARE[s]}" if of_bare else ""))
                why = []
                if row["bound"] < want:
                    why.append(f"bytes/FLOPs allow {row['bound']:.2f}x")
                if bare in t:
                    mm = t[bare]
                    row["of_mm"], row["mm_cap"] = mm / fp8, mm / (mm + q)
                    if bf16 / mm < want:
                        why.append(f"bare {BARE[s]} itself {bf16 / mm:.2f}x")
                    if of_bare and row["mm_cap"] < of_bare:
                        why.append(f"a quantizer pass at HBM speed leaves {row['mm_cap']:.2f} of {BARE[s]}")
                row["met"] = row["x"] >= want and (not of_bare or row.get("of_mm", 1.0) >= of_bare)
                if not row["met"] and not why:
                    why.append(f"{us(fp8 - q - g)} µs above the floor")
                row["why"] = "" if row["met"] else "; ".join(why)
                out.append(row)


def score_decode(runs: dict[tuple[int, int, int], Sets], out: list[dict]) -> None:
    """M <= 16: every scheme >= 1.4x bf16. An eager miss points to the GPU time of the same call."""
    graph_rows: dict[tuple[str, int, int, int], dict] = {}
    for (m, n, k), sets in sorted(runs.items()):
        for s in SCHEMES:
            for sfx, timing in TIMINGS.items():
                got = m <= 16 and pick(sets, "bf16" + sfx, f"fp8now-{s}{sfx}")
                if not got:
                    continue
                src, t = got
                bf16, fp8 = t["bf16" + sfx], t[f"fp8now-{s}{sfx}"]
                floor = stream_s(m, n, k, s)
                row = dict(target=f"{s}, M <= 16", timing=timing, M=m, N=n, K=k, src=src, bf16_us=bf16 * 1e6,
                           us=fp8 * 1e6, x=bf16 / fp8, floor_us=floor * 1e6, bound=bf16 / floor,
                           want=">= 1.4x bf16", need_us=bf16 / 1.4 * 1e6)
                row["met"] = row["x"] >= 1.4
                if row["met"]:
                    row["why"] = ""
                elif row["bound"] < 1.4:
                    row["why"] = f"bytes allow {row['bound']:.2f}x: a bare stream of the operands takes {us(floor)} µs"
                else:
                    row["why"] = (f"needs <= {row['need_us']:.1f} µs, only {row['need_us'] - floor * 1e6:.1f} µs "
                                  f"above a bare stream of its operands ({us(floor)} µs)")
                gpu = graph_rows.setdefault((s, m, n, k), row)    # TIMINGS puts the graph rows first
                if not row["met"] and gpu is not row:
                    row["why"] = (f"eager (host time included); the same call's GPU time: {gpu['us']:.1f} µs, "
                                  f"{gpu['x']:.2f}x bf16 ({gpu['src']})")
                out.append(row)


def score_peers(runs: dict[tuple[int, int, int], Sets], out: list[dict]) -> None:
    """Faster than torchao on every row: each scheme against its granularity's peers, eager and compiled."""
    for (m, n, k), sets in sorted(runs.items()):
        for s in SCHEMES:
            got = pick(sets, f"fp8now-{s}", PEER[s] + "*")
            if not got:
                continue
            src, t = got
            fp8 = t[f"fp8now-{s}"]
            peers = {i: v for i, v in t.items() if i.startswith(PEER[s])}
            best = min(peers, key=peers.get)
            row = dict(target=f"{s} vs torchao", timing="eager", M=m, N=n, K=k, src=src, us=fp8 * 1e6,
                       peer=best, peer_us=peers[best] * 1e6, x=peers[best] / fp8, want="faster than torchao")
            row["met"] = row["x"] > 1.0
            row["why"] = "" if row["met"] else f"{best} takes {row['x']:.2f} of fp8now's time"
            f32 = {i: v for i, v in peers.items() if "-f32acc" in i}
            if not row["met"] and f32 and "-f32acc" not in best:   # the best peer skips float32 promotion
                like = min(f32, key=f32.get)
                row["why"] += (f" (fast accumulation); with float32 accumulation, as SPEC §4 keeps, {like} "
                               f"takes {f32[like] / fp8:.2f}")
            out.append(row)


def score_quant(rows: list[dict], out: list[dict]) -> None:
    """Quantization kernels >= 3.0 TB/s effective (bytes read + written), on tensors of >= 256 MB."""
    for r in rows:
        if r["bytes"] < QUANT_MIN_BYTES:
            continue
        tbs = r["triton_gbps"] / 1e3
        row = dict(target="quantizers", timing="eager", op=f"{r['what']} {r['op']}",
                   shape=" x ".join(map(str, r["shape"])), tbs=tbs, want=">= 3.0 TB/s", met=tbs >= 3.0, why="")
        if r["op"] == "tensor":  # the global amax is needed before the first byte can be written
            row["why"] = f"reads its input twice (5 bytes moved per 3 counted): {HBM_BYTES_PER_S * 0.6e-12:.2f} TB/s at most"
        elif not row["met"]:
            row["why"] = f"{tbs * 1e12 / HBM_BYTES_PER_S:.0%} of a device copy"
        out.append(row)


def _shape(r: dict) -> str:
    return f"{r['N']} x {r['K']}"


COLUMNS = {  # scorer -> (header, cell) pairs of its table; met, why and file follow
    "large": [("N x K", _shape), ("M", lambda r: r["M"]), ("bf16 µs", lambda r: f"{r['bf16_us']:.1f}"),
              ("µs", lambda r: f"{r['us']:.1f}"), ("x bf16", lambda r: f"{r['x']:.2f}"),
              ("of bare GEMM", lambda r: f"{r['of_mm']:.2f}" if "of_mm" in r else "-"),
              ("floor µs", lambda r: f"{r['floor_us']:.1f}"), ("bound", lambda r: f"{r['bound']:.2f}x")],
    "decode": [("N x K", _shape), ("M", lambda r: r["M"]), ("bf16 µs", lambda r: f"{r['bf16_us']:.1f}"),
               ("µs", lambda r: f"{r['us']:.1f}"), ("x bf16", lambda r: f"{r['x']:.2f}"),
               ("floor µs", lambda r: f"{r['floor_us']:.1f}"), ("bound", lambda r: f"{r['bound']:.2f}x")],
    "peers": [("N x K", _shape), ("M", lambda r: r["M"]), ("µs", lambda r: f"{r['us']:.1f}"),
              ("best torchao", lambda r: r["peer"]), ("its µs", lambda r: f"{r['peer_us']:.1f}")],
    "quant": [("op", lambda r: r["op"]), ("shape", lambda r: r["shape"]), ("TB/s", lambda r: f"{r['tbs']:.2f}")],
}


def kind(row: dict) -> str:
    t = row["target"]
    return "quant" if t == "quantizers" else "peers" if "torchao" in t else "decode" if "<=" in t else "large"


def markdown(rows: list[dict]) -> str:
    """One table per (target, timing), misses first, with the met count in its heading."""
    parts = []
    for target, timing in dict.fromkeys((r["target"], r["timing"]) for r in rows):
        mine = sorted((r for r in rows if (r["target"], r["timing"]) == (target, timing)), key=lambda r: r["met"])
        cols = COLUMNS[kind(mine[0])] + [("met", lambda r: "yes" if r["met"] else "**no**"),
                                         ("why (misses)", lambda r: r["why"]), ("file", lambda r: r.get("src", ""))]
        met = sum(r["met"] for r in mine)
        parts += [f"### {target} ({timing}): {mine[0]['want']}; met on {met} of {len(mine)}", "",
                  "| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
        parts += ["| " + " | ".join(str(f(r)) for _, f in cols) + " |" for r in mine]
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("linear", nargs="*", help="bench_linear.py / probe_kernels.py decodex results, oldest first")
    ap.add_argument("--quant", help="a bench_quant.py result")
    ap.add_argument("--json", help="also write the scored rows here")
    ap.add_argument("--all", action="store_true", help="score every measured (M, N, K), not only the issue's grid")
    args = ap.parse_args(argv)
    if not args.linear and not args.quant:
        ap.error("name at least one results file")
    runs = load(args.linear, grid_only=not args.all)
    rows: list[dict] = []
    score_large(runs, rows)
    score_decode(runs, rows)
    score_peers(runs, rows)
    if args.quant:
        score_quant(read_rows(args.quant, ("what", "op", "shape", "bytes", "triton_gbps")), rows)
    print(markdown(rows))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
