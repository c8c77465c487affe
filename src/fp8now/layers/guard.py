"""The reload/forward contract of one model: `reload_weights` is atomic for its forwards.

A per-model readers-writer lock. Every forward through the model (a forward pre-hook and an always-called
forward hook on the module given to fp8now.load / quantize_ / from_pretrained, or to the first
reload_weights) is a reader; `reload_weights` is the writer. Forwards run side by side as before; a reload
waits until the forwards already running have returned, keeps new ones waiting (or refused, with
`forward_waits = False`) while it writes, and then lets them run on the complete new weights. Two reloads of
one model run one after the other. A forward therefore sees the old weights or the new ones, never a mix.

A reload that fails after it wrote something leaves the model "torn" (some layers new, others old): every
forward then raises `TornWeights` naming what was applied, until a later reload_weights completes or
`clear_torn()` accepts the mix. A thread that runs a forward, or holds `reading()`, and calls reload_weights
on the same model gets an error instead of waiting for itself.

Under torch.compile the compiled graph does not pass through the hooks (they are traced away, so that a
fullgraph compile still works): hold `guard(model).reading()` around compiled calls or replays of your own
CUDA graphs. On CUDA a reload synchronizes the model's devices before and after writing, so kernels queued by
forwards on other streams finish before their weights change, and forwards after it read whole new weights.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import nn

from .embedding import Fp8Embedding
from .linear import Fp8Linear
from .moe import Fp8Experts

ATTR = "_fp8now_guard"   # where a model (and each of its FP8 modules) keeps its guard


class ReloadInProgress(RuntimeError):
    """A forward refused because reload_weights is writing this model's weights (`forward_waits = False`)."""


class TornWeights(RuntimeError):
    """A forward refused because a reload_weights call failed half-way: the model holds old and new weights."""


