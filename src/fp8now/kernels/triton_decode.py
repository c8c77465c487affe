"""One-launch FP8 decode linear: activation quantization inside a split-K GEMM that reduces its own splits.

For decode-sized M (a few tokens) a layer call is memory-bound on the weight, and every extra graph
node or Python launch costs more than the bytes it moves. `decode_linear` does the whole call in one
kernel launch:
- the activation is quantized in registers by the program that consumes it, with the rules of SPEC §4
  (IEEE division, clamp, round-to-nearest-even cast), so the FP8 operands are exactly those of
  `numerics.quantize_activation`; per 1x128 group a program needs only its own K slice, per token it
  first reads its rows over all of K for the amax (cheap for a few short rows: the dispatch in
  `kernels.plan` decides where). A pre-quantized `(x_q, x_s)` is also accepted. In-kernel quantization
  pays only for one row of 1x128 groups (every program re-reads its rows; BENCHMARKS.md).
- K is split over SPLITS programs per output tile. Each writes its float32 partial to a workspace,
  then takes a ticket from a per-tile counter (atomic add, acquire-release); the program that draws
  the last ticket adds the SPLITS partials in the fixed order 0..SPLITS-1 (deterministic whatever the
  arrival order), applies the scales and bias, casts, stores, and resets the counter to zero.
- Or (`slots`, a power-of-two number of splits) the splits meet in a fixed binary tree of pairwise
  exchanges (`_exchange`): each element's partial sum travels through one atomic exchange per level, so
  there is no workspace store, fence, ticket or re-read on the last program's path. Deterministic,
  because a + b == b + a in float32 whichever of a pair arrives second. Each level costs a round trip
  and M x BLOCK_N atomics per tile, so it pays at two splits on few tiles (`plan.Table.few_splits_n`).

The counters are an int32 tensor that must be zero before the launch and is zero again after it: the
caller keeps one per layer (`ticket_counters(N, device)`; `Fp8Linear` owns it as its workspace). Two
launches sharing a counter tensor must not run at the same time (e.g. the same layer on two streams at
once); without one, a zeroed tensor is allocated per call.
No host synchronization anywhere: the wrapper captures in CUDA graphs.
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from . import triton_jit as tj
from .plan import DECODE_MAX_M
from .triton_jit import abs_bits, as_f32, to_fp8
from .triton_splitk import split_sizes, split_workspace
from .triton_support import gdc_wait, memo, require_triton, sm90, tl, triton

ACTS = ("token", "group")
W_KINDS = ("tensor", "channel", "block")
# Decode tile: 16 rows (every M <= 16 in one row tile), 64 columns (the H200 decode sweep's winner for
# the split-K GEMMs, benchmarks/tune_decode.py), 4 warps, 4 stages; K split as for the split-K GEMMs.
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=0)
MAX_M = DECODE_MAX_M   # one row tile of BLOCK_M rows
# the exchange slots' empty value: a NaN bit pattern no float32 sum produces (GPUs write the canonical
# NaN 0x7FFFFFFF; this one has the sign bit set and another payload)
EMPTY = -0x00452453  # 0xFFBADBAD as int32


@triton.jit
def _quantize_block(xf, s, FMAX: tl.constexpr, w_ptr):
    """fp8(clamp(xf / s)) with IEEE division (xf float32 [R, BK], s [R]); w_ptr gives the fp8 type."""
    return to_fp8(tl.math.div_rn(xf, s[:, None]), w_ptr, FMAX)


@triton.jit(do_not_specialize=["M"])
def _decode_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, one,
                   M, N, K, K_SPLIT, stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_wsk,
                   stride_ym,
                   ACT_GROUP: tl.constexpr, QUANT_X: tl.constexpr, ROWS: tl.constexpr,
                   SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr, GROUP_FLOOR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, LEVELS: tl.constexpr, EMPTY: tl.constexpr,
                   FAST_ACCUM: tl.constexpr):
    # ROWS: activation rows a program quantizes: BLOCK_M, or 1 when M == 1 (that row is quantized
    # once and broadcast to the MMA's BLOCK_M rows, instead of quantizing BLOCK_M copies of it).
    tile = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // num_n
    pid_n = tile % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    rm = (offs_m % M).to(tl.int64)          # rows past M wrap onto real ones (the stores mask them)
    rq = ((pid_m * BLOCK_M + tl.arange(0, ROWS)) % M).to(tl.int64)
    q_ok = (pid_m * BLOCK_M + tl.arange(0, ROWS) < M)[:, None]   # quantizing: rows past M read as zeros
    rn = (offs_n % N).to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    xq_rows = x_ptr + rq[:, None] * stride_xm                                        # [ROWS, 1]
    w_cols = w_ptr + rn[None, :] * stride_wn
    if PDL:  # launched early (programmatic dependent launch): wait for the previous kernel's writes
        # before the first memory access (only the launch and the address arithmetic overlap it)
        gdc_wait()
    # Per token: the row scale first (quantizing here: the amax over all of K of this tile's rows).
    s_q = tl.zeros((ROWS,), dtype=tl.float32)
    if not ACT_GROUP:
        if QUANT_X:
            bits = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                xk = tl.load(xq_rows + (k0 + offs_k)[None, :], mask=q_ok & ((k0 + offs_k)[None, :] < K), other=0.0)
                bits = tl.maximum(bits, abs_bits(xk))
            amax = as_f32(tl.max(bits, axis=1))
            s_q = tl.maximum(tl.math.div_rn(amax, FMAX), TOKEN_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    s_row = tl.broadcast_to(s_q, (BLOCK_M,))
    if not ACT_GROUP and not QUANT_X:
        s_row = tl.load(xs_ptr + rm * stride_xsm)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT_X:  # the activation block of the next step is loaded one step ahead (its quantization
        # sits between the load and the MMA, which keeps the compiler's pipelining from covering it)
        x_next = tl.load(xq_rows + (k_begin + offs_k)[None, :], mask=q_ok & ((k_begin + offs_k)[None, :] < k_end),
                         other=0.0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_end
        b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None], other=0.0)             # [BK, BN] fp8
        if QUANT_X:
            xf = x_next.to(tl.float32)                                              # [ROWS, BK]
            x_next = tl.load(xq_rows + (kk + BLOCK_K)[None, :], mask=q_ok & ((kk + BLOCK_K)[None, :] < k_end),
                             other=0.0)
            if ACT_GROUP:  # this K-block is one 1x128 group: its scale, then the block product
                amax = as_f32(tl.max(abs_bits(xf), axis=1))
                sg = tl.math.div_rn(tl.maximum(amax, GROUP_FLOOR, propagate_nan=tl.PropagateNan.ALL), FMAX)
                a = tl.broadcast_to(_quantize_block(xf, sg, FMAX, w_ptr), (BLOCK_M, BLOCK_K))
                sa = tl.broadcast_to(sg, (BLOCK_M,))
            else:
                a = tl.broadcast_to(_quantize_block(xf, s_q, FMAX, w_ptr), (BLOCK_M, BLOCK_K))
                sa = s_row
        else:
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=k_ok[None, :], other=0.0)
            if ACT_GROUP:
                sa = tl.load(xs_ptr + rm * stride_xsm + (k0 // 128) * stride_xsk)
            else:
                sa = s_row
        if ACT_GROUP:  # block weights: one scale per (128-row tile, K-block); BLOCK_N divides 128
            sb = tl.load(ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn + (k0 // 128) * stride_wsk)
            acc += tl.dot(a, b) * (sa * sb)[:, None]
        elif FAST_ACCUM:  # this split's K in the MMA's own accumulator (see triton_rowwise)
            acc = tl.dot(a, b, acc)
        else:  # keep every K-block's product apart from the MMA's own accumulator (see triton_rowwise)
            acc += tl.dot(a, b) * tl.cast(one, tl.float32)
    if LEVELS > 0:  # the splits meet in a fixed binary tree of pairwise exchanges (see _exchange)
        acc, live = _exchange(acc, part_ptr, offs_m, offs_n, M, N, SPLITS, LEVELS, EMPTY)
        _epilogue(acc, s_row, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, rn, M, N, stride_wsn, stride_ym,
                  ACT_GROUP, HAS_BIAS, live)
    elif SPLITS > 1:
        p_tile = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n.to(tl.int64)[None, :]
        mask = row_ok[:, None] & (offs_n[None, :] < N)
        tl.store(p_tile + tl.program_id(1).to(tl.int64) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is drawn
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLITS):
                acc += tl.load(p_tile + i * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _epilogue(acc, s_row, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, rn, M, N, stride_wsn, stride_ym,
                      ACT_GROUP, HAS_BIAS, mask)
    else:
        _epilogue(acc, s_row, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, rn, M, N, stride_wsn, stride_ym,
                  ACT_GROUP, HAS_BIAS, row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _exchange(acc, slot_ptr, offs_m, offs_n, M, N, SPLITS: tl.constexpr, LEVELS: tl.constexpr,
              EMPTY: tl.constexpr):
    """Add the SPLITS (= 2**LEVELS) partials of a tile in a fixed tree, element by element, with no
    ticket and no fence: at level l, splits s and s ^ (1 << l) (as carried so far) swap their sums into
    one slot (an atomic exchange, which returns what was there). The first to arrive finds EMPTY and is
    done with that element; the second gets its partner's sum, adds it (a + b == b + a exactly, so the
    result does not depend on who came second) and puts EMPTY back. The slots [SPLITS - 1, M, N] int32
    hold EMPTY before and after every launch. Returns (the sums, where this program holds the final one)."""
    live = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    off = offs_m.to(tl.int64)[:, None] * N + offs_n.to(tl.int64)[None, :]
    s = tl.program_id(1)
    for lv in tl.static_range(LEVELS):
        slot = slot_ptr + (SPLITS - (SPLITS >> lv) + (s >> (lv + 1))).to(tl.int64) * M * N + off
        old = tl.atomic_xchg(slot, acc.to(tl.int32, bitcast=True), mask=live, sem="relaxed")
        second = live & (old != EMPTY)
        tl.store(slot, tl.full(acc.shape, EMPTY, tl.int32), mask=second)
        acc = tl.where(second, acc + old.to(tl.float32, bitcast=True), acc)
        live = second
    return acc, live


@triton.jit
def _epilogue(acc, s_row, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, rn, M, N, stride_wsn, stride_ym,
              ACT_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, mask):
    """Row x column scales (per token), bias, one cast, store where `mask`."""
    if not ACT_GROUP:  # per channel, or (stride 0) one tensor scale
        sb = tl.load(ws_ptr + rn * stride_wsn)
        acc = acc * (s_row[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_CHECKED_CONFIG = tj.merge_config(DECODE_CONFIG, None, block_k=tj.SCALE_BLOCK)


def _plan(cfg: dict, m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(K per split, splits, output tiles) of a launch."""
    k_split, splits = split_sizes(cfg, m, n, k, device)
    return k_split, splits, tj.cdiv(m, cfg["BLOCK_M"]) * tj.cdiv(n, cfg["BLOCK_N"])


