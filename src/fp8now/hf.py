"""transformers integration: the meta skeleton, which linears to quantize, the module swap, the
checkpoint-name mapping. The safetensors layout itself lives in checkpoint.py."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import Fp8Config
from .custom_code import load_config
from .embedding import Fp8Embedding
from .linear import Fp8Linear
from .meta import ThreadDefaultDtype, parameters_on_meta

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Leaf names of MoE router / gating linears: never quantized (their logits pick experts).
_ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")


def read_config(model_dir: Path) -> PretrainedConfig:
    """The transformers config of a checkpoint folder; clear errors for a missing/odd config.json."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist or is not a folder")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face checkpoint folder needs config.json "
                                "next to its *.safetensors files")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); re-download it") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ValueError(f"{path} has no 'model_type'; fp8now needs a transformers model config")
    if model_type not in CONFIG_MAPPING:
        hint = " (it uses custom code via auto_map, which fp8now does not run)" if "auto_map" in raw else ""
        raise ValueError(f"{path}: model_type {model_type!r} is not known to the installed transformers"
                         f"{hint}; upgrade transformers or use a supported architecture")
    return load_config(model_dir)


def build_skeleton(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The CausalLM of `model_dir/config.json` with parameters on meta and real buffers (CPU)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = read_config(model_dir)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "none listed"
        raise ValueError(f"{model_dir / 'config.json'}: model_type {config.model_type!r} (architectures: "
                         f"{archs}) has no causal-LM class in transformers; fp8now loads decoder LLMs")
    with parameters_on_meta(), ThreadDefaultDtype(dtype):
        model = AutoModelForCausalLM.from_config(config, dtype=None)  # None: no torch.set_default_dtype
    config.dtype = dtype
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def _inside_block(name: str) -> bool:
    """True for modules inside a stack of blocks (a ModuleList index in the path: `layers.3.mlp`)."""
    return any(part.isdigit() for part in name.split(".")[:-1])


def match_ignore(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches module `name`: exact (also its submodules), fnmatch glob, `re:`."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return pattern
        elif name == pattern or name.startswith(pattern + "."):
            return pattern
        elif any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> the other names of the same Parameter object (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: [m for m in names if m != n] for names in by_id.values() if len(names) > 1 for n in names}


def _name_of(model: nn.Module, getter: str) -> str | None:
    """Module name of what `model.<getter>()` returns (None: no such method or module)."""
    fn = getattr(model, getter, None)
    try:
        module = fn() if callable(fn) else None
    except (AttributeError, NotImplementedError):
        return None
    return None if module is None else next((n for n, m in model.named_modules() if m is module), None)


def head_name(model: nn.Module) -> str | None:
    """Module name of the output head (`get_output_embeddings()`, normally `lm_head`), or None."""
    return _name_of(model, "get_output_embeddings")


def embedding_name(model: nn.Module) -> str | None:
    """Module name of the input embedding (`get_input_embeddings()`), or None."""
    return _name_of(model, "get_input_embeddings")


def target_linears(model: nn.Module, config: Fp8Config
                   ) -> tuple[dict[str, nn.Linear], list[tuple[str, str]]]:
    """The `nn.Linear`s to quantize, and every other linear with the reason it is left alone.

    Targets: linears inside the transformer blocks (attention, MLP, shared experts), and the output head
    with `config.head` (its tie to the embedding is hf_head.check_options' concern). Left alone: anything
    else outside the blocks (the head by default, projectors), MoE routers (`gate`, `router`), tied
    weights, and names matching `config.ignore` (a pattern wins over head=True). Existing `Fp8Linear`s
    are listed as already quantized.
    """
    tied = tied_names(model)
    head = head_name(model)
    targets: dict[str, nn.Linear] = {}
    ignored: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            ignored.append((name, "already FP8 (not quantized again)"))
            continue
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        pattern = match_ignore(name, config.ignore)
        if pattern is not None:
            reason = f"matches ignore pattern {pattern!r}" + (" (wins over head=True)" if name == head
                                                                and config.head else "")
        elif name == head and config.head:
            targets[name] = module
            continue
        elif name == head:
            reason = "outside the transformer blocks (output head; Fp8Config(head=True) quantizes it)"
        elif not _inside_block(name):
            reason = "outside the transformer blocks (output head / projector)"
        elif leaf in _ROUTER_LEAVES or leaf.endswith("_router"):
            reason = "MoE router (gate) layer"
        elif f"{name}.weight" in tied:
            reason = f"weight tied to {tied[f'{name}.weight'][0]}"
        else:
            targets[name] = module
            continue
        ignored.append((name, reason))
    return targets, ignored


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path `name`."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def swap_linears(model: nn.Module, targets: dict[str, nn.Linear], config: Fp8Config,
                 device: torch.device | str = "meta", dtype: torch.dtype = torch.bfloat16
                 ) -> dict[str, Fp8Linear]:
    """Replace each target with an empty `Fp8Linear` (on `device`, normally meta) named by its path."""
    swapped: dict[str, Fp8Linear] = {}
    for name, linear in targets.items():
        layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, config,
                          device=device, dtype=dtype, name=name)
        set_submodule(model, name, layer)
        swapped[name] = layer
    return swapped


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

