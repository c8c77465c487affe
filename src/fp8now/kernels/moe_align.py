"""Routing alignment for the grouped MoE GEMMs: routed slots sorted by expert, each expert's run padded to
a multiple of BLOCK_M, and the expert of every BLOCK_M rows, with no host sync (the sizes come from a
static bound on T*k, never from the routing), so a CUDA graph can capture it.

Three implementations with the same result: `align` in torch ops (a sort and about twenty small kernels,
each a host launch: the restatement the tests hold the others to), `align_triton`, one single-program
Triton launch (a counting sort) for the few slots of decode-sized calls, and `align_chunked`, two
launches of many programs for any size (per-chunk expert counts, then each chunk places its own slots
after the earlier chunks' and writes the padding of its share of the blocks).
A slot is one (token, choice) pair: slot = t * k + j for `top_k_index [T, k]`; every id must lie in
[0, E) (routers pick among E experts): other ids are not placed, and their slots' rows stay unwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_quant import pow2
from .triton_support import require_triton, tl, triton

_CHUNK = 64    # slots per step of the counting sort (a [CHUNK, CHUNK] rank comparison per step)
_MAX_CHUNKS = 64   # programs of align_chunked (each sums every chunk's counts: [chunks, E + 1] int32)


class Routing(NamedTuple):
    """Slots sorted by expert in runs padded to BLOCK_M rows, and the expert of each BLOCK_M rows."""

    slots: torch.Tensor          # [blocks * BLOCK_M] int32: slot id, or -1 for a padding row
    block_expert: torch.Tensor   # [blocks] int32: the expert of each BLOCK_M rows, or -1 (unused block)
    block_m: int


def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Upper bound on the padded blocks: sum_e ceil(c_e / BM) <= floor(S / BM) + (experts with tokens)."""
    return slots // block_m + min(experts, slots)


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """`top_k_index [T, k]` (ids in [0, E)) -> the sorted, padded slots and the expert of each block.

    Slots of one expert keep their ascending order (stable sort), so a slot's position inside its block
    does not depend on the routing of tokens that went elsewhere."""
    flat = top_k_index.reshape(-1).long()                               # [S]
    s, dev = flat.numel(), flat.device
    blocks = max_blocks(s, num_experts, block_m)
    expert_sorted, order = torch.sort(flat, stable=True)                # [S], [S]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))                 # [E] (bincount would sync)
    padded = (counts + block_m - 1) // block_m * block_m                # [E]
    padded_end = torch.cumsum(padded, 0)                                # [E]
    first = torch.cumsum(counts, 0) - counts                            # [E] first sorted position
    dest = (padded_end - padded)[expert_sorted] + torch.arange(s, device=dev) - first[expert_sorted]
    slots = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=dev)
    slots.scatter_(0, dest, order.to(torch.int32))
    row0 = torch.arange(blocks, device=dev) * block_m                   # [blocks] first row of each block
    owner = torch.searchsorted(padded_end, row0, right=True)            # experts whose run ends <= row0
    block_expert = torch.where(row0 < padded_end[-1:], owner, -1).to(torch.int32)
    return Routing(slots, block_expert, block_m)


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_expert_ptr, S, E, BLOCKS,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    """One program: expert histogram, padded run starts, block owners, then a stable counting sort."""
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, S, CHUNK):   # ids out of [0, E) (and lanes past S) land in the spare last bin
        e = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < S, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((e >= 0) & (e < E), e, BINS - 1), BINS)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    for b0 in range(0, BLOCKS, CHUNK):   # owner of a block: the experts whose run ends at or before it
        row0 = (b0 + lanes) * BLOCK_M
        owner = tl.sum((padded_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b0 + lanes, tl.where(row0 < total, owner, -1), mask=b0 + lanes < BLOCKS)
    for r0 in range(0, BLOCKS * BLOCK_M, CHUNK):
        tl.store(slots_ptr + r0 + lanes, tl.full([CHUNK], -1, tl.int32), mask=r0 + lanes < BLOCKS * BLOCK_M)
    tl.debug_barrier()   # the padding's -1 is written before any slot lands on its row
    cursor = padded_end - padded   # next free row of each expert's run
    for c0 in range(0, S, CHUNK):
        cursor = _place(ids_ptr, slots_ptr, c0 + lanes, S, E, cursor, bins, lanes, BINS)


@triton.jit
def _place(ids_ptr, slots_ptr, i, end, E, cursor, bins, lanes, BINS: tl.constexpr):
    """One step of the stable counting sort: slots `i` (< end) go to their expert's next free rows
    (`cursor` [BINS]), in ascending order within an expert; -> the cursor after them."""
    e = tl.load(ids_ptr + i, mask=i < end, other=-1).to(tl.int32)
    ok = (i < end) & (e >= 0) & (e < E)
    e = tl.where(ok, e, BINS - 1)
    earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])   # same expert, before
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.sum(tl.where(e[:, None] == bins[None, :], cursor[None, :], 0), axis=1)
    tl.store(slots_ptr + base + rank, i, mask=ok)
    return cursor + tl.histogram(e, BINS)


