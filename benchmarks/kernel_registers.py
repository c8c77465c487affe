"""Registers and spills of the GEMV's launch configs on sm_90, read from ptxas on a machine without a GPU.

A CUDA-core GEMV keeps BLOCK_N x BLOCK_K float32 products per activation row in registers, so its
register count sets how many programs an SM holds, and with them how many weight bytes are in
flight: the quantity that decides whether the weight streams at memory speed (BENCHMARKS.md, "GEMV
launch configs by N"). For every shipped config and a few neighbours, per row count and scale kind,
this prints the registers per thread and spill bytes that ptxas reports for the PTX Triton emits
(tests/sm90_compile.py's compile path), the programs per SM that 64K registers allow (at most 32),
and the weight bytes those programs request per K step. The Triton on this machine may differ from
the GPU image's (3.6); the numbers are for reasoning, not dispatch.

`python3 benchmarks/kernel_registers.py` (no TRITON_INTERPRET; `--json` for one JSON object per line).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from sm90_compile import GEMM_PTRS, ptx_of  # noqa: E402
from fp8now.kernels import triton_gemv as tv  # noqa: E402

NEIGHBOURS = [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (4, 512, 4), (4, 256, 4), (2, 512, 4)]


def ptxas_path(cap: int = 90) -> str:
    """The ptxas Triton itself uses for this capability (its signature changed across versions)."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        return get_ptxas(cap).path
    except TypeError:
        return get_ptxas().path


def ptxas_report(ptx: str, arch: str = "sm_90a") -> tuple[int, int]:
    """(registers per thread, spill-store bytes) from `ptxas -v`."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas_path(), "-v", f"-arch={arch}", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
    log = out.stdout + out.stderr
    regs, spill = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    if out.returncode or regs is None:
        raise RuntimeError(f"ptxas failed: {log[-500:]}")
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def main() -> None:
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("run without TRITON_INTERPRET: the interpreter replaces the kernels")
    shipped = {(rows, act): {(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) for _, c in table}
               for (rows, act), table in tv.GEMV_CONFIGS.items()}
    for (rows, act), mine in shipped.items():
        for bn, bk, warps in sorted(mine | set(NEIGHBOURS)):
            ptx = ptx_of(tv._gemv_kernel, GEMM_PTRS, dict(ACT_GROUP=act == "group", HAS_BIAS=False, ROWS=rows,
                                                     BLOCK_N=bn, BLOCK_K=bk, PDL=True), dict(num_warps=warps))
            regs, spill = ptxas_report(ptx)
            per_sm = min(65536 // (regs * 32 * warps), 32)
            row = dict(rows=rows, scales=act, config=f"{bn}x{bk}-w{warps}", shipped=(bn, bk, warps) in mine,
                       regs=regs, spill_bytes=spill, programs_per_sm=per_sm,
                       weight_kb_per_sm_step=per_sm * bn * bk / 1024)
            if "--json" in sys.argv:
                print(json.dumps(row))
            else:
                print(f"rows={rows} {act:5} {row['config']:12} {'shipped' if row['shipped'] else '':7} "
                      f"{regs:3} regs {spill:4} B spilled  {per_sm:2} programs/SM  "
                      f"{row['weight_kb_per_sm_step']:5.1f} KB of weight per SM per K step")


if __name__ == "__main__":
    main()
