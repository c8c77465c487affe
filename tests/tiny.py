"""Tiny real transformers models and their safetensors checkpoints, for the tests (not shipped in the wheel).

Every family below exists in transformers 5.24 (`llama`, `qwen2`, `qwen3`, `mistral`, `gemma`, `phi3`).
The sizes are small but chosen so that 128x128 block tiles are partial somewhere: hidden 192
(1.5 tiles), intermediate 320 (2.5 tiles), key/value projections of 64 rows.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")

# Shared tiny sizes: 6 heads of 32 (hidden 192), 2 key/value heads (GQA), 2 layers.
_COMMON: dict[str, Any] = dict(
    hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
_PER_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(),
    "qwen2": dict(),                       # q/k/v projections carry a bias
    "qwen3": dict(head_dim=32),            # per-head q/k norms
    "mistral": dict(sliding_window=None, head_dim=32),
    "gemma": dict(head_dim=32, hidden_act="gelu_pytorch_tanh"),  # (1 + w) norms, scaled embeddings, tied
    "phi3": dict(),                        # fused qkv_proj [320, 192] and gate_up_proj [640, 192]
}


def tiny_config(family: str, **overrides: Any):
    """A small transformers config of `family` (see FAMILIES); keyword overrides replace any field."""
    from transformers import AutoConfig

    if family not in _PER_FAMILY:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    fields = {**_COMMON, **_PER_FAMILY[family], **overrides}
    return AutoConfig.for_model(family, **fields)


def _fill_(params: list[tuple[str, nn.Parameter]], generator: torch.Generator) -> None:
    """Seeded, never-zero values with rows of varied magnitude (so per-row scales differ)."""
    with torch.no_grad():
        for name, p in params:
            shape = tuple(p.shape)
            if len(shape) >= 2:
                fan_in = shape[-1]
                rows = torch.exp(0.5 * torch.randn(shape[:-1] + (1,), generator=generator))
                base = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                value = torch.randn(shape, generator=generator) * rows * base
            elif name.endswith("bias"):
                value = 0.02 * torch.randn(shape, generator=generator)
            else:  # norm weights: around 1 (gemma adds 1 itself, so it sees ~1.1 +- 0.1)
                value = 1.0 + 0.1 * torch.randn(shape, generator=generator)
            p.copy_(value.to(p.dtype))


def tiny_model(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               tie: bool | None = None, **overrides: Any) -> nn.Module:
    """The real transformers CausalLM of `family`, with seeded random weights, in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    if tie is not None:
        overrides["tie_word_embeddings"] = tie
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    _fill_(list(model.named_parameters()), generator)   # tied parameters appear once
    config.architectures = [type(model).__name__]
    return model.eval()


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without tied duplicates (the first name of a shared tensor is kept)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = id(t) if t.data_ptr() == 0 else t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def save_checkpoint(tensors: dict[str, torch.Tensor], config: dict[str, Any] | Any, directory: str | Path,
                    shards: int = 1) -> Path:
    """Write `config.json` and safetensors (sharded with an index when shards > 1) atomically.

    Files are written into a temporary sibling folder that is renamed to `directory` at the end, so a
    failure never leaves a half-written checkpoint. `directory` must not exist or be empty.
    """
    from safetensors.torch import save_file

    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not an empty folder; choose a new path")
    if shards < 1 or shards > max(len(tensors), 1):
        raise ValueError(f"shards must be between 1 and the number of tensors ({len(tensors)}), got {shards}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if isinstance(config, dict):
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        else:
            config.save_pretrained(tmp)
        groups = _split(list(tensors), shards, {k: t.numel() * t.element_size() for k, t in tensors.items()})
        if shards == 1:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, names in enumerate(groups):
                fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                save_file({k: tensors[k] for k in names}, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in names})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _split(names: list[str], parts: int, sizes: dict[str, int]) -> list[list[str]]:
    """Consecutive groups of roughly equal bytes, none empty."""
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(parts)]
    acc, g = 0, 0
    for i, name in enumerate(names):
        left_names, left_groups = len(names) - i, parts - g
        if groups[g] and (acc >= total * (g + 1) / parts or left_names < left_groups) and g < parts - 1:
            g += 1
        groups[g].append(name)
        acc += sizes[name]
    return groups


def write_tiny_checkpoint(directory: str | Path, family: str, dtype: torch.dtype = torch.bfloat16,
                          seed: int = 0, shards: int = 1, tie: bool | None = None,
                          **overrides: Any) -> Path:
    """Build `tiny_model(family)` and save it as a Hugging Face checkpoint in `directory`.

    `tie=None` keeps the family's default for `tie_word_embeddings`; tied checkpoints omit
    `lm_head.weight`, as `save_pretrained` does. Returns the folder.
    """
    model = tiny_model(family, dtype=dtype, seed=seed, tie=tie, **overrides)
    return save_checkpoint(unique_state_dict(model), model.config, directory, shards=shards)