def _outputs(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """(the ids flat and contiguous, their count, the blocks, and the Routing tensors to fill)."""
    require_triton()
    flat = top_k_index.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    blocks = max_blocks(flat.numel(), num_experts, block_m)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    return flat, flat.numel(), blocks, slots, torch.empty(blocks, dtype=torch.int32, device=flat.device)


def align_triton(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """`align` in one single-program launch (for few slots: it walks them CHUNK at a time)."""
    flat, s, blocks, slots, block_expert = _outputs(top_k_index, num_experts, block_m)
    if blocks:
        _align_kernel[(1,)](flat, slots, block_expert, s, num_experts, blocks,
                            BLOCK_M=block_m, BINS=pow2(num_experts + 1), CHUNK=_CHUNK, num_warps=4)
    return Routing(slots, block_expert, block_m)


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, S, E, CHUNK, BINS: tl.constexpr, LANES: tl.constexpr):
    """Program c: the expert histogram of slots [c * CHUNK, (c + 1) * CHUNK) -> counts[c, :BINS]."""
    c = tl.program_id(0)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, LANES)
    counts = tl.zeros([BINS], dtype=tl.int32)
    end = tl.minimum(S, (c + 1) * CHUNK)
    for s0 in range(c * CHUNK, end, LANES):   # other ids (and lanes past the chunk) in the spare last bin
        e = tl.load(ids_ptr + s0 + lanes, mask=s0 + lanes < end, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((e >= 0) & (e < E), e, BINS - 1), BINS)
    tl.store(counts_ptr + c * BINS + bins, tl.where(bins < E, counts, 0))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, slots_ptr, block_expert_ptr, S, E, CHUNK, CHUNKS, BLOCKS,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, LANES: tl.constexpr):
    """Program c: every expert's run from all chunks' counts; then its share of the blocks (owner, and
    -1 on their padding rows) and its own chunk's slots, after those of the earlier chunks."""
    c = tl.program_id(0)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, LANES)
    totals = tl.zeros([BINS], dtype=tl.int32)
    before = tl.zeros([BINS], dtype=tl.int32)
    for r in range(0, CHUNKS):
        row = tl.load(counts_ptr + r * BINS + bins)
        totals += row
        before += tl.where(r < c, row, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = padded_end - padded
    used = tl.sum(padded, axis=0)
    share = tl.cdiv(BLOCKS, CHUNKS)
    b_end = tl.minimum(BLOCKS, (c + 1) * share)
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(c * share, b_end, LANES):   # this program's blocks: owner, and -1 on padding rows
        b = b0 + lanes                          # only (the slots' rows are disjoint from them)
        mine = b < b_end
        row0 = b * BLOCK_M
        live = row0 < used
        owner = tl.sum((padded_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(live, owner, -1), mask=mine)
        in_use = tl.sum(tl.where(owner[:, None] == bins[None, :], (start + totals)[None, :], 0), axis=1) - row0
        pad = (rows[None, :] >= tl.where(live, in_use, 0)[:, None]) & mine[:, None]      # [LANES, BLOCK_M]
        tl.store(slots_ptr + row0[:, None] + rows[None, :], tl.full([LANES, BLOCK_M], -1, tl.int32), mask=pad)
    cursor = start + before   # this chunk's first row in each expert's run
    end = tl.minimum(S, (c + 1) * CHUNK)
    for s0 in range(c * CHUNK, end, LANES):
        cursor = _place(ids_ptr, slots_ptr, s0 + lanes, end, E, cursor, bins, lanes, BINS)


def align_chunked(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """`align` in two launches of up to 64 programs (for any number of slots)."""
    flat, s, blocks, slots, block_expert = _outputs(top_k_index, num_experts, block_m)
    if not s:
        return Routing(slots, block_expert, block_m)
    chunk = max(_CHUNK, pow2(-(-s // _MAX_CHUNKS)))
    chunks, bins = -(-s // chunk), pow2(num_experts + 1)
    counts = torch.empty((chunks, bins), dtype=torch.int32, device=flat.device)
    _chunk_counts_kernel[(chunks,)](flat, counts, s, num_experts, chunk, BINS=bins, LANES=_CHUNK, num_warps=4)
    _place_kernel[(chunks,)](flat, counts, slots, block_expert, s, num_experts, chunk, chunks, blocks,
                             BLOCK_M=block_m, BINS=bins, LANES=_CHUNK, num_warps=4)
    return Routing(slots, block_expert, block_m)
