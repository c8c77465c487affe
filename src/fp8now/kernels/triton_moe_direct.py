"""The MoE routed path for few routed slots in two launches: no alignment, no separate quantizer,
gate or combine kernel.

- `_w13_gated_kernel`, program (p, N-tile): takes the p-th expert that received slots straight from
  `top_k_index` (a histogram of the ids; slots of one expert in ascending order, as the sorted path
  has them), quantizes its tokens' rows of x in registers (SPEC §4: the FP8 bytes of
  `triton_quant`'s quantizers), multiplies them by the expert's gate rows and up rows of the same
  BLOCK_N / 2 columns (the sorted w13 GEMM's BLOCK_N columns of h, so the same registers: two whole
  tiles spill under sm_90's ptxas), and applies the gated activation in the epilogue: a [S, Ip].
- `_w2_combine_kernel`, program (p, N-tile): quantizes those rows of `a` in registers, multiplies by
  the expert's w2 and stores the rows, rounded to x.dtype, in a scratch y [S, Hp]; then takes a ticket
  from the tile's counter (acquire-release, as `triton_decode`'s split-K ticket): the program that
  brings it to the number of routed slots combines every token of the tile, j = 0..k-1 in order (the
  sorted path's `_combine_kernel` order, whatever the arrival order), and resets the counter.
Rows and scales go through the same operations in the same order as the sorted path with the same
tile config, so both give the same bytes. Each program re-reads the ids (O(S)), hence the small-S
bound in `plan.MoeTable.direct_max_slots`; the plan takes them at one token (`direct_max_tokens`, where they beat
the sorted path on the H100). No host sync: it captures in CUDA graphs. The counters
(`direct_counters`) must be zero before a launch and are zero after it: a layer keeps one tensor
for its life and two launches sharing it must not run at the same time.
"""

from __future__ import annotations

import torch

from ..config import Scheme
from ..numerics import E4M3FN, GROUP_AMAX_FLOOR
from .plan import MoePath
from .triton_jit import SCALE_BLOCK, abs_bits, as_f32, cdiv, to_fp8
from .triton_moe_act import GATE_CODES, gated_values, round_as
from .triton_quant import pow2
from .triton_support import require_triton, tl, triton

_LANES = 64         # ids examined per step when finding an expert's slots
MIN_BLOCK_N = 16    # the narrowest output tile: the counters cover Hp / MIN_BLOCK_N tiles
_BLOCK_T = 16       # tokens per step of the combine


@triton.jit
def _routed_expert(ids_ptr, S, E, p, BINS: tl.constexpr, LANES: tl.constexpr):
    """(the p-th expert, ascending, that received slots; its slot count, 0 if there is none; the
    slots routed to experts in [0, E))."""
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, LANES)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, S, LANES):   # ids outside [0, E) (and lanes past S) land in the spare last bin
        e = tl.load(ids_ptr + s0 + lanes, mask=s0 + lanes < S, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((e >= 0) & (e < E), e, BINS - 1), BINS)
    counts = tl.where(bins < E, counts, 0)
    hit = counts > 0
    mine = hit & (tl.cumsum(hit.to(tl.int32), axis=0) - 1 == p)
    return tl.sum(tl.where(mine, bins, 0), axis=0), tl.sum(tl.where(mine, counts, 0), axis=0), tl.sum(counts, axis=0)


@triton.jit
def _slots_of(ids_ptr, S, e, c0, ROWS: tl.constexpr, LANES: tl.constexpr):
    """Slots c0 .. c0 + ROWS - 1 among those routed to expert e (ascending): [ROWS] ids (0 where none),
    and whether each exists."""
    lanes = tl.arange(0, LANES)
    want = c0 + tl.arange(0, ROWS)
    slot = tl.zeros([ROWS], dtype=tl.int32)
    found = tl.zeros([ROWS], dtype=tl.int32)
    before = 0
    for s0 in range(0, S, LANES):
        mine = (tl.load(ids_ptr + s0 + lanes, mask=s0 + lanes < S, other=-1) == e).to(tl.int32)
        pos = before + tl.cumsum(mine, axis=0) - 1
        hit = (mine[None, :] > 0) & (pos[None, :] == want[:, None])              # [ROWS, LANES]
        slot += tl.sum(tl.where(hit, s0 + lanes[None, :], 0), axis=1)
        found += tl.sum(hit.to(tl.int32), axis=1)
        before += tl.sum(mine, axis=0)
    return slot, found > 0


