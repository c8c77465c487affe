"""Prefix replay: a forward that starts at block i, the blocks before it answering with recorded outputs.

Swapping one layer of block i changes nothing before block i, so a measurement need only run blocks i..end:
every earlier block's `forward` is replaced, for that call, by one that returns what block i-1 returned in
a recorded forward of the same input (bf16 blocks before i for "alone", FP8 ones for "all but it"). The
model's own loop, masks and position embeddings run as usual, so this works for any model whose blocks sit
in one `nn.ModuleList` that it runs in order; passes.Pass.check verifies that on the model at hand
(replayed logits must equal the full forward's bit for bit) before the pass relies on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def block_of(model: nn.Module, name: str) -> tuple[str, int] | None:
    """(name of the ModuleList of blocks, index) holding module `name`, the outermost such list; or None."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        if parts[k].isdigit() and isinstance(model.get_submodule(".".join(parts[:k])), nn.ModuleList):
            return ".".join(parts[:k]), int(parts[k])
    return None


class Replay:
    """Records the output of every block of `blocks` and replays them in front of a chosen block."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.blocks = blocks

    @contextlib.contextmanager
    def record(self) -> Iterator[list]:
        """Inside the block, one forward fills the yielded list with each block's output, in order."""
        outputs: list = [None] * len(self.blocks)

        def hook(i: int):
            def store(_module, _args, out) -> None:
                outputs[i] = out
            return store

        handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(self.blocks)]
        try:
            yield outputs
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def start_at(self, i: int, outputs: list) -> Iterator[None]:
        """Forwards inside the block skip blocks 0..i-1: each returns `outputs[i - 1]` at once."""
        if i == 0:
            yield
            return
        recorded = outputs[i - 1]
        if recorded is None:
            raise RuntimeError(f"block {i - 1} has no recorded output; record a forward first")

        def replayed(*_args, **_kwargs):
            return recorded

        skipped = list(self.blocks)[:i]
        own = [block.__dict__.get("forward") for block in skipped]   # an instance's own forward (accelerate)
        for block in skipped:
            block.forward = replayed     # an instance attribute: shadows the class's forward
        try:
            yield
        finally:
            for block, forward in zip(skipped, own):
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward
