"""The kernel plan: one pure function decides what a layer call runs, from a threshold table per device class.

`plan(backend, scheme, act, m, n, k, device_class, batch_invariant, compiling)` returns a `Path`: the
activation quantizer, the GEMM, and the launch details the backend executes, nothing else. Its
thresholds live in `Table` (a frozen dataclass; one per device class in `TABLES`), so a test or a
tuning run passes another table instead of patching module state. The load report shows
`plan(...).name` per layer at a few token counts; the measurements behind the numbers are in
BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import torch

from ..config import Scheme

DECODE_MAX_M = 16   # rows of the split-K decode kernel's one row tile (triton_decode.MAX_M)
GEMV_MAX_M = 4      # rows the GEMV holds accumulators for (triton_gemv.MAX_M)
WIDE = 1 << 62      # an open upper end of an N range
PRODUCERS = ("rmsnorm", "silu-mul")   # ops whose kernel can quantize the input of the linears after them


# Every GEMM that can quantize its own bf16 input, with its largest M (for Table.quant_inside).
QUANT_INSIDE = (("triton-gemv", GEMV_MAX_M), ("triton-decode", DECODE_MAX_M),
                ("triton-decode-exchange", DECODE_MAX_M))


@dataclass(frozen=True)
class Table:
    """The per-call thresholds of the triton backend (ranges of N are inclusive)."""

    # M at or below which the split-K Triton GEMMs beat cuBLAS (few output tiles need K split over the SMs)
    rowwise_max_m: int = 64          # token scales; above: cuBLAS rowwise
    block_max_m: int = 32            # group scales; above: `block_large`
    block_large: str = "cublas"      # "cublas" (blockwise, where cuBLAS takes K) or "triton"
    # the GEMV after the Triton quantizer: (scheme, GEMV rows bucket, lowest N, highest N) rows; none: never.
    # Only one row: with 2-4 rows the per-row accumulators leave fewer weight bytes in flight than the
    # decode kernel; wide tensor layers go to cuBLAS tensorwise instead.
    gemv: tuple[tuple[str, int, int, int], ...] = (
        ("tensor", 1, 0, 6144), ("channel", 1, 0, WIDE), ("block", 1, 4096, WIDE))
    tensorwise_m1: bool = True       # tensor scheme, M = 1: cuBLAS tensorwise (one row's scale is per-tensor)
    pdl_max_m: int = 4               # token decode: start the GEMM while the quantizer runs up to this M
    fused_block_max_n: int = 8192    # block, M = 1: one launch that quantizes its own groups, while few tiles
    # decode with few K splits (token: two added by exchange): below, too few programs; above, the output
    # tiles alone fill the GPU and the exchange's atomics cost more than the ticket
    few_splits_n: tuple[int, int] = (4096, 8192)
    # token scales, DECODE_MAX_M < M <= rowwise_max_m: the rowwise GEMM's config overrides by N, (lowest N,
    # highest N, config) rows; none: the block table's. 5 stages and K in 2 splits (N < 8192) or 1 (wider),
    # against the block table's 4 stages and automatic split (8 splits of 4 K-blocks on Llama-3.1-8B's q/k/v/o):
    # on the H100 at 64 rows, Llama-3.1-8B's four shapes, 129 µs a layer against 145, and the B = 64 step's
    # quantized layers at 0.64x bf16's GEMMs (BENCHMARKS.md "Whole model", "What the probes answered").
    # BLOCK_K stays 128: every 128-deep K block is promoted to float32.
    rowwise_mid: tuple[tuple[int, int, tuple[tuple[str, int], ...]], ...] = (
        (0, 8191, (("BLOCK_N", 64), ("GROUP_M", 1), ("num_stages", 5), ("SPLIT_K", 2))),
        (8192, WIDE, (("BLOCK_N", 64), ("GROUP_M", 1), ("num_stages", 5), ("SPLIT_K", 1))))
    # under torch.compile, these kinds quantize with torch ops that inductor fuses into the producer
    # (1x128 groups: inductor splits them into passes that recompute the producer, so not "group")
    compiled_quant: tuple[str, ...] = ("token",)
    # GEMMs that quantize their own bf16 input, no quantizer launch: (GEMM, up to M) rows (QUANT_INSIDE
    # lists them all). The GEMV and the decode kernel recompute the row amax over K in every program (the rows
    # sit in L2). Off: on the H100 (BENCHMARKS.md "Decode fusions") the fused GEMV took 0.97-1.18x the time of
    # quantizer + GEMV at M = 1 and the fused decode kernels 1.0-3.7x at M = 8.
    quant_inside: tuple[tuple[str, int], ...] = ()
    # transformers' ops in front of FP8 linears that run as one Triton kernel (fp8now.layers.producers):
    # "rmsnorm" (Llama / Qwen3 RMSNorm -> q/k/v, gate/up), "silu-mul" (act_fn(gate) * up -> down_proj).
    # On: Llama-3.1-8B on the H100 (BENCHMARKS.md "Whole model") ran 1.07-1.25x faster with them in every
    # prefill and decode row. Their bf16 output is transformers' up to the order of the norm's sum;
    # Table(producer_kernels=()) runs transformers' own ops.
    producer_kernels: tuple[str, ...] = PRODUCERS
    # of those, the ones whose kernel also writes the FP8 bytes + scales its consumers read instead of
    # quantizing its bf16 output themselves (the same bytes)
    producer_quant: tuple[str, ...] = PRODUCERS
    # Qwen3's per-head q/k RMSNorms as one Triton kernel each (fp8now.layers.head_norm; also needs "rmsnorm" in
    # producer_kernels): 8 elementwise launches -> 1, twice a layer
    head_norm_kernel: bool = True
    # one-token calls of sibling linears fed by one RMSNorm producer (q/k/v; gate/up), whose weights are row
    # slices of one buffer (fp8now.layers.stacked): one GEMV launch for all of them instead of one each (the
    # same config and bytes). On: Llama-3.1-8B's one-token decode on an H100 ran 1.34x -> 1.44x bf16 in one call
    # (BENCHMARKS.md "Whole model"); batches of 2+ rows do not stack.
    stacked_gemv: bool = True


# Device class -> table. Only "cuda-fp8" runs the triton backend; its numbers come from the H200.
TABLES: Mapping[str, Table] = MappingProxyType({"cuda-fp8": Table(), "cuda": Table(), "cpu": Table()})


@dataclass(frozen=True)
class Path:
    """What one call runs: `quant` computes the activation's `act` scales ("triton", "torch" ops,
    "fused" into the GEMM kernel, a producer's name (`PRODUCERS`: the kernel in front of the layer wrote
    them), or "none": left in bf16/fp16), then `gemm` with `config` overrides
    (e.g. SPLIT_K, num_stages), as a programmatic dependent launch if `pdl` (sm_90), with one fixed
    configuration for every M if `invariant`, accumulating all of K in the tensor cores' own
    accumulator if `fast_accum` (only GEMMs in FAST_ACCUM_GEMMS)."""

    scheme: Scheme
    act: str
    quant: str
    gemm: str
    config: tuple[tuple[str, int], ...] = ()
    pdl: bool = False
    invariant: bool = False
    fast_accum: bool = False

    @property
    def name(self) -> str:
        """E.g. "triton-token + triton-decode-exchange (SPLIT_K=2, num_stages=6, pdl)"."""
        head = self.gemm if self.quant == "none" else f"{self.quant}-{self.act} + {self.gemm}"
        notes = [f"{key}={value}" for key, value in self.config]
        notes += ["pdl"] * self.pdl + ["batch-invariant"] * self.invariant + ["fast-accum"] * self.fast_accum
        return head + (f" ({', '.join(notes)})" if notes else "")


# GEMMs with a fast-accumulation variant (Fp8Config.fast_accum): the tensor-core ones of the tensor and
# channel schemes. Not the GEMV (CUDA-core float32 products: nothing to speed up) nor the block GEMMs
# (each K-block's product leaves the accumulator to take its scales).
FAST_ACCUM_GEMMS = frozenset({"triton-rowwise", "triton-decode", "triton-decode-exchange", "cublas-rowwise",
                              "cublas-tensorwise"})


class Weights(NamedTuple):
    """What a layer hands its backend on every call: its FP8 weight, scales, bias, and the scratch its
    backend's `workspace` hook allocated once (None for backends without one)."""

    w_q: torch.Tensor                # [N, K] float8_e4m3fn
    w_scale: torch.Tensor            # [] / [N, 1] / [ceil(N/128), ceil(K/128)] float32
    bias: torch.Tensor | None        # [N]
    workspace: torch.Tensor | None


