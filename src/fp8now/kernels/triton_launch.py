"""Launching compiled Triton kernels without triton's per-call Python work.

`kernel[grid](*args, **kw)` in triton 3.6 binds the arguments, computes their specialization, builds
a cache key, looks it up, checks globals and only then calls the kernel's C launcher; on the H200
host that costs 30-60 µs per launch (BENCHMARKS.md, "Host cost"), several times the GPU time of a
decode-sized kernel. `launch(kernel, grid, *args, **kw)` does the same launch with less:
- The first call for a given key goes through `kernel[grid](...)` (compiling if needed) and keeps
  the compiled kernel it returns.
- Later calls with the same key pass the arguments straight to that kernel's C launcher, the call
  `kernel[grid]` ends with.

The key is at least as fine as triton's own specialization, so a kept kernel is always the one
triton would pick:
- tensors: dtype and 16-byte alignment of the address;
- integers: == 1, divisible by 16, and the integer width triton would give them;
- constexpr parameters and keyword options (num_warps, launch_pdl, ...): their exact values;
- the current device.
(Integers that a kernel does not specialize, such as `do_not_specialize` ones, only make the key
finer: several keys then share one compiled kernel.)

It falls back to `kernel[grid](...)` where the shortcut does not apply:
- under the interpreter (TRITON_INTERPRET=1);
- while torch.compile traces (Dynamo captures `kernel[grid]` itself);
- when triton's launch hooks are set (profilers read launch metadata);
- for anything that is not a plain JITFunction, or a triton without the launcher API used here;
- when FP8NOW_FAST_LAUNCH=0 is set in the environment at import.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    from triton.runtime.jit import JITFunction
    try:
        from triton import knobs as _knobs
        _HOOKS = _knobs.runtime
    except ImportError:  # older triton: hooks are attributes of CompiledKernel
        from triton.compiler import CompiledKernel as _HOOKS
except ImportError:
    triton = JITFunction = _HOOKS = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Module switch (benchmarks flip it to measure both paths): the shortcut is used when True.
ENABLED = (JITFunction is not None and not INTERPRETED
           and os.environ.get("FP8NOW_FAST_LAUNCH", "1") not in ("", "0"))

# (kernel, device, argument keys, keyword items) -> (compiled kernel, names of the parameters that
# came as keywords, in signature order), or None where the shortcut cannot replay that call.
_KEPT: dict[tuple, tuple | None] = {}
_CONSTEXPR_POSITIONS: dict[object, frozenset[int]] = {}
_I32 = (-(2 ** 31), 2 ** 31 - 1)
_U64 = 2 ** 63


def _arg_key(a):
    """What triton specializes on for one runtime argument (finer where unsure)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1], a >= _U64)
    if isinstance(a, float):
        return "f"
    return a  # None, dtypes and other hashable constants: their value


def _key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    fixed = _CONSTEXPR_POSITIONS.get(kernel)
    if fixed is None:
        fixed = _CONSTEXPR_POSITIONS[kernel] = frozenset(p.num for p in kernel.params if p.is_constexpr)
    arg_keys = tuple(a if i in fixed else _arg_key(a) for i, a in enumerate(args))
    kw_keys = tuple((k, _arg_key(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items())
    return (kernel, device, arg_keys, kw_keys)


def _hook_set(hook) -> bool:
    """A launch hook is set: a function, or (newer triton) a non-empty HookChain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    return _hook_set(_HOOKS.launch_enter_hook) or _hook_set(_HOOKS.launch_exit_hook)


def _keep(kernel, compiled, args: tuple, kwargs: dict):
    """The entry for a first launch: None if its later calls cannot take the shortcut."""
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    tail = tuple(kernel.arg_names[len(args):])
    if any(name not in kwargs for name in tail):  # a parameter left to its default: not replayed
        return None
    return compiled, tail


def launch(kernel, grid: tuple, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, through the kept compiled kernel when possible."""
    # is_compiling first: under Dynamo the rest of the condition is not traced
    if torch.compiler.is_compiling() or not ENABLED or not isinstance(kernel, JITFunction) or _hooks_set():
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    key = _key(kernel, device, args, kwargs)
    entry = _KEPT.get(key, False)
    if entry is False:  # first launch of this key: triton's own path, which compiles if needed
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # asynchronous compilation hands back a future
            compiled = compiled.result()
        _KEPT[key] = _keep(kernel, compiled, args, kwargs)
        return compiled
    if entry is None:
        return kernel[grid](*args, **kwargs)
    compiled, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *(kwargs[n] for n in tail))
    return compiled


def kept() -> int:
    """How many launch keys are kept (for tests and probes)."""
    return sum(e is not None for e in _KEPT.values())
