"""The decode step a whole-model benchmark times: B sequences with `context` tokens in a transformers
StaticCache, one more token each, replayed from a CUDA graph, compiled, or eager. The same code runs
for every implementation, so bf16 and its peers get the same mechanism."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def random_ids(shape: tuple[int, ...], vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded token ids, drawn on the host so that every device gets the same ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, shape, generator=g).to(device)


def causal_mask(positions: torch.Tensor, cache_len: int, batch: int) -> torch.Tensor:
    """Boolean mask [batch, 1, T, cache_len]: the query at position p sees cache slots 0..p (transformers
    takes a 4D mask as given, so no mask logic of its own runs inside a captured step)."""
    slots = torch.arange(cache_len, device=positions.device)
    return (slots[None, :] <= positions[:, None])[None, None].expand(batch, 1, -1, -1)


@torch.no_grad()   # not inference mode: torch.compile of a step run under it fails (pytorch/pytorch#180823)
def decode_step(model: nn.Module, batch: int, context: int, vocab: int, seed: int, device: torch.device
                ) -> Callable[[], torch.Tensor]:
    """A StaticCache holding `context` tokens of each of `batch` random sequences, and the step that
    feeds one more token per sequence at position `context`: -> logits [batch, 1, V]. Every tensor the
    step reads is allocated here, and each call first sets the cache's write position (a device tensor
    it advances itself) back to `context`: the step can be captured and replayed any number of times."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + 1)
    pos = torch.arange(context, device=device)
    model(input_ids=random_ids((batch, context), vocab, seed, device), position_ids=pos.expand(batch, -1),
          cache_position=pos, attention_mask=causal_mask(pos, context + 1, batch), past_key_values=cache,
          use_cache=True, logits_to_keep=1)
    counters = [getattr(layer, "cumulative_length", None) for layer in getattr(cache, "layers", ())]
    if not counters or not all(isinstance(c, torch.Tensor) for c in counters):
        raise RuntimeError("this transformers' StaticCache keeps no position tensor per layer "
                           "(cumulative_length), so the step cannot rewrite one slot on every call")
    for c in counters:   # torch.compile's CUDA graphs then take the step's writes to them as their own
        torch._dynamo.mark_static_address(c)
    starts = [torch.full_like(c, context) for c in counters]
    ids = random_ids((batch, 1), vocab, seed + 7, device)
    step_pos = torch.full((1,), context, device=device)
    positions = step_pos.view(1, 1).expand(batch, 1)
    mask = causal_mask(step_pos, context + 1, batch)

    def step() -> torch.Tensor:
        with torch.no_grad():
            torch._foreach_copy_(counters, starts)   # the cache writes slot `context` again
            return model(input_ids=ids, position_ids=positions, cache_position=step_pos, attention_mask=mask,
                         past_key_values=cache, use_cache=True).logits
    return step


def captured(step: Callable[[], torch.Tensor], mode: str, device: torch.device) -> Callable[[], torch.Tensor]:
    """The step as it is timed: replayed from one CUDA graph (warmed up on a side stream first), compiled
    with torch.compile (reduce-overhead), or as it is (eager). Returns a call giving the logits."""
    if mode == "eager":
        return step
    if device.type != "cuda":
        raise ValueError(f"decode mode {mode!r} needs a CUDA device; use --decode-mode eager on {device}")
    if mode == "compile":
        torch._dynamo.reset()
        compiled = torch.compile(step, mode="reduce-overhead")
        for _ in range(3):   # reduce-overhead records its graph after warm-up calls
            compiled()
        return compiled
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"the decode step cannot be captured in one CUDA graph ({first}): a forward that "
                           "waits on the host (e.g. data-dependent expert routing) cannot be; --decode-mode "
                           "eager or compile measures it") from e
    return GraphReplay(step, graph, out)


class GraphReplay:
    """A step's CUDA graph, replayed by a call that returns the graph's logits tensor. It holds the step: the
    graph reads tensors only the step's closure holds (its ids, mask, positions, cache), and a replay that
    outlived them would read their freed memory, by then another tensor's (the tests' batch-1 graph, its step
    dropped after the capture, read its token ids from a later allocation and failed an embedding assert)."""

    def __init__(self, step: Callable[[], torch.Tensor], graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.step, self.graph, self.out = step, graph, out

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out
