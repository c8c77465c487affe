"""GPU check of the core (issue 2): the `torch` backend against `reference` on real LLM layer shapes,
and FP8 bytes produced on the GPU equal to those produced on the CPU for the same weights.

Run on the H200: `PYTHONPATH=src python benchmarks/check_core_gpu.py` (-> results/core_check_h200.json).
Prints a table last; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import record
from fp8now import Fp8Config, Fp8Linear, Scheme, rel_diff
from fp8now.kernels.reference import exact_matmul   # the float64 product of FP8 operands and scales
from fp8now.numerics import quantize_activation, quantize_weight

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (576, 7168), (6144, 4096)]
M_VALUES = [1, 16, 256]


def varied(rows: int, cols: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Magnitudes varying by powers of two across rows and 128-tiles (catches transposed scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= 2.0 ** torch.randint(-4, 5, (rows, 1), generator=g).float()
    tiles = 2.0 ** torch.randint(-4, 5, (1, math.ceil(cols / 128)), generator=g).float()
    x *= tiles.repeat_interleave(128, dim=1)[:, :cols]
    return (x * 0.02).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "core_check_h200.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    rows, failures = [], 0
    for n, k in SHAPES:
        w_cpu = varied(n, k, seed=n + k)
        w_gpu = w_cpu.to(dev)
        lin = torch.nn.Linear(k, n, bias=True, dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            lin.weight.copy_(w_gpu)
            lin.bias.copy_(torch.randn(n, device=dev))
        for scheme in Scheme:
            q_c, s_c = quantize_weight(w_cpu, scheme)
            q_g, s_g = quantize_weight(w_gpu, scheme)
            w_bytes_ok = same_bytes(q_c, q_g) and torch.equal(s_c, s_g.cpu())
            act = Fp8Config(scheme=scheme).act_kind()
            x_cpu = varied(256, k, seed=7 * k)
            a_qc, a_sc = quantize_activation(x_cpu, act)
            a_qg, a_sg = quantize_activation(x_cpu.to(dev), act)
            a_bytes_ok = same_bytes(a_qc, a_qg) and torch.equal(a_sc, a_sg.cpu())
            try:   # the torch backend refuses some shapes; the rows say why
                layer, why = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend="torch")), ""
            except RuntimeError as e:
                layer, why = None, str(e)
            for m in M_VALUES:
                row = dict(N=n, K=k, M=m, scheme=scheme.value, weight_bytes_equal=w_bytes_ok,
                           act_bytes_equal=a_bytes_ok)
                if layer is None:
                    row.update(backend="none", error=why)
                    rows.append(row)
                    continue
                x = x_cpu[:m].to(dev)
                try:
                    y = layer(x)
                except Exception as e:  # record and go on: the table shows every failure
                    row.update(backend="torch", error=f"{type(e).__name__}: {e}"[:300])
                    rows.append(row)
                    failures += 1
                    continue
                xq, xs = quantize_activation(x, act)
                ref = exact_matmul(xq, xs, layer.weight, layer.weight_scale, scheme) + lin.bias.double()
                ref_layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend="reference"))
                y_ref = ref_layer(x)
                row.update(backend="torch", rel_diff_vs_exact=rel_diff(y, ref),
                           rel_diff_vs_reference=rel_diff(y, y_ref),
                           finite=bool(torch.isfinite(y).all()))
                ok = row["rel_diff_vs_exact"] < 1e-4 and row["finite"] and w_bytes_ok and a_bytes_ok
                failures += not ok
                row["ok"] = ok
                rows.append(row)
            print(f"  done {scheme.value} {n}x{k}", flush=True)
    record.write(args.out, record.meta(), rows)
    print(f"\n{'N':>6} {'K':>6} {'M':>4} {'scheme':8} {'backend':8} {'w==cpu':6} {'a==cpu':6} "
          f"{'rel_diff':>9}  note")
    for r in rows:
        rd = r.get("rel_diff_vs_exact")
        print(f"{r['N']:>6} {r['K']:>6} {r['M']:>4} {r['scheme']:8} {r['backend']:8} "
              f"{str(r['weight_bytes_equal']):6} {str(r['act_bytes_equal']):6} "
              f"{'' if rd is None else f'{rd:9.2e}'}  {r.get('error', '')[:90]}")
    print(f"\nfailures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
