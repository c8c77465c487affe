"""The text the sensitivity pass scores on: the bf16 model's own greedy continuations of a few neutral openings.

No user data and no download: the openings are fixed here (everyday topics and a line of code, none taken
from the texts `fp8now eval` measures on) and given as plain text, without a chat template: a base model
continues them as well as an instruct model, no system prompt costs tokens that are not scored, and it is
the kind of text `fp8now eval` measures on. The bf16 model continues all of them in one left-padded batch,
greedily, for exactly `new_tokens` tokens (the end of text is suppressed until then, so every row has the
same length). The pass then predicts each generated token from the opening and the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PROMPTS = (
    "The printing press was invented",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "The history of the bicycle",
    "Dear neighbours, we would like to invite you",
    "To make bread at home, you",
)
NEW_TOKENS = 40


@dataclass
class Sample:
    """The prompts and answers as left-padded rows `ids [B, P + N]` with their `mask` (1: a real token): every
    answer fills the last N = `new_tokens` columns, so the scored predictions are the logits at columns
    P-1 .. P+N-2 of every row (the model's `logits_to_keep=N+1`, less the last)."""

    ids: torch.Tensor
    mask: torch.Tensor
    new_tokens: int

    @property
    def positions(self) -> torch.Tensor:
        """Position ids that ignore the left padding (as `generate` gives them): [B, P + N]."""
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    @property
    def tokens(self) -> int:
        """Scored predictions: one per answer token."""
        return self.ids.shape[0] * self.new_tokens


@torch.inference_mode()
def generate(model: nn.Module, tokenizer, prompts: tuple[str, ...] = PROMPTS,
             new_tokens: int = NEW_TOKENS) -> Sample:
    """Greedy continuations of `prompts` by `model`, exactly `new_tokens` each, in one left-padded batch."""
    if new_tokens < 1:
        raise ValueError(f"the sensitivity pass needs at least 1 generated token per prompt, got {new_tokens}")
    rows = [tokenizer(text)["input_ids"] for text in prompts]     # with the tokenizer's own BOS, if any
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id,
                            getattr(model.config, "pad_token_id", None)) if isinstance(i, int)), 0)
    width = max(len(r) for r in rows)                # left padding, masked: any id serves
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
    if out.shape[1] != mask.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - mask.shape[1]} new tokens, not {new_tokens}")
    return Sample(out, torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens)], 1), new_tokens)
