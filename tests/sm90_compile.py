"""Compile every Triton kernel of fp8now for a real GPU target on a machine without one.

Run as a script in a process *without* TRITON_INTERPRET (the interpreter replaces the kernels):
`python tests/sm90_compile.py` prints one JSON object per line: kernel variant, whether it compiled,
and facts read from its PTX. Triton's own compiler and the ptxas bundled with the triton wheel do
the work, so branches that only a GPU executes (programmatic dependent launch, the MMA paths) are
type-checked and lowered on CPU CI too. The GPU runs an older Triton (3.6) than CI may; this is a
compile check, not a substitute for the GPU tests.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp8now.kernels import triton_block as tb, triton_decode as td, triton_gemv as tv, triton_quant as tq  # noqa: E402
from fp8now.kernels import triton_rowwise as tr, triton_splitk as tk, triton_w8a16 as t8, triton_wquant as tw  # noqa: E402
from fp8now.kernels.plan import TABLES  # noqa: E402
from fp8now.kernels.triton_jit import merge_config, pick  # noqa: E402
from fp8now.kernels import moe_align as ma, plan as kp, triton_moe as tm, triton_moe_act as ta  # noqa: E402
from fp8now.kernels import triton_moe_direct as md, triton_peaks as tpk  # noqa: E402
from fp8now.kernels import triton_norm as tn, triton_silu_mul as tsm  # noqa: E402
from fp8now.numerics import E4M3FN, GROUP_AMAX_FLOOR  # noqa: E402

FP8, F32, BF16, I32 = "*fp8e4nv", "*fp32", "*bf16", "*i32"
# pointer types of the FP8 GEMMs and the GEMV (x, its scales, w, its scales, bias, out)
GEMM_PTRS = dict(x_ptr=FP8, xs_ptr=F32, w_ptr=FP8, ws_ptr=F32, b_ptr=F32, y_ptr=BF16)


def ptx_of(kernel, pointers, consts, options, cap=90, scalars=None) -> str:
    """The PTX of `kernel` for compute capability `cap`, with pointer types `pointers` (by parameter
    name), every other runtime parameter an i32 (or as `scalars` says), constexprs `consts`."""
    params = list(inspect.signature(kernel.fn).parameters)
    scalars = scalars or {}
    sig = {p: "constexpr" if p in consts else pointers.get(p, scalars.get(p, "i32")) for p in params}
    src = ASTSource(kernel, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options).asm["ptx"]


def compile_one(name, kernel, pointers, consts, options, cap=90, scalars=None):
    """Compile `kernel` (arguments as for `ptx_of`); one JSON line about the result."""
    row = dict(kernel=name)
    try:
        ptx = ptx_of(kernel, pointers, consts, options, cap, scalars)
        wait = ptx.find("griddepcontrol.wait")
        row.update(ok=True, gdc_wait=wait >= 0, load_before_wait=wait > ptx.find("ld.global") >= 0,
                   gdc_launch="griddepcontrol.launch_dependents" in ptx,
                   mma="wgmma" in ptx or "mma.sync" in ptx, wgmma="wgmma" in ptx,
                   fma_f32=ptx.count("fma.rn.f32"), acq_rel_atom="atom.global.gpu.acq_rel" in ptx)
    except Exception as e:  # report, do not stop: the test lists every failure
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    print(json.dumps(row), flush=True)


def main():
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("run without TRITON_INTERPRET: the interpreter replaces the kernels")
    cfg = td.DECODE_CONFIG
    floors = dict(FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR)
    tiles = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    for group, quant, pdl, levels, fast, *rows in [
            (False, False, False, 0, False), (False, False, True, 0, False), (False, True, False, 0, False),
            (True, False, False, 0, False), (True, True, False, 0, False), (False, False, True, 2, False),
            (True, False, False, 1, False), (False, False, True, 0, True), (False, True, False, 0, True),
            (False, False, True, 2, True), (False, True, False, 0, False, 16), (True, True, False, 0, False, 16)]:
        ptrs = dict(x_ptr=BF16 if quant else FP8, xs_ptr=F32, w_ptr=FP8, ws_ptr=F32, b_ptr=F32,
                    y_ptr=BF16, part_ptr=I32 if levels else F32, cnt_ptr=I32)
        consts = dict(ACT_GROUP=group, QUANT_X=quant, ROWS=(rows or [1 if quant else 16])[0],
                      SPLITS=max(4, 1 << levels),
                      HAS_BIAS=True, PDL=pdl, LEVELS=levels, EMPTY=td.EMPTY, FAST_ACCUM=fast, **floors, **tiles)
        compile_one(f"decode group={group} quant={quant} pdl={pdl} exchange_levels={levels}" + " fast_accum" * fast
                    + f" rows={consts['ROWS']}" * bool(rows),
                    td._decode_kernel, ptrs, consts, dict(opts, launch_pdl=pdl), scalars=dict(one="fp32"))
    # pre-quantized rows of a 64-token decode batch in one 64-row tile (decode_linear takes FP8 rows of any M)
    compile_one("decode rows=64 tile=64x64", td._decode_kernel,
                dict(GEMM_PTRS, part_ptr=F32, cnt_ptr=I32),
                dict(ACT_GROUP=False, QUANT_X=False, ROWS=64, SPLITS=4, HAS_BIAS=True, PDL=False, LEVELS=0,
                     EMPTY=td.EMPTY, FAST_ACCUM=False, **floors, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128),
                opts, scalars=dict(one="fp32"))
    q = dict(x_ptr=BF16, q_ptr=FP8, s_ptr=F32)
    # the launch plans of a decode row, and of long rows in both chunk widths
    for (m, k), early in [((1, 4096), False), ((16384, 14336), False), ((16384, 28672), False),
                          ((1, 4096), True)]:
        single, block_k, block_m, warps = tq._row_plan(m, k)
        compile_one(f"row_quant single={single} bk={block_k} early={early}", tq._row_quant_kernel, q,
                    dict(FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale, BLOCK_M=block_m, BLOCK_K=block_k,
                         SINGLE=single, EARLY=early), dict(num_warps=warps))
    for m, n_groups, col, early in [(1, 32, False, False), (4096, 112, False, False), (4096, 112, True, False),
                                    (3, 1, True, False), (1, 32, False, True)]:
        block_m, groups, warps = tq._group_plan(m, n_groups, col)
        compile_one(f"group_quant bm={block_m} g={groups} early={early}", tq._group_quant_kernel, q,
                    dict(FMAX=E4M3FN.fmax, FLOOR=GROUP_AMAX_FLOOR, BLOCK_M=block_m, GROUPS=groups, GROUP_K=128,
                         EARLY=early), dict(num_warps=warps))
    gemvs = {(rows, act == "group", c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) for (rows, act), table in
             tv.GEMV_CONFIGS.items() for _, c in table}
    gemv_floors = dict(FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR, AMAX_K=tv.AMAX_K)
    for rows, group, bn, bk, warps in sorted(gemvs):
        for pdl, quant in ((False, False), (True, False), (False, True)):   # quant: x in bf16, quantized inside
            compile_one(f"gemv rows={rows} group={group} {bn}x{bk}-w{warps} pdl={pdl}" + " quant_x" * quant,
                        tv._gemv_kernel, dict(GEMM_PTRS, x_ptr=BF16 if quant else FP8),
                        dict(ACT_GROUP=group, HAS_BIAS=True, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                             QUANT_X=quant, **gemv_floors), dict(num_warps=warps, launch_pdl=pdl))
    # torch.compile (inductor) may pass M = 1 as a constant despite do_not_specialize: that must compile too
    for group in (False, True):
        compile_one(f"gemv rows=1 group={group} M=1 constant", tv._gemv_kernel, GEMM_PTRS,
                    dict(M=1, ACT_GROUP=group, HAS_BIAS=False, ROWS=1, BLOCK_N=4, BLOCK_K=1024, PDL=False,
                         QUANT_X=True, **gemv_floors), dict(num_warps=4))
    producers()
    compile_one("amax", tw._amax_kernel, dict(x_ptr=BF16, amax_ptr=I32),
                dict(BLOCK_M=8, BLOCK_K=1024, K_ITERS=8), dict(num_warps=16))
    compile_one("tensor_quant", tw._tensor_quant_kernel, dict(x_ptr=BF16, q_ptr=FP8, amax_ptr=I32, s_ptr=F32),
                dict(FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale, BLOCK_M=4, BLOCK_K=2048), dict(num_warps=16))
    for dtype in ("bfloat16", "float16", "float32"):   # reload's check: pointers built from int64 addresses
        compile_one(f"peaks {dtype}", tpk._peaks_kernel, dict(work_ptr="*i64", bits_ptr=I32),
                    dict(DTYPE=getattr(triton.language, dtype), CHUNK=tpk.CHUNK, BLOCK=tpk.BLOCK), dict(num_warps=8))
    compile_one("block_quant", tw._block_quant_kernel, dict(w_ptr=BF16, q_ptr=FP8, s_ptr=F32),
                dict(FMAX=E4M3FN.fmax, FLOOR=1e-4, BLOCK=128), dict(num_warps=8))
    g = GEMM_PTRS
    for bound, c in tb.BLOCK_TABLE:
        t = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"])
        o = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
        partial = c["SPLIT_K"] != 1
        compile_one(f"block_gemm M<={bound}", tb._block_gemm_kernel, g, dict(HAS_BIAS=True, PARTIAL=partial, **t), o)
        for fast in (False, True):
            compile_one(f"rowwise_gemm M<={bound}" + " fast_accum" * fast, tr._rowwise_gemm_kernel, g,
                        dict(HAS_BIAS=True, PARTIAL=partial, FAST_ACCUM=fast, **t), o, scalars=dict(one="fp32"))
    for lo, hi, over in TABLES["cuda-fp8"].rowwise_mid:   # the plan's rowwise configs between 17 and 64 rows
        c = merge_config(pick(tb.BLOCK_TABLE, 64), dict(over))   # as rowwise_gemm merges them
        t = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"])
        compile_one(f"rowwise_gemm N {lo}-{hi} rows 17-64 (SPLIT_K={c['SPLIT_K']})", tr._rowwise_gemm_kernel, g,
                    dict(HAS_BIAS=True, PARTIAL=c["SPLIT_K"] != 1, FAST_ACCUM=False, **t),
                    dict(num_warps=c["num_warps"], num_stages=c["num_stages"]), scalars=dict(one="fp32"))
    compile_one("split_reduce", tk.split_reduce_kernel,
                dict(p_ptr=F32, xs_ptr=F32, ws_ptr=F32, b_ptr=F32, y_ptr=BF16),
                dict(SPLITS=4, SCALED=True, HAS_BIAS=True, BLOCK=1024), dict(num_warps=4))
    moe()
    c = t8.W8A16_TABLE[-1][1]
    compile_one("w8a16_gemm sm_80", t8._w8a16_gemm_kernel,
                dict(x_ptr=BF16, w_ptr="*u8", ws_ptr=F32, b_ptr=F32, y_ptr=BF16),
                dict(UPCAST_DOT=False, HAS_BIAS=True, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                     BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"]),
                dict(num_warps=c["num_warps"], num_stages=c["num_stages"]), cap=80)


def producers():
    """The RMSNorm (+ FP8 output) and SiLU * up (+ FP8 output) kernels of fp8now.layers.producers, at decode and
    Llama-3.1-8B / 70B row widths."""
    floors = dict(FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR)
    for quant in (0, 1, 2):
        for block in (4096, 8192):
            compile_one(f"rms_norm quant={quant} bk={block}", tn._rms_norm_kernel,
                        dict(x_ptr=BF16, w_ptr=BF16, y_ptr=BF16, q_ptr=FP8 if quant else BF16,
                             s_ptr=F32 if quant else BF16), dict(QUANT=quant, BLOCK_K=block, **floors),
                        dict(num_warps=8, enable_fp_fusion=False), scalars=dict(inv_k="fp32", eps="fp32"))
    for quant in (0, 2):
        compile_one(f"silu_mul quant={quant}", tsm._silu_mul_kernel,
                    dict(g_ptr=BF16, u_ptr=BF16, h_ptr=BF16, q_ptr=FP8 if quant else BF16,
                         s_ptr=F32 if quant else BF16),
                    dict(QUANT=quant, FMAX=E4M3FN.fmax, GROUP_FLOOR=GROUP_AMAX_FLOOR, BLOCK=2048), dict(num_warps=4))
    for single, block in ((True, 16384), (False, 2048)):
        compile_one(f"silu_mul_token single={single}", tsm._silu_mul_token_kernel,
                    dict(g_ptr=BF16, u_ptr=BF16, q_ptr=FP8, s_ptr=F32),
                    dict(FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale, BLOCK=block, SINGLE=single),
                    dict(num_warps=16 if single else 8))


def moe():
    """The grouped MoE GEMM at every plan row (both scale kinds), and the fused gate + quantizers."""
    table = kp.MoeTable()
    configs = {row[1:] for row in table.rows} | {table.invariant}
    ptrs = dict(a_ptr=FP8, as_ptr=F32, w_ptr=FP8, ws_ptr=F32, b_ptr=F32, y_ptr=BF16, slots_ptr=I32,
                block_expert_ptr=I32)
    for bm, bn, warps, stages in sorted(configs):
        for group in (False, True):
            compile_one(f"moe_gemm {bm}x{bn} w{warps} s{stages} group={group}", tm._moe_gemm_kernel, ptrs,
                        dict(GROUP_SCALES=group, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8),
                        dict(num_warps=warps, num_stages=stages), scalars=dict(one="fp32"))
        if (bm, bn, warps, stages) != table.invariant:   # Fp8Config(fast_accum=True): token scales, sorted path
            compile_one(f"moe_gemm {bm}x{bn} w{warps} s{stages} group=False fast_accum", tm._moe_gemm_kernel, ptrs,
                        dict(GROUP_SCALES=False, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8,
                             FAST_ACCUM=True),
                        dict(num_warps=warps, num_stages=stages), scalars=dict(one="fp32"))
    q = dict(h_ptr=BF16, q_ptr=FP8, s_ptr=F32)
    for gate, fl in [(code, dict(alpha="fp32", limit="fp32")) for code in ta.GATE_CODES.values()] + [
            (ta.GATE_CODES["clamped_swiglu"], dict(alpha="fp64", limit="fp64"))]:   # torch.compile's floats
        compile_one(f"moe_gate_token gate={gate} {fl['alpha']}", ta._gated_token_kernel, q,
                    dict(GATE=gate, FMAX=E4M3FN.fmax, FLOOR=E4M3FN.min_scale, BLOCK=2048), dict(num_warps=8),
                    scalars=fl)
        compile_one(f"moe_gate_group gate={gate} {fl['alpha']}", ta._gated_group_kernel, q,
                    dict(GATE=gate, FMAX=E4M3FN.fmax, FLOOR=GROUP_AMAX_FLOOR, GROUPS=8, GROUP_K=128),
                    dict(num_warps=4), scalars=fl)
    compile_one("moe_combine", tm._combine_kernel, dict(y_ptr=BF16, w_ptr=F32, out_ptr=BF16),
                dict(TOP_K=8, BLOCK_H=1024), dict(num_warps=4))
    for bins in (16, 256):   # E = 8 and E = 128 (one spare bin)
        compile_one(f"moe_align bins={bins}", ma._align_kernel, dict(ids_ptr="*i64", slots_ptr=I32,
                    block_expert_ptr=I32), dict(BLOCK_M=16, BINS=bins, CHUNK=64), dict(num_warps=4))
        compile_one(f"moe_align_counts bins={bins}", ma._chunk_counts_kernel, dict(ids_ptr="*i64", counts_ptr=I32),
                    dict(BINS=bins, LANES=64), dict(num_warps=4))
        compile_one(f"moe_align_place bins={bins}", ma._place_kernel, dict(ids_ptr="*i64", counts_ptr=I32,
                    slots_ptr=I32, block_expert_ptr=I32), dict(BLOCK_M=64, BINS=bins, LANES=64), dict(num_warps=4))
    direct(table)


def direct(table):
    """The direct MoE kernels (few slots) at every plan row the direct path can take, both scale kinds;
    one-row quantization (one token) and GPT-OSS's gate (fp32 and torch.compile's fp64 floats) at one."""
    floors = dict(FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale, GROUP_FLOOR=GROUP_AMAX_FLOOR, BINS=256, LANES=64,
                  BLOCK_K=128)
    w13 = dict(x_ptr=BF16, ids_ptr="*i64", w_ptr=FP8, ws_ptr=F32, b_ptr=BF16, a_ptr=BF16)
    w2 = dict(a_ptr=BF16, ids_ptr="*i64", wts_ptr=F32, w_ptr=FP8, ws_ptr=F32, b_ptr=BF16, y_ptr=BF16, out_ptr=BF16,
              cnt_ptr=I32)
    rows = [row[1:] for row in table.rows if row[0] is not None]
    cases = [(cfg, group, cfg[0], 0, "fp32") for cfg in rows for group in (False, True)]
    cases += [(rows[0], group, 1, 0, "fp32") for group in (False, True)]
    cases += [(rows[0], False, rows[0][0], ta.GATE_CODES["clamped_swiglu"], f) for f in ("fp32", "fp64")]
    for (bm, bn, warps, stages), group, r, gate, fl in cases:
        tile = dict(GROUP=group, HAS_BIAS=True, ROWS=r, BLOCK_M=bm, BLOCK_N=bn, **floors)
        opts = dict(num_warps=warps, num_stages=stages)
        name = f"{bm}x{bn} w{warps} s{stages} group={group} rows={r}"
        compile_one(f"moe_direct_w13 {name} gate={gate} {fl}", md._w13_gated_kernel, w13,   # half-width tiles
                    dict(tile, GATE=gate, BLOCK_N=bn // 2), opts,
                    scalars=dict(one="fp32", alpha=fl, limit=fl))
        if gate == 0:
            compile_one(f"moe_direct_w2 {name}", md._w2_combine_kernel, w2, dict(TOP_K=8, BLOCK_T=16, **tile), opts,
                        scalars=dict(one="fp32"))


if __name__ == "__main__":
    main()