def few_splits(n: int, k: int) -> int:
    """K splits of the few-split decode: 2, or 4 for a long K on under 128 output tiles of 64."""
    return 2 if k <= 8192 or n >= 8192 else 4


def rows_bucket(m: int) -> int:
    """The GEMV's rows for M rows: the next power of two (rows past M repeat real ones, stores masked)."""
    return 1 << max(m - 1, 0).bit_length()


def blockwise_unfit(k: int) -> str | None:
    """None if cuBLAS blockwise scaling takes this K, else why not: the weight scale's leading dimension
    K/128 must be a multiple of 4 (16-byte aligned) or cuBLAS answers NOT_SUPPORTED (checked on the H200
    against the float64 product; BENCHMARKS.md)."""
    if k % 512:
        return f"blockwise scaled_mm needs K divisible by 512 (K={k}): cuBLAS wants K/128 scales 16-byte aligned"
    return None


def _triton(scheme: Scheme, m: int, n: int, k: int, invariant: bool, compiling: bool, t: Table,
            producer: str | None = None) -> Path:
    """The triton backend: the producer's FP8 bytes where it writes them (`producer`: the op in front of
    the layer), else the GEMM's own quantization where the table says, else the Triton quantizer (torch
    ops under compile where the table says); the GEMM by M."""
    act = "group" if scheme is Scheme.BLOCK else "token"
    produced = producer in t.producer_quant and producer in t.producer_kernels
    quant = producer if produced else "torch" if compiling and act in t.compiled_quant else "triton"
    inside = dict(t.quant_inside)

    def path(gemm: str, config: dict | None = None, pdl: bool = False, how: str = quant) -> Path:
        if produced:
            how = quant
        elif how == "triton" and m <= inside.get(gemm, 0):
            how = "fused"
        pdl = pdl and how == "triton" and not compiling   # a programmatic dependent of the quantizer only
        return Path(scheme, act, how, gemm, tuple((config or {}).items()), pdl, invariant)

    if invariant:
        return path("triton-block" if act == "group" else "triton-rowwise")
    few = t.few_splits_n[0] <= n <= t.few_splits_n[1]
    if m <= DECODE_MAX_M:
        bucket = rows_bucket(m)
        if m <= GEMV_MAX_M and any(s == scheme.value and r == bucket and lo <= n <= hi for s, r, lo, hi in t.gemv):
            return path("triton-gemv", pdl=True)
        if scheme is Scheme.TENSOR and m == 1 and t.tensorwise_m1:
            return path("cublas-tensorwise")
        if act == "token":
            pdl = m <= t.pdl_max_m
            if not few:
                return path("triton-decode", pdl=pdl)
            splits = few_splits(n, k)
            return path("triton-decode-exchange" if splits == 2 else "triton-decode",
                        dict(SPLIT_K=splits, num_stages=6), pdl)
        if m == 1 and n <= t.fused_block_max_n:
            return path("triton-decode", how="fused")
        if few:
            return path("triton-decode", dict(SPLIT_K=2 * few_splits(n, k)))
    if act == "group":
        if m > t.block_max_m and t.block_large == "cublas" and blockwise_unfit(k) is None:
            return path("cublas-blockwise")
        return path("triton-block")
    if m > t.rowwise_max_m:
        return path("cublas-rowwise")
    # (M <= DECODE_MAX_M returned above)
    return path("triton-rowwise", next((dict(config) for lo, hi, config in t.rowwise_mid if lo <= n <= hi), None))