@memo(maxsize=1024)
def _default_plan(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    return _plan(_CHECKED_CONFIG, m, n, k, device)


@memo(maxsize=64)
def _config_of(items: tuple) -> dict:
    """DECODE_CONFIG updated by a config's sorted items, checked (once per distinct config)."""
    return tj.merge_config(DECODE_CONFIG, dict(items), block_k=tj.SCALE_BLOCK)


@memo(maxsize=1024)
def _config_plan(items: tuple, m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    return _plan(_config_of(items), m, n, k, device)


def decode_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_kind: str, act: str,
                  bias: torch.Tensor | None = None, *, x_scale: torch.Tensor | None = None,
                  counters: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  config: dict | None = None, pdl: bool = False,
                  slots: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T (+ bias) in one launch, for M <= MAX_M; pre-quantized FP8 rows
    (`x_scale` given) of any M, in row tiles of the config's BLOCK_M (the ticket's counters then one per tile).

    w_kind "tensor" (w_s 0-d / [1]) or "channel" (w_s [N, 1]) with act "token"; w_kind "block"
    (w_s [ceil(N/128), ceil(K/128)]) with act "group". `x` is bf16/fp16/fp32 and quantized in the
    kernel, or already FP8 with its `x_scale` (per token [M, 1], per group [M, ceil(K/128)], any strides).

    `pdl` (sm_90+; ignored elsewhere and under torch.compile): launch as a programmatic dependent of
    the previous kernel in the stream, which lets it start while that kernel runs (it waits for that
    kernel's writes before touching memory); pair it with `quantize_act_token(..., early_launch=True)`.

    `slots` (from `exchange_slots`): add the K splits by pairwise exchanges (`_exchange`) instead of the
    ticket; the number of splits must then be a power of two.

    `fast_accum` (token scales only: block promotes every K-block to apply its scales): each split
    accumulates in the tensor cores' own accumulator (Fp8Config.fast_accum).
    """
    require_triton()
    if act not in ACTS or w_kind not in W_KINDS or (act == "group") != (w_kind == "block"):
        raise ValueError(f"decode_linear pairs act 'token' with w_kind 'tensor'/'channel' and act 'group' "
                         f"with w_kind 'block'; got act={act!r}, w_kind={w_kind!r}")
    if fast_accum and act == "group":
        raise ValueError("decode_linear: fast_accum applies to per-token scales only (block GEMMs promote "
                         "every K-block's product to apply its scales)")
    if w_q.dim() != 2 or w_q.dtype != tj.FP8_DTYPE:
        raise ValueError(f"w_q must be a 2-D {tj.FP8_DTYPE} tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    N, K = w_q.shape
    quant_x = x_scale is None
    if quant_x:
        x2 = tj.flatten_act(x, K)
    else:
        if x.dtype != tj.FP8_DTYPE or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"a pre-quantized x must be [M, {K}] {tj.FP8_DTYPE}, got {x.dtype} "
                             f"{tuple(x.shape)}")
        x2 = x
    M = x2.shape[0]
    if M > MAX_M and quant_x:   # every program quantizes its rows over all of K: for a few rows only
        raise ValueError(f"decode_linear quantizes in the kernel for M <= {MAX_M} tokens, got M={M}; hand it "
                         f"the FP8 rows and their x_scale instead")
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if quant_x:
        sxm = sxk = 0
    elif act == "token":
        sxm, sxk = tj.vector_scale(x_scale, M, "x_scale", x2.device), 0
    else:
        tj.check_block_scale(x_scale, M, K, "x_scale", x2.device, 1)
        sxm, sxk = x_scale.stride(0), x_scale.stride(1)
    if w_kind == "block":
        tj.check_block_scale(w_s, N, K, "w_s", w_q.device, tj.SCALE_BLOCK)
        swn, swk = w_s.stride(0), w_s.stride(1)
        if K % tj.SCALE_BLOCK:
            raise ValueError(f"block decode needs K divisible by {tj.SCALE_BLOCK}, got K={K}")
    else:
        swn, swk = tj.vector_scale(w_s, N, "w_s", w_q.device), 0
    bias = tj.check_bias(bias, N, w_q.device)
    out_dtype = (x2.dtype if quant_x else torch.bfloat16) if out_dtype is None else out_dtype
    tj.check_out_dtype(out_dtype)
    items = None if config is None else tuple(sorted(config.items()))
    cfg = _CHECKED_CONFIG if items is None else _config_of(items)
    if w_kind == "block" and 128 % cfg["BLOCK_N"]:
        raise ValueError(f"block decode needs BLOCK_N dividing 128, got {cfg['BLOCK_N']}")
    y = torch.empty((M, N), dtype=out_dtype, device=w_q.device)
    if M == 0 or N == 0:
        return y
    # the launch plan of a shape and config is computed once
    k_split, splits, tiles = (_default_plan(M, N, K, w_q.device) if items is None
                              else _config_plan(items, M, N, K, w_q.device))
    levels = 0
    if slots is not None and splits > 1:
        levels = splits.bit_length() - 1
        if splits != 1 << levels:
            raise ValueError(f"the exchange reduction needs a power-of-two number of K splits, got {splits}")
        if slots.dtype != torch.int32 or slots.device != w_q.device or slots.numel() < (splits - 1) * M * N:
            raise ValueError(f"slots must be exchange_slots(...) on {w_q.device} with at least "
                             f"{(splits - 1) * M * N} int32 elements")
        part = slots
    else:
        part = split_workspace(splits, y)
    if counters is not None and (counters.dtype != torch.int32 or counters.device != w_q.device):
        raise ValueError(f"counters must be a zeroed int32 tensor on {w_q.device}, got "
                         f"{counters.dtype} on {counters.device}")
    if splits > 1 and not levels and (counters is None or counters.numel() < tiles):  # the ticket's
        counters = torch.zeros(tiles, dtype=torch.int32, device=w_q.device)
    launch = {"launch_pdl": True} if pdl and sm90(w_q.device) and not torch.compiler.is_compiling() else {}
    _decode_kernel[(tiles, splits)](
        x2, x_scale if x_scale is not None else w_s, w_q, w_s, bias if bias is not None else w_s, y, part,
        counters if counters is not None else w_s, 1.0,
        M, N, K, k_split, x2.stride(0), sxm, sxk, w_q.stride(0), swn, swk, y.stride(0),
        ACT_GROUP=act == "group", QUANT_X=quant_x, ROWS=1 if M == 1 else cfg["BLOCK_M"], SPLITS=splits,
        HAS_BIAS=bias is not None, FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale,
        GROUP_FLOOR=GROUP_AMAX_FLOOR, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], PDL=bool(launch), LEVELS=levels, EMPTY=EMPTY, FAST_ACCUM=fast_accum,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch)
    return y


def ticket_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """The ticket counters for an [N, K] weight at any M <= MAX_M: int32 zeros, one per output tile of
    16 or more columns (as they are again after every launch). A layer keeps one for its life."""
    return torch.zeros(-(-n // 16), dtype=torch.int32, device=device)


def exchange_slots(n: int, splits: int, device: torch.device | str, m: int = MAX_M) -> torch.Tensor:
    """The exchange reduction's slots for `splits` K splits of an [N, K] weight at up to `m` rows: int32,
    every element EMPTY (as they are again after every launch). A layer keeps one for its life."""
    return torch.full(((splits - 1) * m * n,), EMPTY, dtype=torch.int32, device=device)
