"""The unquantized reference model: plain transformers in bf16 (what `fp8now eval` and the sensitivity pass
compare FP8 models against)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_bf16(model_dir: Path, device: torch.device) -> nn.Module:
    """The unquantized reference: plain transformers in bf16, eval mode; onto a GPU straight from the
    files (device_map), as a user loads it there."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    placed = {"device_map": str(device)} if torch.device(device).type == "cuda" else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16,
                                                     trust_remote_code=False, **placed)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()