def _torch(scheme: Scheme, act: str, dclass: str) -> Path:
    """The torch backend: numerics' quantizer, then `_scaled_mm` (cuBLAS on a GPU, torch's own on CPU)."""
    lib = "torch" if dclass == "cpu" else "cublas"
    if scheme is Scheme.BLOCK:
        return Path(scheme, act, "torch", f"{lib}-blockwise")
    tensorwise = scheme is Scheme.TENSOR and act == "tensor"
    return Path(scheme, act, "torch", f"{lib}-{'tensorwise' if tensorwise else 'rowwise'}")


# Backend -> its planner (scheme, act, m, n, k, device class, batch_invariant, compiling, table) -> Path.
# Only the triton backend takes a producer's FP8 bytes (`p`); the others quantize their input themselves.
PLANNERS: Mapping[str, Callable[..., Path]] = MappingProxyType({
    "triton": lambda s, a, m, n, k, d, bi, c, t, p: _triton(s, m, n, k, bi, c, t, p),
    "torch": lambda s, a, m, n, k, d, bi, c, t, p: _torch(s, a, d),
    "reference": lambda s, a, m, n, k, d, bi, c, t, p: Path(s, a, "torch", "reference"),
    # cpu: its own quantizer widens the FP8 activation to bf16, then one oneDNN bf16 GEMM on the working copy
    "cpu": lambda s, a, m, n, k, d, bi, c, t, p: Path(s, a, "cpu", "bf16-matmul", invariant=bi),
    "triton-w8a16": lambda s, a, m, n, k, d, bi, c, t, p: Path(s, a, "none", "triton-w8a16"),
})


