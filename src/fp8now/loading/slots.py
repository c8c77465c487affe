"""Every tensor a checkpoint may hold for a model, and where each goes: an FP8 layer's weight or bias, an FP8
embedding's table, fused experts params, or a plain parameter or buffer; checkpoint keys -> model names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..layers.embedding import Fp8Embedding
from ..layers.linear import Fp8Linear


@dataclass
class Slot:
    """Where one named tensor goes: an FP8 layer's weight/bias ("fp8"), a parameter, or a buffer."""

    kind: str                      # "fp8" | "embedding" (an Fp8Embedding's table) | "param" | "buffer"
    owner: nn.Module
    leaf: str
    shape: tuple[int, ...]
    is_float: bool = True
    keep_fp32: bool = False        # the model keeps this parameter in float32
    aliases: list[tuple[nn.Module, str]] = field(default_factory=list)  # other owners (tied weights)


def model_slots(model: nn.Module) -> tuple[dict[str, Slot], dict[str, str], set[str]]:
    """Every tensor a checkpoint may hold for `model`: (name -> Slot, tied alias -> name, computed).

    An `Fp8Linear` expects `weight` (and `bias`), never its scale; an `Fp8Embedding` its float `weight`,
    or, tied to an FP8 head, nothing of its own (its name is an alias of the head's weight). A tied parameter is listed once
    under its first name; its other names map to it. `computed`: non-persistent buffers (e.g. RoPE
    `inv_freq`) that the model builds itself; a checkpoint holding them is tolerated.
    """
    slots: dict[str, Slot] = {}
    alias_of: dict[str, str] = {}
    computed: set[str] = set()
    first: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        pre = f"{mod_name}." if mod_name else ""
        if isinstance(module, Fp8Linear):
            n, k = module.out_features, module.in_features
            slots[pre + "weight"] = Slot("fp8", module, "weight", (n, k))
            if module.bias is not None:
                slots[pre + "bias"] = Slot("fp8", module, "bias", (n,))
            continue
        if isinstance(module, Fp8Embedding):   # its float table; tied: the head's weight under another name
            if module.tied_to is not None:
                alias_of[pre + "weight"] = f"{module.tied_to}.weight"
            else:
                slots[pre + "weight"] = Slot("embedding", module, "weight",
                                             (module.num_embeddings, module.embedding_dim))
            continue
        for leaf, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                alias_of[pre + leaf] = first[id(p)]
                slots[first[id(p)]].aliases.append((module, leaf))
                continue
            first[id(p)] = pre + leaf
            slots[pre + leaf] = Slot("param", module, leaf, tuple(p.shape), p.is_floating_point())
        for leaf, b in module._buffers.items():
            if b is None:
                continue
            if leaf in module._non_persistent_buffers_set:
                computed.add(pre + leaf)
            else:
                slots[pre + leaf] = Slot("buffer", module, leaf, tuple(b.shape), b.is_floating_point())
    return slots, alias_of, computed


def keep_fp32_names(model: nn.Module, names) -> set[str]:
    """Names the model asks to keep in float32 (`_keep_in_fp32_modules[_strict]`, e.g. MoE router weights)."""
    patterns = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    if not patterns:
        return set()
    rx = re.compile("|".join(rf"(^|\.){re.escape(p)}(\.|$)" for p in patterns))
    return {n for n in names if rx.search(n)}


def resolve_name(key: str, known: set[str] | dict, prefix: str) -> str | None:
    """Map a checkpoint key onto a model name, allowing a missing or extra `base_model_prefix`."""
    if key in known:
        return key
    if prefix:
        if f"{prefix}.{key}" in known:
            return f"{prefix}.{key}"
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in known:
            return key[len(prefix) + 1:]
    return None
