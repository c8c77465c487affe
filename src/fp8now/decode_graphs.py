"""Eager decode through per-layer CUDA graphs: a layer's call at a small M is captured once, then replayed.

Why: at M <= MAX_M an eager `Fp8Linear` call on the triton backend is host-bound. Its two Triton
launches cost 60-100 µs of Python and driver time per call on the H200's host, against 20-40 µs of
GPU work, so eager decode ran at 0.2-0.3x of bf16 `F.linear` (~18 µs of host per call; BENCHMARKS.md,
"Host cost of an eager call"). A replay is three cheap launches: copy x into the graph's input buffer,
replay, clone the graph's output (the clone keeps results of earlier calls from being overwritten).

When: the triton backend on CUDA, M <= MAX_M, and not while torch.compile traces, not while a CUDA
graph is being captured (the caller's graph then holds the plain launches), not when autograd would
need to see the call. A shape (M, dtype, stream) is captured the second time it is seen (the first
call runs plainly and compiles the kernels), at most MAX_GRAPHS shapes per layer (later ones run
plainly: no eviction, so varying batch sizes never thrash captures). A capture costs about a
millisecond once. The graphs bake in the addresses of the layer's weight, scale, bias and split-K
counters: an in-place reload (`load_`, `reload_weights`) keeps them and the graphs stay valid; a
changed address drops the graph. The graphs of a device and stream share one memory pool, so only
their input and output buffers stay allocated (intermediates are dead between replays).

Bytes: a replay runs the same kernels on the same operands, so outputs are bit-identical to the plain
call (tests/test_gpu_decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_M = 16        # the decode path of the triton backend (triton_decode.MAX_M)
MAX_GRAPHS = 4    # shapes captured per layer

# (device index, replay stream) -> (graph memory pool, the side stream every capture for it runs on,
# an anchor graph). The caching allocator reuses a freed block only on the stream it was allocated
# on; and it retires a pool whose graphs are all gone, after which capturing into the same handle
# fails an internal assert: the anchor, a one-kernel graph of the pool kept forever, prevents that.
_POOLS: dict[tuple[int, int], tuple[tuple, torch.cuda.Stream, torch.cuda.CUDAGraph]] = {}


def usable(x2: torch.Tensor) -> bool:
    """Can this call of a triton-backend layer replay a graph? (x2 [M, K] on CUDA, M checked by the caller.)"""
    if torch.compiler.is_compiling():
        return False
    if x2.requires_grad and torch.is_grad_enabled():
        return False
    return not torch.cuda.is_current_stream_capturing()


class _Entry:
    """One captured call: its graph, input and output buffers, and the tensor addresses it baked in."""

    __slots__ = ("graph", "x", "y", "ptrs")

    def __init__(self, graph: torch.cuda.CUDAGraph, x: torch.Tensor, y: torch.Tensor, ptrs: tuple) -> None:
        self.graph, self.x, self.y, self.ptrs = graph, x, y, ptrs


class DecodeGraphs:
    """The captured calls of one layer, keyed by (M, dtype, stream); see the module docstring."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self.seen: set[tuple] = set()

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __deepcopy__(self, memo: dict) -> DecodeGraphs:
        return DecodeGraphs()     # a copied layer has its own tensors: it captures its own graphs

    def __reduce__(self):
        return DecodeGraphs, ()   # graphs are not saved with a pickled model

    def run(self, x2: torch.Tensor, call: Callable[[torch.Tensor], torch.Tensor], ptrs: tuple) -> torch.Tensor:
        """`call(x2)`, replayed from a graph when one is captured for this shape (`ptrs`: the
        data_ptr()s of the tensors `call` reads besides x2)."""
        stream = torch.cuda.current_stream(x2.device)
        key = (x2.shape[0], x2.dtype, stream.cuda_stream)
        entry = self.entries.get(key)
        if entry is not None and entry.ptrs == ptrs:
            entry.x.copy_(x2)
            entry.graph.replay()
            return entry.y.clone()
        if entry is not None:               # the layer's tensors moved: this graph reads stale memory
            del self.entries[key]
        elif key not in self.seen or len(self.entries) >= MAX_GRAPHS:
            self.seen.add(key)
            return call(x2)
        entry = _capture(x2, call, stream, ptrs)
        self.entries[key] = entry
        entry.x.copy_(x2)
        entry.graph.replay()
        return entry.y.clone()


def _new_pool(device: torch.device) -> tuple[tuple, torch.cuda.Stream, torch.cuda.CUDAGraph]:
    pool, side, anchor = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device), torch.cuda.CUDAGraph()
    scratch = torch.zeros(1, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            scratch.add_(1)
        finally:
            anchor.capture_end()
    return pool, side, anchor


def _capture(x2: torch.Tensor, call: Callable[[torch.Tensor], torch.Tensor], stream: torch.cuda.Stream,
             ptrs: tuple) -> _Entry:
    """Capture `call` on a side stream into a graph that reads a fresh input buffer shaped like x2."""
    device = x2.device
    pool_key = (device.index if device.index is not None else torch.cuda.current_device(), stream.cuda_stream)
    if pool_key not in _POOLS:
        _POOLS[pool_key] = _new_pool(device)
    pool, side, _ = _POOLS[pool_key]
    with torch.inference_mode(False):   # a normal tensor: later calls outside inference mode write it
        x_static = torch.empty(x2.shape, dtype=x2.dtype, device=device)
    x_static.copy_(x2)
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            y_static = call(x_static)
        finally:
            graph.capture_end()
    stream.wait_stream(side)
    return _Entry(graph, x_static, y_static, ptrs)
