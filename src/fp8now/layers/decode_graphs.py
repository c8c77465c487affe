"""Eager small-batch calls through per-layer CUDA graphs: a layer's call at M <= 256 is captured once,
then replayed.

Why: at small M an eager `Fp8Linear` call on the triton backend is host-bound. Its two launches cost
60-175 µs of Python and driver time per call on the H200's host (a Triton launch alone 30-60 µs),
against 20-60 µs of GPU work, so eager decode ran at 0.2-0.3x of bf16 `F.linear` (~18-30 µs of host
per call) and M = 64-256 at 0.07-0.8x (BENCHMARKS.md, "Host cost of an eager call"). A replay is
three cheap host operations: copy x into the graph's input buffer, replay, clone the graph's output.

When: the triton backend on CUDA, M <= max_rows(N, K) (at most MAX_M; none for layers whose call is
GPU-bound anyway, such as 57344 x 8192), and not while torch.compile traces, not while a CUDA
graph is being captured (the caller's graph then holds the plain launches), not when autograd would
need to see the call. A shape (M, dtype, stream) is captured the second time it is seen (the first
call runs plainly and compiles the kernels), at most MAX_GRAPHS shapes per layer and stream (later ones
run plainly: no eviction, so varying batch sizes never thrash captures). The cap counts per stream
because a caller's warm-up on a side stream (the usual prelude to capturing a whole model) captures
there too: with one cap per layer, the warm-ups of two batch sizes used up every slot and the default
stream's decode calls at a third batch size launched plainly, 0.4-0.5x bf16 in an eager 4-layer
forward at B = 64 (BENCHMARKS.md, "Whole model"). Streams come from torch's fixed per-device pools,
so the per-stream count stays bounded. A capture costs about a
millisecond once. The graphs bake in the addresses of the layer's weight, scale, bias and split-K
counters: an in-place reload (`load_`, `reload_weights`) keeps them and the graphs stay valid; a
changed address drops the graph.

Memory: nothing of a call outlives its replay. Every graph of a (device, stream) reads its input from
one shared staging buffer and copies its result into one shared output buffer (the clone hands the
caller its own tensor), and all of them capture into one memory pool, so the FP8 activations, scales
and partial sums of every graph occupy the same pool blocks. What stays allocated is the pool's
largest call, plus two staging buffers sized for the largest M x K and M x N seen (grown by doubling;
a graph keeps the buffer it was captured on), not a buffer per graph and layer. Replays on one stream
run one after another, so sharing is safe; a lock keeps two threads' copy-replay-clone sequences on
the shared buffers from interleaving.

Bytes: a replay runs the same kernels on the same operands, so outputs are bit-identical to the plain
call (tests/test_gpu_decode_graphs.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

MAX_M = 256       # rows per call up to which calls are graphed (the triton backend's small-M range)
MAX_GRAPHS = 4    # shapes captured per layer and stream

# A call is worth graphing while its GPU time is below the host time of an eager call (60-175 µs
# measured on the H200's host): estimated as the larger of reading the FP8 weight at WEIGHT_BYTES_PER_S
# and the MMA work at MMA_FLOPS_PER_S (H200 figures). Above it the eager call is GPU-bound, and a
# replay only adds its output copy: 57344 x 8192 at M = 64-256 ran 1.54 / 1.39x bf16 replayed against
# 1.70 / 1.71x launched (BENCHMARKS.md). A slower GPU only makes graphs a little more frequent than needed.
GPU_BOUND_S = 130e-6
WEIGHT_BYTES_PER_S = 3.3e12
MMA_FLOPS_PER_S = 1.2e15


def max_rows(n: int, k: int) -> int:
    """The largest M (<= MAX_M, 0 for none) at which an [M, K] x [K, N] call is graphed."""
    if n * k / WEIGHT_BYTES_PER_S > GPU_BOUND_S:
        return 0
    return min(MAX_M, int(GPU_BOUND_S * MMA_FLOPS_PER_S / (2 * n * k)))


class _Pool:
    """What the graphs of one (device, replay stream) share: the memory pool they capture into, the
    side stream every capture runs on (the caching allocator reuses a freed block only on the stream
    it was allocated on), an anchor graph (torch retires a pool whose graphs are all gone, after
    which capturing into the same handle fails an internal assert: a one-kernel graph of the pool
    kept forever prevents that), and the staging buffers, by (dtype, "in0" / "in1" / ... / "out")."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.handle, self.side = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        self.stages: dict[tuple[torch.dtype, str], torch.Tensor] = {}   # by (dtype, "in0" / "in1" / "out")
        scratch = torch.zeros(1, device=device)
        self.anchor = self.record(torch.cuda.current_stream(device), lambda: scratch.add_(1))

    def record(self, stream: torch.cuda.Stream, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """A graph of `fn`, captured into the pool on the side stream after `stream`'s pending work."""
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(stream)
        with torch.cuda.stream(self.side):
            graph.capture_begin(pool=self.handle, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        stream.wait_stream(self.side)
        return graph

    def stage(self, dtype: torch.dtype, which: str, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols] view of the shared staging buffer, grown (doubling) when too small; graphs
        captured on a smaller buffer keep it alive through their views."""
        buf = self.stages.get((dtype, which))
        numel = rows * cols
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            with torch.inference_mode(False):   # a normal tensor: later calls outside inference mode write it
                buf = torch.empty(size, dtype=dtype, device=self.device)
            self.stages[(dtype, which)] = buf
        return buf[:numel].view(rows, cols)


_POOLS: dict[tuple[int, int], _Pool] = {}
_LOCK = threading.Lock()   # the staging buffers are shared by every layer on a stream, across threads


def usable(x2: torch.Tensor) -> bool:
    """Can this call of a triton-backend layer replay a graph? (x2 [M, K], M checked by the caller; CPU
    tensors, run by Triton's interpreter, launch plainly.)"""
    if torch.compiler.is_compiling() or not x2.is_cuda:
        return False
    if x2.requires_grad and torch.is_grad_enabled():
        return False
    return not torch.cuda.is_current_stream_capturing()


class _Entry:
    """One captured call: its graph, input buffers and output buffer, and the tensor addresses it baked in."""

    __slots__ = ("graph", "xs", "y", "ptrs")

    def __init__(self, graph: torch.cuda.CUDAGraph, xs: tuple[torch.Tensor, ...], y: torch.Tensor,
                 ptrs: tuple) -> None:
        self.graph, self.xs, self.y, self.ptrs = graph, xs, y, ptrs


class DecodeGraphs:
    """The captured calls of one layer, keyed by (input shapes and dtypes, output dtype, stream); see the
    module docstring."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self.seen: set[tuple] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __deepcopy__(self, memo: dict) -> DecodeGraphs:
        return DecodeGraphs()     # a copied layer has its own tensors: it captures its own graphs

    def __reduce__(self):
        return DecodeGraphs, ()   # graphs are not saved with a pickled model

    def run(self, xs: torch.Tensor | tuple[torch.Tensor, ...], call: Callable[..., torch.Tensor], n: int,
            ptrs: tuple, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`call(*xs)` (2-D inputs [M, ...] -> [M, n] in `out_dtype`, default the first input's dtype; e.g.
        x2 [M, K], or FP8 rows and their scales), replayed from a graph when one is captured for these
        shapes (`ptrs`: the data_ptr()s of the tensors `call` reads besides xs)."""
        xs = xs if isinstance(xs, tuple) else (xs,)
        out_dtype = out_dtype or xs[0].dtype
        stream = torch.cuda.current_stream(xs[0].device)
        key = (tuple((tuple(x.shape), x.dtype) for x in xs), out_dtype, stream.cuda_stream)
        with _LOCK:   # copy in, replay, clone out must not interleave with another thread's on the buffers
            entry = self.entries.get(key)
            if entry is not None:
                if entry.ptrs == ptrs:
                    return _replay(entry, xs)
                del self.entries[key]           # the layer's tensors moved: this graph reads stale memory
                capture = True
            else:                               # capture at the second sighting, while below the cap
                capture = key in self.seen and sum(k[-1] == key[-1] for k in self.entries) < MAX_GRAPHS
                self.seen.add(key)
            if capture:
                entry = self.entries[key] = _capture(xs, call, n, out_dtype, stream, ptrs)
                return _replay(entry, xs)
        return call(*xs)


def _replay(entry: _Entry, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    for buf, x in zip(entry.xs, xs):
        buf.copy_(x)
    entry.graph.replay()
    return entry.y.clone()


def _capture(xs: tuple[torch.Tensor, ...], call: Callable[..., torch.Tensor], n: int, out_dtype: torch.dtype,
             stream: torch.cuda.Stream, ptrs: tuple) -> _Entry:
    """Capture `call` on the pool's side stream: read the shared input buffers, write the shared output
    buffer; the call's own result is an intermediate of the pool, free once the capture ends."""
    key = (xs[0].device.index, stream.cuda_stream)     # a CUDA tensor's device always has its index
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(xs[0].device)
    bufs = tuple(pool.stage(x.dtype, f"in{i}", *x.shape) for i, x in enumerate(xs))
    y_out = pool.stage(out_dtype, "out", xs[0].shape[0], n)
    for buf, x in zip(bufs, xs):
        buf.copy_(x)
    graph = pool.record(stream, lambda: y_out.copy_(call(*bufs)))
    return _Entry(graph, bufs, y_out, ptrs)