# The sorted path's grouped GEMMs launch their programs in groups of M-blocks whose FP8 A rows fill about this
# many bytes of L2 (50 MB on an H100 / H200), each group walking every N tile before the next starts
# (`triton_moe.group_m`), so A is read from HBM about once. Launched M-blocks first (every M-block of one N tile,
# then the next tile), a layer whose A outgrows L2 re-reads all of it for every N tile: Mixtral-8x7B's w13 at
# 16384 tokens, 134 MB of gathered A rows x 224 N tiles, ~30 GB (BENCHMARKS.md, "MoE experts layer").
A_REUSE_BYTES = 16 << 20


@dataclass(frozen=True)
class MoeTable:
    """Launch configs of the grouped MoE GEMMs: rows (mean routed rows per expert up to, BLOCK_M,
    BLOCK_N, num_warps, num_stages), the last row open-ended (None); `invariant`: the one config of
    batch-invariant mode, the same for every T (BLOCK_M, BLOCK_N, num_warps, num_stages). Up to
    `direct_max_tokens` tokens and `direct_max_slots` routed slots (T * k) the "direct" kernels take each
    expert's slots from the ids themselves (`triton_moe_direct`: two launches; each program re-reads the ids,
    so only for few slots; any number gives the sorted path's bytes), except in batch-invariant mode; else the
    "sorted" path aligns the routing first: up to `triton_align_max_slots` slots by the one-program Triton counting sort, above by the two-launch
    chunked one (same result as the torch ops of `moe_align.align`)."""

    # 8 warps from 32 x 128 up: with 4, sm_90's ptxas (Triton 3.6's) spills 9.9 KB (32 x 128) and 2.9 KB
    # (64 x 128) of the grouped GEMM's registers, with 8 0.5 and 0.7 KB (BENCHMARKS.md, "MoE experts layer");
    # 64 x 256 up to 256 rows an expert: 876 against 973 µs (64 x 128) at Qwen3-30B-A3B's 4096 tokens on an H100
    rows: tuple[tuple[int | None, int, int, int, int], ...] = (
        (16, 16, 64, 4, 4), (64, 32, 128, 8, 4), (256, 64, 256, 8, 4), (None, 128, 128, 8, 4))
    invariant: tuple[int, int, int, int] = (64, 64, 4, 4)
    # The direct kernels' two launches beat the sorted path's six at one token, where every hit expert takes one row
    # (H100, tune_moe, d809d09: Qwen3-30B-A3B 32.0 against 44.7 µs; Mixtral-8x7B 164 against 175), and lose from two
    # (Qwen3 2 / 4 / 8 tokens: 64 / 112 / 186 against 58 / 77 / 129 µs; Mixtral 362 / 511 / 634 against 226 / 341 /
    # 468): a slot bound alone cannot say it (Mixtral's 4 slots lose, Qwen3's 8 win). `direct_max_slots` bounds
    # the ids each program scans.
    direct_max_tokens: int = 1
    direct_max_slots: int = 64
    # The one-program counting sort against the chunked two-launch one (H200, tune_moe, e2fea59): a little ahead up to
    # 64 slots (Qwen3-30B-A3B 4 / 8 tokens: 69.3 / 109.7 against 70.9 / 111.9 µs), even at 128 (Mixtral-8x7B 64
    # tokens: 419.0 / 418.7), behind from 512 (Qwen3 64 tokens: 227.1 against 200.1; the 37 µs a call at 512 slots
    # in its B = 64 decode step on an H100) and far behind at 16384 (1,515 against 496 µs)
    triton_align_max_slots: int = 128
    a_reuse_bytes: int = A_REUSE_BYTES


MOE_TABLES: Mapping[str, MoeTable] = MappingProxyType({"cuda-fp8": MoeTable(), "cpu": MoeTable()})


