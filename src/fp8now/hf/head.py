"""The output head and the input embedding of a transformers model under `Fp8Config(head=, embedding=)`:
which modules they are, whether the options fit the model (tied word embeddings), and the embedding swap.

The head itself becomes an ordinary Fp8Linear target (hf.target_linears); the embedding becomes an
`Fp8Embedding`, which for tied word embeddings reads the head's FP8 tensors (one copy for both).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Fp8Config
from ..layers.embedding import Fp8Embedding
from .modules import embedding_name, head_name, match_ignore, set_submodule
from ..layers.linear import Fp8Linear


def is_tied(model: nn.Module, head: str | None, emb: str | None) -> bool:
    """True when the head's weight is the embedding's (tie_word_embeddings), also once either is FP8."""
    if head is None or emb is None:
        return False
    h, e = model.get_submodule(head), model.get_submodule(emb)
    if isinstance(e, Fp8Embedding):
        return e.tied_to == head
    if isinstance(h.weight, torch.Tensor) and h.weight is e.weight:
        return True
    config = getattr(model, "config", None)   # before transformers ties them (the from_pretrained door)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False) and getattr(model, "_tied_weights_keys", None))


def check_options(model: nn.Module, config: Fp8Config, where: str) -> tuple[str | None, str | None]:
    """(head name, embedding name) the options act on (None where off); a clear error where they do not fit.

    Tied word embeddings share one matrix, so head and embedding must be on together or off together
    (one FP8 copy then serves both); the head counts as off when an ignore pattern matches it.
    """
    head, emb = head_name(model), embedding_name(model)
    if config.head and (head is None or not isinstance(model.get_submodule(head), (nn.Linear, Fp8Linear))):
        raise ValueError(f"{where}: head=True, but {type(model).__name__} has no output linear "
                         "(get_output_embeddings()); load with head=False")
    if config.embedding:
        module = None if emb is None else model.get_submodule(emb)
        if type(module) is not nn.Embedding and not isinstance(module, Fp8Embedding):
            kind = "none" if module is None else type(module).__name__
            raise ValueError(f"{where}: embedding=True needs a plain torch nn.Embedding as the input embedding "
                             f"(get_input_embeddings()), found {kind} at {emb}: a subclass may scale or change its "
                             "lookup, which Fp8Embedding does not; load with embedding=False")
        if isinstance(module, nn.Embedding) and module.max_norm is not None:
            raise ValueError(f"{where}: {emb} renormalizes rows (max_norm); load with embedding=False")
    head_on = config.head and match_ignore(head, config.ignore) is None
    if is_tied(model, head, emb) and head_on != config.embedding:
        why = (f"head=True but ignore pattern {match_ignore(head, config.ignore)!r} keeps {head} in high "
               "precision" if config.head and not head_on else f"head={config.head}, embedding={config.embedding}")
        raise ValueError(f"{where}: {head}.weight is tied to {emb}.weight (tie_word_embeddings), and {why}: "
                         "FP8 for one of them would break the tie and hold the matrix twice; pass head=True and "
                         "embedding=True together (one FP8 copy for both), or neither")
    return (head if head_on else None), (emb if config.embedding else None)


def swap_embedding(model: nn.Module, name: str, head: str | None, tied: bool,
                   dtype: torch.dtype) -> Fp8Embedding:
    """Replace the nn.Embedding at `name` with an empty meta Fp8Embedding (reading `head`'s tensors if tied)."""
    old = model.get_submodule(name)
    if isinstance(old, Fp8Embedding):
        return old
    layer = Fp8Embedding(old.num_embeddings, old.embedding_dim, old.padding_idx, dtype=dtype, device="meta",
                         name=name, tied_to=head if tied else None)
    set_submodule(model, name, layer)
    return layer


def tie_embeddings(model: nn.Module) -> None:
    """Point every tied Fp8Embedding at its head's current FP8 Parameters (after the head was loaded)."""
    for module in model.modules():
        if isinstance(module, Fp8Embedding) and module.tied_to is not None:
            head = model.get_submodule(module.tied_to)
            if not isinstance(head, Fp8Linear):
                raise RuntimeError(f"{module.name} is tied to {module.tied_to}, which is not FP8; this is a bug "
                                   "in fp8now: please report it")
            module.tie_to(head)


def prepare(model: nn.Module, config: Fp8Config, where: str, dtype: torch.dtype, tp: bool = False) -> None:
    """Before a load or quantize_: check the options against the model, and swap the embedding for an
    empty Fp8Embedding where asked (the head is an ordinary target of hf.target_linears)."""
    if tp and (config.head or config.embedding):
        raise ValueError(f"{where}: head=True / embedding=True are not supported with tp_plan yet (the FP8 head "
                         "and embedding are not sharded); load with head=False and embedding=False under "
                         "tensor parallelism")
    head, emb = check_options(model, config, where)
    if emb is not None:
        swap_embedding(model, emb, head, is_tied(model, head, emb), dtype)