class Guard:
    """The lock of one model (see the module docstring). `forward_waits`: a forward that arrives during a reload
    waits for it (True, the default) or raises ReloadInProgress at once (False)."""

    def __init__(self, forward_waits: bool = True) -> None:
        self.forward_waits = forward_waits
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0             # forwards (or reading() blocks) running, all threads together
        self._writer: int | None = None   # the thread running reload_weights
        self._waiting = 0             # reloads waiting for the running forwards to return
        self._held = 0                # forwards waiting for a reload to end
        self._readers_turn = False    # a reload just ended: the forwards it held go before the next reload
        self._torn: str | None = None
        self._local = threading.local()   # .depth: this thread's nested forwards / reading() blocks

    # --- copies: a copied or unpickled model gets a fresh, unlocked guard ------------------------------
    def __deepcopy__(self, memo: dict) -> Guard:
        return Guard(self.forward_waits)

    def __reduce__(self):
        return Guard, (self.forward_waits,)

    # --- readers -----------------------------------------------------------------------------------------
    @property
    def torn(self) -> str | None:
        """What a failed reload applied before it stopped (forwards raise while this is set), or None."""
        return self._torn

    def clear_torn(self) -> None:
        """Accept the mix a failed reload left: forwards run again on the weights as they are."""
        with self._cond:
            self._torn = None

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def enter_read(self) -> None:
        """Start a forward: wait for (or refuse during) a reload; refuse torn weights."""
        depth = self._depth()
        if depth:   # nested in this thread's own forward or reading(): already counted
            self._local.depth = depth + 1
            return
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                raise RuntimeError("a forward of this model was called from inside reload_weights in the same "
                                   "thread; run forwards before or after the reload")
            busy = self._writer is not None or self._waiting
            if busy and not self.forward_waits:
                raise ReloadInProgress("forward refused: reload_weights is writing this model's weights "
                                       "(fp8now.guard(model).forward_waits is False); call it again after the "
                                       "reload, or set forward_waits = True to wait for it")
            self._held += 1
            try:
                self._cond.wait_for(lambda: self._writer is None and (not self._waiting or self._readers_turn))
            finally:
                self._held -= 1
                if self._held == 0 and self._readers_turn:
                    self._readers_turn = False
                    self._cond.notify_all()
            if self._torn is not None:
                raise TornWeights(f"forward refused: {self._torn}; reload the weights again (a reload_weights "
                                  "that completes clears this) or accept the mix with "
                                  "fp8now.guard(model).clear_torn()")
            self._readers += 1
        self._local.depth = 1

    def exit_read(self) -> None:
        """End a forward started by enter_read (a forward whose enter_read raised is not counted)."""
        depth = self._depth()
        if depth == 0:
            return
        self._local.depth = depth - 1
        if depth == 1:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the current weights for a whole block (e.g. one `generate` call, or compiled forwards): a
        reload_weights in another thread waits until the block ends. Nests with forwards."""
        self.enter_read()
        try:
            yield
        finally:
            self.exit_read()

    # --- the writer -------------------------------------------------------------------------------------
    @contextmanager
    def writing(self, model: nn.Module, timeout: float | None = None) -> Iterator[None]:
        """reload_weights' exclusive access: the running forwards (and another reload) first; `timeout`
        seconds at most (None: no limit), else TimeoutError with nothing written."""
        if self._depth():
            raise RuntimeError("reload_weights was called from inside a forward (or a guard.reading() block) of "
                               "the same model in the same thread; it would wait for itself. Reload between "
                               "forwards")
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                raise RuntimeError("reload_weights re-entered in the same thread (from a tensor iterator?); "
                                   "finish one call before the next")
            self._waiting += 1
            try:
                free = self._cond.wait_for(
                    lambda: self._writer is None and self._readers == 0 and not self._readers_turn, timeout)
            finally:
                self._waiting -= 1
                if self._writer is None:
                    self._cond.notify_all()   # forwards held back by this waiting reload may go if it gives up
            if not free:
                raise TimeoutError(f"reload_weights: the model's forwards (or another reload) still ran after "
                                   f"{timeout} s; nothing of this call was applied")
            self._writer = me
        try:
            devices = _cuda_devices(model)
            _synchronize(devices)
            yield
            _synchronize(devices)
        finally:
            with self._cond:
                self._writer = None
                self._readers_turn = self._held > 0   # phase-fair: back-to-back reloads cannot starve forwards
                self._cond.notify_all()

    def set_torn(self, message: str | None) -> None:
        """Called by reload_weights at its end: what a failed call applied, or None after a complete one."""
        with self._cond:
            self._torn = message


def _cuda_devices(model: nn.Module) -> set[torch.device]:
    """The CUDA devices holding the model's parameters (none without a CUDA context in this process: no walk)."""
    if not torch.cuda.is_initialized():
        return set()
    return {p.device for p in model.parameters() if p.device.type == "cuda"}


def _synchronize(devices: set[torch.device]) -> None:
    """Wait for the kernels queued on each of these CUDA devices (all streams)."""
    for device in devices:
        torch.cuda.synchronize(device)


def _before_forward(module: nn.Module, args) -> None:
    if not torch.compiler.is_compiling():
        getattr(module, ATTR).enter_read()


def _after_forward(module: nn.Module, args, output) -> None:
    if not torch.compiler.is_compiling():
        getattr(module, ATTR).exit_read()


def _fp8_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts, Fp8Embedding))]


def install(model: nn.Module) -> Guard:
    """Give `model` its guard (once): hooks on `model`'s forward, and the same guard on each of its FP8
    modules, so that reload_weights on a submodule finds it. Returns the guard."""
    found = guard_of(model, create=False)
    if found is not None and ATTR in model.__dict__:
        return found
    g = found or Guard()
    object.__setattr__(model, ATTR, g)
    model.register_forward_pre_hook(_before_forward)
    model.register_forward_hook(_after_forward, always_call=True)
    for m in _fp8_modules(model):
        object.__setattr__(m, ATTR, g)
    return g


def guard_of(model: nn.Module, create: bool = True) -> Guard | None:
    """The guard of `model`: its own, or that of the model its FP8 modules belong to; with `create`, a new one
    installed on `model` when there is none."""
    own = model.__dict__.get(ATTR)
    if own is not None:
        return own
    for m in _fp8_modules(model):
        g = m.__dict__.get(ATTR)
        if g is not None:
            return g
    return install(model) if create else None


def guard(model: nn.Module) -> Guard:
    """The public handle: `fp8now.guard(model).reading()`, `.forward_waits`, `.torn`, `.clear_torn()`."""
    return guard_of(model)
