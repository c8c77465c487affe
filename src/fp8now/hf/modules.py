"""The modules of a transformers model that fp8now acts on: which linears to quantize (and why the others are
left alone), the output head and input embedding, tied weights, and the module swap."""

from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

from ..config import Fp8Config
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts

# Leaf names of MoE router / gating linears: never quantized (their logits pick experts).
_ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")


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


def freeze_fp8(model: nn.Module) -> None:
    """No gradients for the FP8 layers' tensors; the model's other parameters keep requires_grad as
    `from_pretrained` leaves them (True). Freezing those too would cost time on CPU: torch then folds a
    3-D input's matmul with a frozen weight through a transposed copy of the weight, 54 MiB and ~150 ms
    on every prefill for the embedded model's tied lm_head."""
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            module.requires_grad_(False)
