"""Probe (issue 38): the per-token SiLU*up -> FP8 kernel (`triton_silu_mul._silu_mul_token_kernel`) took 40.9 ms of
Llama-3.1-8B's 302.5 ms prefill at 8x2048 on an H100 (1.28 ms per layer for 1.18 GB: 0.92 TB/s). Times its launch
variants (whole row per program with 8/16/32 warps; two passes over 1-4K-column chunks) on Llama's and Qwen3's
shapes, each checked bit for bit against the default launch's q and s. Usage: python benchmarks/probe_silu.py OUT.json"""
import json
import sys

import torch

from fp8now.kernels import triton_silu_mul as S
from fp8now.numerics import E4M3FN

VARIANTS = [(True, 0, 8), (True, 0, 16), (True, 0, 32), (False, 1024, 4), (False, 2048, 4), (False, 2048, 8),
            (False, 4096, 8), (False, 4096, 16)]


def launch(gate, up, single, block, warps):
    m, i = gate.shape
    q = torch.empty((m, i), dtype=E4M3FN.dtype, device=gate.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=gate.device)
    S._silu_mul_token_kernel[(m,)](gate, up, q, s, i, gate.stride(0), up.stride(0), q.stride(0), FMAX=E4M3FN.fmax,
                                   FLOOR=E4M3FN.min_scale, BLOCK=block or S.pow2(i), SINGLE=single, num_warps=warps)
    return q, s


def timed(fn, reps=15):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    fn()
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def main():
    rows = []
    for m, i in [(16384, 14336), (2048, 14336), (16384, 6144), (2048, 768 * 8)]:
        gen = torch.Generator(device="cuda").manual_seed(m + i)
        gate = torch.randn((m, i), device="cuda", dtype=torch.bfloat16, generator=gen) * 3
        up = torch.randn((m, i), device="cuda", dtype=torch.bfloat16, generator=gen)
        ref_q, ref_s = S.silu_mul(gate, up, "token")
        floor_ms = (4 * m * i + m * i + 4 * m) / 3.0e12 * 1e3
        for single, block, warps in VARIANTS:
            if single and i > S._SINGLE_MAX:
                continue
            q, s = launch(gate, up, single, block, warps)
            same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s))
            ms = timed(lambda: launch(gate, up, single, block, warps))
            rows.append({"m": m, "i": i, "single": single, "block": block or S.pow2(i), "warps": warps, "ms": ms,
                         "tb_per_s": (5 * m * i) / ms / 1e9, "floor_ms_3tbs": floor_ms, "bit_equal": same})
            print(f"{m:6d} x {i:6d} single={single!s:5} block={block or S.pow2(i):6d} warps={warps:2d}: {ms:7.3f} ms "
                  f"({(5 * m * i) / ms / 1e9:5.2f} TB/s; floor {floor_ms:.3f}) equal={same}", flush=True)
        del gate, up
    json.dump({"rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
