"""How every benchmark times a call, in one place, so that two implementations compared in one run
were timed the same way.

- `l2_flushed_ms`: host-launched calls, median of `triton.testing.do_bench` (L2 flushed before every
  call; the host's launch cost is included).
- `GraphTimer`: GPU time alone. `copies` calls, each on its own copy of the weights, captured in one
  CUDA graph; replay time / copies. Each implementation timed by one timer gets the same number of
  separate copies: a weight shared by the calls of a graph would stay in L2 and read faster than HBM.
- `event_ms`: median of CUDA-event times of `fn` (for graphs the caller built).
- `kernels_of`: the CUDA kernels a call launches and their GPU time (torch.profiler).
- `host_ms(fn, drain=torch.cuda.synchronize)`, `host_hotspots`: the host's side of a GPU call: its wall time to
  return with the GPU idle before it (no sync inside), and the Python functions that time goes to (cProfile).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from typing import Any, Callable, Sequence

import torch

L2_BYTES = 50 * 2**20   # the H200's L2; the copies of a graph must together overflow it


def copies_for(weight_bytes: int, least: int = 4, l2_bytes: int = L2_BYTES) -> int:
    """Weight copies per graph such that the other copies' bytes are twice the L2: by the time a call
    comes round again in the replay, its weight has been evicted and streams from HBM."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes must be positive, got {weight_bytes}")
    return max(least, 1 + math.ceil(2 * l2_bytes / weight_bytes))


def storage_ptrs(obj: Any) -> set[int]:
    """Data pointers of the tensors `obj` owns: a module's parameters and buffers, or a tensor."""
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    tensors = list(obj.parameters()) + [b for b in obj.buffers() if b is not None]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def check_separate(copies: Sequence[Any]) -> None:
    """Raise unless no two copies share a tensor's storage (a shared weight would stay in L2)."""
    seen: dict[int, int] = {}
    for i, c in enumerate(copies):
        ptrs = storage_ptrs(c)
        if not ptrs:
            raise ValueError(f"copy {i} owns no tensors: nothing to keep apart")
        for p in ptrs:
            if p in seen:
                raise ValueError(f"copies {seen[p]} and {i} share a tensor: the graph would read it from L2")
            seen[p] = i


def separate_copies(obj: Any, n: int) -> list[Any]:
    """`n` deep copies of a module or tensor, none sharing storage with another or with `obj`."""
    if isinstance(obj, torch.Tensor):
        out = [obj.clone() for _ in range(n)]
    else:
        out = [copy.deepcopy(obj) for _ in range(n)]
    check_separate([obj, *out])
    return out


class GraphTimer:
    """GPU ms per call of `copies` calls replayed from one CUDA graph. Keep one timer per comparison
    (e.g. per shape) so that every implementation it times has the same number of copies."""

    def __init__(self, copies: int, warmup_ms: int = 5, rep_ms: int = 25):
        if copies < 2:
            raise ValueError(f"a graph needs at least 2 weight copies to keep a weight out of L2, got {copies}")
        self.copies, self.warmup_ms, self.rep_ms = copies, warmup_ms, rep_ms

    def calls(self, copies: Sequence[Any], call: Callable[[Any], Any]) -> list[Callable[[], Any]]:
        """One call per copy, after checking there are exactly `self.copies` of them, all separate."""
        if len(copies) != self.copies:
            raise ValueError(f"this timer takes {self.copies} copies per implementation, got {len(copies)}")
        check_separate(copies)
        return [functools.partial(call, c) for c in copies]

    def ms(self, copies: Sequence[Any], call: Callable[[Any], Any]) -> float:
        """GPU ms of `call(copy)`, averaged over the copies (host launch cost removed)."""
        calls = self.calls(copies, call)
        for c in calls:   # compile, autotune and allocate outside the capture
            c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        ms = l2_flushed_ms(graph.replay, self.warmup_ms, self.rep_ms) / len(calls)
        del graph
        return ms


def l2_flushed_ms(fn: Callable[[], Any], warmup_ms: int = 5, rep_ms: int = 25) -> float:
    """Median ms of `fn` launched from the host, L2 flushed before each call (triton's do_bench)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def host_ms(fn: Callable[[], Any], reps: int = 3, drain: Callable[[], Any] | None = None) -> float:
    """Median wall ms of `fn` after one warm-up call (the CPU smoke runs: no GPU to time). `drain` (e.g.
    torch.cuda.synchronize) runs after the warm-up and after every call, outside the timing, so each call starts
    with nothing queued: its time is then the host's to enqueue it. Where that is near the call's CUDA-event time,
    the host sets the pace (a full launch queue also blocks the host: compare with the kernels' sum)."""
    drain = drain or (lambda: None)
    fn()
    drain()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        drain()
    return 1e3 * sorted(times)[len(times) // 2]


def host_hotspots(fn: Callable[[], Any], top: int = 12, drain: Callable[[], Any] | None = None) -> list[dict]:
    """The `top` Python functions by self time in one call of `fn` under cProfile (its overhead inflates
    Python-heavy code: a ranking, not a timing), after a warm-up call; `drain` as for `host_ms`:
    [{"fn": "file:line(name)", "ms", "calls"}]."""
    import cProfile
    import os
    import pstats

    drain = drain or (lambda: None)
    fn()
    drain()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    drain()
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (calls, ncalls, self s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"fn": f"{os.path.basename(f)}:{line}({name})", "ms": round(1e3 * v[2], 2), "calls": v[1]}
            for (f, line, name), v in rows]


def event_ms(fn: Callable[[], Any], reps: int = 11) -> float:
    """Median ms of `fn` between two CUDA events (no L2 flush: for a graph replay the caller built)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernels_of(fn: Callable[[], Any], calls: int = 3) -> list[tuple[str, float]]:
    """(kernel name, mean GPU µs per call of `fn`) for the CUDA kernels it launches, longest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t > 0:
            out.append((e.key[:90], t / calls))
    return sorted(out, key=lambda r: -r[1])
