"""One activation quantization for the linears that read the same input (q/k/v, gate/up) on the cpu backend
(on the triton backend: `producers`, whose norm and SiLU * up kernels write the linears' FP8 input).

During one forward of their parent module, sibling `Fp8Linear`s with the same K and activation kind
are usually handed the same tensor: the first quantizes it, the others reuse its widened activation.
The memo is open only while the parent's forward runs (hooks open and close it, also on an error), and
it keeps the input itself and, outside inference mode, its version: another tensor, or the same one
changed in place, is quantized afresh.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import head_norm, producers
from .linear import Fp8Linear


class InputMemo:
    """The input a group of sibling layers last saw and its widened activation, while the parent runs."""

    __slots__ = ("open", "key", "value")

    def __init__(self) -> None:
        self.open, self.key, self.value = False, None, None

    def widened(self, x: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`compute()` for a new input, the stored result for the one seen last (x as the module got it)."""
        if not self.open:
            return compute()
        key = (x, None if x.is_inference() else x._version)
        if self.key is None or self.key[0] is not x or self.key[1] != key[1]:
            self.key, self.value = key, compute()
        return self.value

    def opened(self, *_) -> None:
        self.open, self.key, self.value = True, None, None

    def closed(self, *_) -> None:
        self.open, self.key, self.value = False, None, None


def share_inputs(model: nn.Module) -> int:
    """Give each group of sibling layers (same parent, K and activation kind, on a backend with a
    `widened_activation` hook: cpu) one memo, and install the producers' kernels in front of triton-backend
    layers (`producers.install`) and the per-head norms' kernel behind them (`head_norm.install`); returns the
    number of layers that share one memo. Idempotent."""
    shared = 0
    for parent in model.modules():
        groups: dict[tuple[int, str], list[Fp8Linear]] = {}
        for child in parent.children():
            if isinstance(child, Fp8Linear) and _takes_widened(child) and child.input_memo is None:
                groups.setdefault((child.in_features, child.act_kind), []).append(child)
        for layers in groups.values():
            if len(layers) < 2:
                continue
            memo = InputMemo()
            parent.register_forward_pre_hook(memo.opened)
            parent.register_forward_hook(memo.closed, always_call=True)
            for layer in layers:
                layer.input_memo = memo
            shared += len(layers)
    producers.install(model)
    head_norm.install(model)
    return shared


def _takes_widened(layer: Fp8Linear) -> bool:
    return getattr(layer._impl, "widened_activation", None) is not None
