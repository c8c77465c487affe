"""Checkpoint tensors that older transformers versions saved and today's models compute themselves:
skipped (and listed in the report) instead of refused as unknown, as transformers itself does."""

from __future__ import annotations

import re

# (pattern of a checkpoint key, why it is skipped): one row per kind of legacy tensor.
LEGACY_TENSORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), "legacy RoPE inv_freq table: the model computes it"),
)


def legacy_reason(key: str) -> str | None:
    """Why checkpoint tensor `key` is skipped as a legacy tensor, or None when it is not one."""
    return next((why for pattern, why in LEGACY_TENSORS if pattern.search(key)), None)
