"""Model names <-> checkpoint names, by transformers' own conversion rules (what save_pretrained and
from_pretrained apply): e.g. Mixtral's `mlp.gate` is `block_sparse_moe.gate` on disk. Export writes the
checkpoint's names so that every reader finds them; the pre-quantized loader maps them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def to_checkpoint_names(model: nn.Module, tensors: list[tuple[str, torch.Tensor]], exact: set[str]
                        ) -> list[tuple[str, torch.Tensor]]:
    """`tensors` under the checkpoint's names (transformers' reverse conversion; float experts kept in
    high precision are split per expert by it). A key in `exact` (FP8 bytes, scales) may be renamed, never
    converted: its tensor must come out as it went in."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(tensors))
    kept = {id(t) for t in out.values()}
    changed = [key for key, t in tensors if key in exact and id(t) not in kept]
    if changed:
        raise ValueError(f"{changed[0]}: transformers converts this tensor between the model and its files "
                         "(more than a renaming), which fp8now cannot do to FP8 bytes and their scales; keep "
                         "that layer in high precision (Fp8Config.ignore) to export this model")
    return list(out.items())


def checkpoint_module_names(model: nn.Module, names: list[str]) -> list[str]:
    """Module names as the checkpoint spells them (for compressed-tensors' targets and ignore lists)."""
    probes = {f"{name}.weight": torch.empty(0) for name in names}
    back = {id(t): key for key, t in to_checkpoint_names(model, list(probes.items()), set(probes))}
    return [back[id(t)].removesuffix(".weight") for t in probes.values()]


def model_key(model: nn.Module) -> Callable[[str], str]:
    """checkpoint key -> the model's name for it, by transformers' renamings (no merging of experts)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model, add_legacy=False) if isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


def find_key(name: str, keys: dict, prefix: str) -> str | None:
    """The checkpoint key of model tensor `name`, allowing a missing or extra base-model prefix."""
    for cand in (name, name.removeprefix(prefix + ".") if prefix else name, f"{prefix}.{name}"):
        if cand in keys:
            return cand
    return None
