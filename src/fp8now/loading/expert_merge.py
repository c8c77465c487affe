"""The merge of per-expert checkpoint tensors into transformers' fused experts parameters, in one copy where
transformers' converter would make two (a stack per source pattern, then their concatenation)."""

from __future__ import annotations

import torch


def one_copy_merge(rule, parts: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """transformers' merge of per-expert tensors (`parts`: per source pattern, per expert in order) where its
    operations are MergeModulelist(dim=0) (a stack: down_proj) or that then Concatenate(dim=1) (gate_up_proj:
    [E, I, H] stacks joined along dim 1), done as one copy: the result[e] = cat(pattern_0[e], pattern_1[e], ...), so
    the parts interleaved by expert and concatenated along dim 0 are the same bytes. None where the operations are
    other ones or the parts differ in shape, dtype or device (transformers' converter then runs, and says why)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
    if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) or not parts[0] \
            or (len(ops) == 1 and len(parts) != 1):
        return None
    first = parts[0][0]
    if first.dim() == 0:
        return None
    if any(len(p) != len(parts[0]) for p in parts) or any(
            t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for p in parts for t in p):
        return None
    if len(parts) == 1:
        return torch.stack(parts[0])
    interleaved = [p[e] for e in range(len(parts[0])) for p in parts]
    return torch.cat(interleaved).view(len(parts[0]), len(parts) * first.shape[0], *first.shape[1:])
