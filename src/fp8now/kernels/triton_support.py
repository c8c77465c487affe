"""Triton itself, or one stand-in where it is missing (the kernel modules stay importable so that their
`available` can say why); where the kernels can run; the host-side memo their launch helpers use."""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_ERROR: str | None = None
except ImportError as _e:
    TRITON_ERROR = str(_e)

    class _NoTriton:
        """Just enough of `triton` / `triton.language` for the kernel definitions to parse."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()  # type: ignore[assignment]
    gdc_launch_dependents = gdc_wait = None


def interpreted(kernel) -> bool:
    """Was `kernel` built by Triton's interpreter (TRITON_INTERPRET=1 when its module was imported)?"""
    return type(kernel).__name__ == "InterpretedFunction"


def require_triton() -> None:
    """Raise a clear error when a kernel wrapper is called without an importable triton."""
    if TRITON_ERROR is not None:
        raise RuntimeError(f"triton is not importable ({TRITON_ERROR})")


def device_reason(device: torch.device | str | None, interpreted: bool, import_error: str | None,
                  min_cap: tuple[int, int], what: str) -> str | None:
    """None if Triton kernels built as `interpreted` (or compiled) can run on `device`, else why not.

    Compiled kernels run on CUDA GPUs of compute capability >= `min_cap`; interpreted ones
    (TRITON_INTERPRET=1 set before the kernels were defined) on CPU tensors only.
    """
    if import_error is not None:
        return f"triton is not importable ({import_error})"
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        return None if interpreted else "Triton runs on CPU tensors only with TRITON_INTERPRET=1"
    if dev.type != "cuda":
        return f"no Triton FP8 kernels for device type {dev.type!r}"
    if torch.version.hip is not None:
        return "the Triton FP8 kernels assume float8_e4m3fn and are not validated on ROCm"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if interpreted:
        return "TRITON_INTERPRET=1 is set: the kernels would run in the slow CPU interpreter"
    cap = torch.cuda.get_device_capability(dev)
    if cap < min_cap:
        return f"{what} needs compute capability >= {min_cap[0]}.{min_cap[1]}, this GPU has {cap[0]}.{cap[1]}"
    return None


def memo(maxsize: int):
    """`functools.lru_cache` for eager calls that torch.compile traces through as the plain function.

    Dynamo warns on every `lru_cache`-wrapped function it meets ("silent incorrectness is a potential
    risk") and then traces the wrapped function anyway; under compile the result is baked into the
    graph at trace time, so the cache buys nothing there. The launch helpers memoized with this
    (device facts, the decode kernel's plan) are pure functions of their arguments, so tracing the
    function itself gives the same result without the warning."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return fn(*args)
            return cached(*args)
        call.cache_info = cached.cache_info
        return call
    return wrap


@memo(maxsize=8)
def sm90(device: torch.device) -> bool:
    """Hopper features (programmatic dependent launch) usable on `device`: a CUDA GPU of capability
    >= 9.0 (the interpreter runs on CPU tensors, so never there)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