@dataclass(frozen=True)
class MoePath:
    """What one experts call runs: `kernel` "sorted": routed rows sorted by expert in runs of `block_m`
    (by the `align` implementation: "triton", "triton-chunked" or "torch"), the activation quantizer,
    the two grouped GEMMs on `block_m x block_n` tiles (K in 128-steps), the gate and the combine; or
    "direct" (align "none"): two launches that find each expert's slots in the ids, quantize inside
    the GEMMs, gate in the w13 epilogue and combine after the w2 GEMM. One config for every T if
    `invariant`. `fast_accum` (sorted path, per-token scales: `Fp8Config(fast_accum=True)`): the grouped GEMMs
    keep all of K in the tensor cores' accumulator instead of promoting every 128-deep block to float32.
    `a_reuse_bytes` (sorted path): the FP8 A rows a group of M-blocks holds in L2 while it walks every N tile
    (A_REUSE_BYTES; 0: M-blocks fastest). The launch order only: the bytes are the same in every order."""

    scheme: Scheme
    act: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    invariant: bool = False
    align: str = "torch"
    kernel: str = "sorted"
    fast_accum: bool = False
    a_reuse_bytes: int = A_REUSE_BYTES

    @property
    def name(self) -> str:
        """E.g. "triton-token + triton-moe (align=triton, BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)",
        "fused-token + triton-moe-direct (BLOCK_M=16, ...)"."""
        notes = f"BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, num_warps={self.num_warps}, " \
                f"num_stages={self.num_stages}" + ", batch-invariant" * self.invariant \
            + ", fast-accum" * self.fast_accum \
            + (f", A reuse {self.a_reuse_bytes / 2 ** 20:g} MiB" if self.a_reuse_bytes else ", no A reuse") \
            * (self.kernel == "sorted")
        if self.kernel == "direct":
            return f"fused-{self.act} + triton-moe-direct ({notes})"
        return f"triton-{self.act} + triton-moe (align={self.align}, {notes})"


def moe_plan(scheme: Scheme, tokens: int, top_k: int, experts: int, device_class: str = "cuda-fp8",
             batch_invariant: bool = False, table: MoeTable | None = None, compiling: bool = False,
             fast_accum: bool = False) -> MoePath:
    """The grouped-GEMM path of one experts call on `tokens` tokens routed to `top_k` of `experts`.
    `compiling` (torch.compile tracing the call): the sorted path only (Inductor 2.11's functionalization of
    Triton launches, decompose_triton_kernel_wrapper_functional, fails on the direct kernels: AssertionError).
    `fast_accum`: the sorted path's grouped GEMMs accumulate fast (per-token scales only; the direct kernels of
    few tokens, reading weights at memory speed, keep promoting)."""
    scheme = Scheme.parse(scheme)
    table = table or MOE_TABLES.get(device_class, MoeTable())
    act = "group" if scheme is Scheme.BLOCK else "token"
    slots = tokens * top_k
    align = "triton" if slots <= table.triton_align_max_slots else "triton-chunked"
    if batch_invariant:   # the alignment's result does not depend on its implementation
        return MoePath(scheme, act, *table.invariant, invariant=True, align=align, a_reuse_bytes=table.a_reuse_bytes)
    per_expert = slots / max(experts, 1)
    bound, *config = next(r for r in table.rows if r[0] is None or per_expert <= r[0])
    if tokens <= table.direct_max_tokens and slots <= table.direct_max_slots and not compiling:
        return MoePath(scheme, act, *config, align="none", kernel="direct")
    return MoePath(scheme, act, *config, align=align, fast_accum=fast_accum and act == "token",
                   a_reuse_bytes=table.a_reuse_bytes)


def plan(backend: str, scheme: Scheme, act: str, m: int, n: int, k: int, device_class: str,
         batch_invariant: bool = False, compiling: bool = False, table: Table | None = None,
         fast_accum: bool = False, producer: str | None = None) -> Path:
    """The path of one call of `backend` on x [M, K] and a weight [N, K] (`compiling`: under torch.compile);
    `table` defaults to the device class's; `fast_accum` marks the GEMMs that have the mode; `producer`:
    the op in front of the layer whose kernel can hand it the FP8 activation (`PRODUCERS`), if any."""
    if backend not in PLANNERS:
        raise ValueError(f"no plan for backend {backend!r}; known: {', '.join(PLANNERS)}")
    if producer is not None and producer not in PRODUCERS:
        raise ValueError(f"unknown producer {producer!r}; known: {', '.join(PRODUCERS)}")
    if table is None:
        table = TABLES[device_class]
    path = PLANNERS[backend](Scheme.parse(scheme), act, m, n, k, device_class, batch_invariant, compiling,
                             table, producer)
    return replace(path, fast_accum=True) if fast_accum and path.gemm in FAST_ACCUM_GEMMS else path
