"""Low-overhead Triton launches for the per-call kernels.

`kernel[grid](...)` in Triton 3.x binds, specializes and hashes every argument on each call (about
60 µs of host time per launch on the H200 machine's host, profiled; more than the kernels run at
decode sizes). `fast(kernel)[grid](...)` does the same launch but keeps the compiled kernel under a
key computed here, which is at least as fine as Triton's own specialization (dtype and 16-byte
alignment of every tensor, `== 1` / `% 16` / 32-bit range of every int, every constexpr value), and
then calls the compiled kernel's launcher directly. Anything unusual takes Triton's normal path:
the first call of a key, the interpreter, torch.compile tracing, and launch hooks (profilers)
present when a key is first seen (hooks attached later are not called by the fast path).
"""

from __future__ import annotations

from typing import Any

import torch

_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
STATS = {"fast": 0, "triton": 0}  # launches taken by each path (benchmarks print it)
_WRAPPERS: dict[int, FastKernel] = {}
_INT32 = 2 ** 31


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return (bool, a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_INT32 <= a < _INT32)
    return (type(a), a)


def _hooks_set() -> bool:
    try:
        from triton import knobs
        return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None
    except (ImportError, AttributeError):
        return False


def _raw_stream(index: int | None) -> int:
    if index is None:
        index = torch.cuda.current_device()
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream


class FastKernel:
    """A `@triton.jit` kernel whose repeated launches skip Triton's per-call argument binding."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled_path = type(kernel).__name__ == "JITFunction" and hasattr(kernel, "params")

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        if not self.compiled_path:
            self.kernel[grid](*args, **meta)
            return
        key = (id(self.kernel), tuple(map(_spec, args)), tuple(meta.items()))
        hit = _COMPILED.get(key)
        if hit is None:
            STATS["triton"] += 1
            compiled = self.kernel[grid](*args, **meta)
            if (compiled is not None and hasattr(compiled, "run") and not hasattr(compiled, "result")
                    and not _hooks_set()):
                names = [p.name for p in self.kernel.params[len(args):]]
                tail = tuple(meta[n] if n in meta else p.default
                             for n, p in zip(names, self.kernel.params[len(args):]))
                _COMPILED[key] = (compiled, tail)
            return
        STATS["fast"] += 1
        compiled, tail = hit
        stream = _raw_stream(args[0].device.index if isinstance(args[0], torch.Tensor) else None)
        g = tuple(grid) + (1, 1)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *tail)


def fast(kernel: Any) -> Any:
    """The low-overhead launcher for `kernel` (one per kernel); the kernel itself while
    torch.compile traces, so that dynamo sees an ordinary Triton launch."""
    if torch.compiler.is_compiling():
        return kernel
    wrapper = _WRAPPERS.get(id(kernel))
    if wrapper is None:
        wrapper = _WRAPPERS[id(kernel)] = FastKernel(kernel)
    return wrapper
