"""Building a model skeleton on the meta device without touching process-wide state: parameters go to
meta and floats take the load's dtype only in the thread that builds, so modules other threads create
at the same time are unaffected."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class _MetaThreads(threading.local):
    """Per-thread switch read by the one parameter-registration hook below."""

    active: bool = False


_META = _MetaThreads()
_HOOK_LOCK = threading.Lock()
_hook_handle = None


def _meta_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
    """A meta copy of `param` when this thread is building a skeleton; None (no change) elsewhere."""
    if not _META.active or param.is_meta:
        return None
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


def _install_hook() -> None:
    """Register `_meta_parameter` with torch once per process; it stays, inert outside `parameters_on_meta`.

    Registered once and never removed, so no load changes the hook table another thread may be
    iterating, and no patch of `nn.Module` can be restored out of order by a concurrent load.
    """
    global _hook_handle
    with _HOOK_LOCK:
        if _hook_handle is None:
            _hook_handle = nn.modules.module.register_module_parameter_registration_hook(_meta_parameter)


_install_hook()


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside this block, parameters registered by this thread move to meta; buffers stay real.

    Thread-local: modules other threads build meanwhile are untouched. Parameters are first created
    (uninitialized) where their module asks, then replaced by a meta tensor of the same shape and
    dtype, so initializers run on meta and cost nothing. Buffers such as RoPE `inv_freq` are computed
    normally and keep their dtype (float32).
    """
    outer = _META.active
    _META.active = True
    try:
        yield
    finally:
        _META.active = outer


# Factory functions whose result, without a `dtype`, is always a float in torch's default dtype (the
# dtype is passed in, so nothing is allocated twice), and those that infer a dtype from their values.
_FLOAT_FACTORIES = frozenset({torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.rand,
                              torch.randn, torch.eye, torch.linspace, torch.logspace})
_INFERRING_FACTORIES = frozenset({torch.arange, torch.full, torch.tensor, torch.as_tensor, torch.scalar_tensor})


class ThreadDefaultDtype(TorchFunctionMode):
    """A thread-local stand-in for `torch.set_default_dtype(dtype)`, which is process-wide.

    transformers builds a model in its dtype by setting torch's default dtype for the whole process,
    so modules other threads create meanwhile would change dtype. Under this mode (a per-thread
    torch-function mode) a float that a factory call creates in the default dtype, with no `dtype`
    and no tensor argument, comes out in `dtype` instead; nothing outside this thread is touched.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") is not None or any(isinstance(a, torch.Tensor) for a in args):
            return func(*args, **kwargs)
        if func in _FLOAT_FACTORIES:
            return func(*args, **{**kwargs, "dtype": self.dtype})
        out = func(*args, **kwargs)
        if func in _INFERRING_FACTORIES and out.dtype == torch.get_default_dtype():
            out = out.to(self.dtype)
        return out