@triton.jit
def _quantized_slots(ids_ptr, S, e, c0, slot, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, LANES: tl.constexpr):
    """The slots whose rows a tile quantizes: all BLOCK_M (`slot`), or ROWS = 1: the first (one token
    per call: every slot of an expert then holds the same row)."""
    if ROWS == BLOCK_M:
        return slot
    else:
        return _slots_of(ids_ptr, S, e, c0, ROWS, LANES)[0]


@triton.jit
def _token_scales(rows, K, FMAX: tl.constexpr, FLOOR: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-token scales [ROWS] of the rows at pointers `rows` [ROWS, 1] over K columns (SPEC §4)."""
    offs_k = tl.arange(0, BLOCK_K)
    bits = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(rows + (k0 + offs_k)[None, :], mask=(k0 + offs_k)[None, :] < K, other=0.0)
        bits = tl.maximum(bits, abs_bits(v))
    amax = as_f32(tl.max(bits, axis=1))
    return tl.maximum(tl.math.div_rn(amax, FMAX), FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantized(rows, kk, K, s_tok, like_ptr, GROUP: tl.constexpr, FMAX: tl.constexpr,
               GROUP_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activation block at columns kk of `rows` [R, 1] quantized: (fp8 [BLOCK_M, BK], scales
    [BLOCK_M]), R rows broadcast to BLOCK_M (R = 1: every row of the tile is that one row)."""
    v = tl.load(rows + kk[None, :], mask=kk[None, :] < K, other=0.0).to(tl.float32)
    if GROUP:   # this K block is one 1x128 group
        amax = as_f32(tl.max(abs_bits(v), axis=1))
        s = tl.math.div_rn(tl.maximum(amax, GROUP_FLOOR, propagate_nan=tl.PropagateNan.ALL), FMAX)
    else:
        s = s_tok
    q = to_fp8(tl.math.div_rn(v, s[:, None]), like_ptr, FMAX)
    return tl.broadcast_to(q, (BLOCK_M, BLOCK_K)), tl.broadcast_to(s, (BLOCK_M,))


@triton.jit
def _accumulate(acc, a, sa, w_ptrs, ws_ptrs, k0, k_ok, stride_wsk, one, GROUP: tl.constexpr):
    """acc + one K block's product, each block's product promoted into acc apart (as triton_moe)."""
    b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    if GROUP:
        sb = tl.load(ws_ptrs + (k0 // 128) * stride_wsk)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    else:
        acc += tl.dot(a, b) * tl.cast(one, tl.float32)
    return acc


@triton.jit
def _w13_gated_kernel(x_ptr, ids_ptr, w_ptr, ws_ptr, b_ptr, a_ptr, one, alpha, limit,
                      S, E, H, K, I, TOP_K, stride_xm, stride_we, stride_wn, stride_wk,
                      stride_wse, stride_wsn, stride_wsk, stride_be, stride_am,
                      GATE: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                      FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr, GROUP_FLOOR: tl.constexpr,
                      BINS: tl.constexpr, LANES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """a[slot, n] = gate(x[slot // k] @ W13_e[gate rows n], ... @ W13_e[up rows n]) for the p-th expert."""
    e, n, total = _routed_expert(ids_ptr, S, E, tl.program_id(0), BINS, LANES)
    if n > 0:
        e64 = e.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = (offs_n % I).to(tl.int64)                                   # wraps onto valid columns
        offs_k = tl.arange(0, BLOCK_K)
        wg_ptrs = w_ptr + e64 * stride_we + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn   # [BK, BN]
        sg_ptrs = ws_ptr + e64 * stride_wse + (rn // 128 if GROUP else rn) * stride_wsn              # [BN]
        su_ptrs = ws_ptr + e64 * stride_wse + ((rn + I) // 128 if GROUP else rn + I) * stride_wsn
        for c0 in range(0, n, BLOCK_M):
            slot, valid = _slots_of(ids_ptr, S, e, c0, BLOCK_M, LANES)
            rows = x_ptr + (_quantized_slots(ids_ptr, S, e, c0, slot, ROWS, BLOCK_M, LANES) // TOP_K
                            ).to(tl.int64)[:, None] * stride_xm                  # [ROWS, 1]
            s_tok = tl.zeros((ROWS,), dtype=tl.float32)
            if not GROUP:
                s_tok = _token_scales(rows, H, FMAX, TOKEN_FLOOR, ROWS, BLOCK_K)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                a, sa = _quantized(rows, kk, H, s_tok, w_ptr, GROUP, FMAX, GROUP_FLOOR, BLOCK_M, BLOCK_K)
                w_k = wg_ptrs + k0 * stride_wk
                acc_g = _accumulate(acc_g, a, sa, w_k, sg_ptrs, k0, kk < K, stride_wsk, one, GROUP)
                acc_u = _accumulate(acc_u, a, sa, w_k + I * stride_wn, su_ptrs, k0, kk < K, stride_wsk, one, GROUP)
            if not GROUP:
                s_row = tl.broadcast_to(s_tok, (BLOCK_M,))
                acc_g = acc_g * (s_row[:, None] * tl.load(sg_ptrs)[None, :])
                acc_u = acc_u * (s_row[:, None] * tl.load(su_ptrs)[None, :])
            if HAS_BIAS:
                acc_g += tl.load(b_ptr + e64 * stride_be + rn).to(tl.float32)[None, :]
                acc_u += tl.load(b_ptr + e64 * stride_be + I + rn).to(tl.float32)[None, :]
            act = gated_values(round_as(acc_g, a_ptr), round_as(acc_u, a_ptr), alpha, limit, a_ptr, GATE)
            a_ptrs = a_ptr + slot.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
            tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < I)[None, :])


@triton.jit
def _combine_tile(y_ptr, wts_ptr, out_ptr, T, H, cols, stride_ym, stride_wt, stride_om,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, cols] = sum_j w[t, j] * y[t * k + j, cols] in float32, j ascending, for every token."""
    col_ok = cols < H
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t64 = t.to(tl.int64)
        mask = (t < T)[:, None] & col_ok[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            w = tl.load(wts_ptr + t64 * stride_wt + j, mask=t < T, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + (t64 * TOP_K + j)[:, None] * stride_ym + cols[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            p = y * w[:, None]
            acc = p if j == 0 else acc + p
        tl.store(out_ptr + t64[:, None] * stride_om + cols[None, :], round_as(acc, out_ptr).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _w2_combine_kernel(a_ptr, ids_ptr, wts_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, out_ptr, cnt_ptr, one,
                       S, E, T, H, K, N, stride_am, stride_we, stride_wn, stride_wk,
                       stride_wse, stride_wsn, stride_wsk, stride_be, stride_ym, stride_wt, stride_om,
                       GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                       FMAX: tl.constexpr, TOKEN_FLOOR: tl.constexpr, GROUP_FLOOR: tl.constexpr,
                       BINS: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """y[slot, n] = a[slot] @ W2_e[n] for the p-th expert; the tile's last program combines it."""
    e, n, total = _routed_expert(ids_ptr, S, E, tl.program_id(0), BINS, LANES)
    if n > 0:
        e64 = e.to(tl.int64)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = (offs_n % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + e64 * stride_we + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
        ws_ptrs = ws_ptr + e64 * stride_wse + (rn // 128 if GROUP else rn) * stride_wsn
        for c0 in range(0, n, BLOCK_M):
            slot, valid = _slots_of(ids_ptr, S, e, c0, BLOCK_M, LANES)
            rows = a_ptr + _quantized_slots(ids_ptr, S, e, c0, slot, ROWS, BLOCK_M, LANES).to(tl.int64)[:, None] \
                * stride_am                                                      # [ROWS, 1]
            s_tok = tl.zeros((ROWS,), dtype=tl.float32)
            if not GROUP:
                s_tok = _token_scales(rows, K, FMAX, TOKEN_FLOOR, ROWS, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                a, sa = _quantized(rows, kk, K, s_tok, w_ptr, GROUP, FMAX, GROUP_FLOOR, BLOCK_M, BLOCK_K)
                acc = _accumulate(acc, a, sa, w_ptrs + k0 * stride_wk, ws_ptrs, k0, kk < K, stride_wsk, one, GROUP)
            if not GROUP:
                acc = acc * (tl.broadcast_to(s_tok, (BLOCK_M,))[:, None] * tl.load(ws_ptrs)[None, :])
            if HAS_BIAS:
                acc += tl.load(b_ptr + e64 * stride_be + rn).to(tl.float32)[None, :]
            y_ptrs = y_ptr + slot.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
            tl.store(y_ptrs, round_as(acc, y_ptr).to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])
        tl.debug_barrier()   # every thread's rows are written before the ticket is drawn
        ticket = tl.atomic_add(cnt_ptr + pid_n, n, sem="acq_rel")
        if ticket + n == total:   # every routed slot of this tile is in y
            _combine_tile(y_ptr, wts_ptr, out_ptr, T, H, offs_n, stride_ym, stride_wt, stride_om, TOP_K, BLOCK_T,
                          BLOCK_N)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def direct_counters(hp: int, device: torch.device | str) -> torch.Tensor:
    """The combine's ticket counters of a layer of hidden size Hp: int32 zeros, one per output tile of
    MIN_BLOCK_N or more columns (zero again after every launch). A layer keeps one for its life."""
    return torch.zeros(cdiv(hp, MIN_BLOCK_N), dtype=torch.int32, device=device)


def _weight_strides(w_s: torch.Tensor, group: bool) -> tuple[int, int, int]:
    """(expert, row, K-block) strides of a weight scale: block [E, R/128, K/128], channel [E, R, 1], tensor [E]."""
    if group:
        return w_s.stride()
    return (w_s.stride(0), 0, 0) if w_s.dim() == 1 else (w_s.stride(0), w_s.stride(1), 0)


def direct_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w13_bias: torch.Tensor | None,
                   w2_bias: torch.Tensor | None, gate, path: MoePath, counters: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """`x [T, H]` routed by `top_k_index [T, k]` (ids in [0, E)) with `top_k_weights [T, k]` through
    experts w13 [E, 2Ip, Hp], w2 [E, Hp, Ip] (fp8, scales as stored) -> [T, H] in x.dtype; `gate` has
    .kind/.alpha/.limit (triton_moe.Gate); `counters`: `direct_counters(Hp)` (None: zeros per call)."""
    require_triton()
    if gate.kind not in GATE_CODES:
        raise ValueError(f"direct_forward: unknown gate {gate.kind!r}; valid: {', '.join(GATE_CODES)}")
    t, k = top_k_index.shape
    e, hp, ip = w2.shape
    h = x.shape[1]
    if x.stride(1) != 1 or h > hp or w13.shape != (e, 2 * ip, hp):
        raise ValueError(f"direct_forward: x [T, H<={hp}] row-major and w13 [{e}, {2 * ip}, {hp}] expected, got "
                         f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}")
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    s = t * k
    if s == 0 or h == 0:
        return out
    if counters is None:
        counters = direct_counters(hp, x.device)
    if counters.dtype != torch.int32 or counters.numel() < cdiv(hp, path.block_n) or path.block_n < 2 * MIN_BLOCK_N:
        raise ValueError(f"direct_forward: counters must be direct_counters({hp}) (int32 zeros), got "
                         f"{counters.dtype} [{counters.numel()}] for BLOCK_N={path.block_n}")
    ids = top_k_index.reshape(-1)
    ids = ids if ids.stride(0) == 1 else ids.contiguous()
    wts = top_k_weights if top_k_weights.stride(1) == 1 else top_k_weights.contiguous()
    a = torch.empty((s, ip), dtype=x.dtype, device=x.device)
    y = torch.empty((s, hp), dtype=x.dtype, device=x.device)
    group = path.scheme is Scheme.BLOCK
    common = dict(GROUP=group, ROWS=1 if t == 1 else path.block_m, FMAX=E4M3FN.fmax, TOKEN_FLOOR=E4M3FN.min_scale,
                  GROUP_FLOOR=GROUP_AMAX_FLOOR, BINS=pow2(e + 1), LANES=_LANES, BLOCK_M=path.block_m,
                  BLOCK_N=path.block_n,
                  BLOCK_K=SCALE_BLOCK, num_warps=path.num_warps, num_stages=path.num_stages)
    programs, half = min(s, e), path.block_n // 2
    _w13_gated_kernel[(programs, cdiv(ip, half))](
        x, ids, w13, w13_scale, w13_bias if w13_bias is not None else w13_scale, a, 1.0, gate.alpha, gate.limit,
        s, e, h, hp, ip, k, x.stride(0), *w13.stride(), *_weight_strides(w13_scale, group),
        w13_bias.stride(0) if w13_bias is not None else 0, a.stride(0),
        GATE=GATE_CODES[gate.kind], HAS_BIAS=w13_bias is not None, **dict(common, BLOCK_N=half))
    _w2_combine_kernel[(programs, cdiv(hp, path.block_n))](
        a, ids, wts, w2, w2_scale, w2_bias if w2_bias is not None else w2_scale, y, out, counters, 1.0,
        s, e, t, h, ip, hp, a.stride(0), *w2.stride(), *_weight_strides(w2_scale, group),
        w2_bias.stride(0) if w2_bias is not None else 0, y.stride(0), wts.stride(0), out.stride(0),
        HAS_BIAS=w2_bias is not None, TOP_K=k, BLOCK_T=_BLOCK_T, **common)
    return out
