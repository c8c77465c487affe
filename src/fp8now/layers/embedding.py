"""Fp8Embedding: an input embedding stored as FP8 rows with float32 dequantization scales (weight only).

A lookup gathers the FP8 rows of the ids and multiplies each by its scale, in float32, then casts to the
model dtype. The embedding's own quantization is per row (the `channel` weight rule of numerics.py: the
same bytes and scales the channel scheme gives that matrix). For tied word embeddings the embedding
reads the output head's FP8 weight and scale instead (one copy for both), so a lookup also reads the
other two scale layouts: one scalar (`tensor`) and 128x128 tiles (`block`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import Scheme
from .weights import keep_fp8_on_apply, weight_scale_shape
from ..numerics import E4M3FN, quantize_weight

EMBEDDING_SCHEME = Scheme.CHANNEL   # an untied embedding's own scales: one per row


def quantize_rows(w: torch.Tensor, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows and float32 per-row scales of an embedding `w [V, H]` -> (q [V, H], scale [V, 1]);
    NaN/Inf raise naming `name`."""
    return quantize_weight(w, EMBEDDING_SCHEME, name=name)


def row_scales(ids: torch.Tensor, scale: torch.Tensor, scheme: Scheme, width: int) -> torch.Tensor:
    """The scales of the rows `ids [...]` under `scheme`'s layout -> [..., 1] or, for blocks, [..., H]."""
    match scheme:
        case Scheme.CHANNEL:
            return scale.reshape(-1, 1)[ids]                                     # [..., 1]
        case Scheme.TENSOR:
            return scale.reshape(1).expand(*ids.shape, 1)                        # [..., 1]
        case Scheme.BLOCK:
            tiles = scale.reshape(-1, math.ceil(width / 128))[ids // 128]        # [..., H/128]
            return tiles.repeat_interleave(128, dim=-1)[..., :width]             # [..., H]
    raise ValueError(f"unknown weight scheme {scheme!r}")


def lookup(ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme,
           dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids [...]` of the FP8 table `q [V, H]`, dequantized in float32 -> [..., H] in `dtype`."""
    rows = q.view(torch.uint8)[ids].view(q.dtype).float()   # gathered as bytes: every device indexes uint8
    return (rows * row_scales(ids, scale, scheme, q.shape[1])).to(dtype)


class Fp8Embedding(nn.Module):
    """An `nn.Embedding` whose table is FP8 (`weight` [V, H]) with float32 scales (`weight_scale`).

    `scheme` says how `weight_scale` is laid out: channel `[V, 1]` (an embedding's own quantization),
    or, when the table is a tied output head's, that head's tensor `[]` or block layout. Lookups return
    `dtype`. `padding_idx` is kept as nn.Embedding keeps it: a forward returns that row as stored.
    Fill an empty one (e.g. on meta) with `load_(w)`, or share a head's tensors with `tie_to(head)`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 name: str = "", scheme: Scheme = EMBEDDING_SCHEME, tied_to: str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.name, self.scheme = name, scheme
        self.tied_to = tied_to    # the module name of the output head whose FP8 tensors this reads
        # Zero bytes in the lookup's dtype, registered first: transformers' `model.dtype` (the first float
        # parameter; generate builds masks in it) stays the model dtype, and a float cast (`.half()`)
        # changes the lookup's dtype as it would an nn.Embedding's. Not part of the state dict.
        self.dtype_anchor = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
        shape = weight_scale_shape(scheme, num_embeddings, embedding_dim)
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=E4M3FN.dtype, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device),
                                         requires_grad=False)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, name: str = "") -> Fp8Embedding:
        """Quantize an existing `nn.Embedding` per row (on its weight's device, returning its dtype)."""
        w = emb.weight.detach()
        layer = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, dtype=w.dtype, device="meta",
                    name=name)
        layer.load_(w)
        return layer

    @property
    def is_loaded(self) -> bool:
        return not self.weight.is_meta

    @property
    def dtype(self) -> torch.dtype:
        """The dtype lookups return (the model's)."""
        return self.dtype_anchor.dtype

    def _anchor_on(self, device: torch.device) -> None:
        if self.dtype_anchor.device != device:
            self.dtype_anchor = nn.Parameter(torch.empty(0, dtype=self.dtype, device=device), requires_grad=False)

    def load_(self, w: torch.Tensor) -> None:
        """Quantize a float table `[V, H]` per row into this module, in place when storage exists."""
        if self.tied_to is not None:
            raise ValueError(f"{self.name or 'embedding'} reads the FP8 weight of {self.tied_to} (tied word "
                             f"embeddings): load that head's weight instead")
        shape = (self.num_embeddings, self.embedding_dim)
        if tuple(w.shape) != shape:
            raise ValueError(f"{self.name or 'embedding'} weight has shape {tuple(w.shape)}, expected {shape}")
        q, s = quantize_rows(w if self.weight.is_meta else w.to(self.weight.device), self.name or None)
        if self.weight.is_meta:
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale = nn.Parameter(s, requires_grad=False)
        else:
            self.weight.data.copy_(q)
            self.weight_scale.data.copy_(s)
        self._anchor_on(self.weight.device)

    def tie_to(self, head: nn.Module) -> None:
        """Read the FP8 weight and scale of the output head `head` (an Fp8Linear): the same Parameters."""
        if tuple(head.weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{self.name}: tied head {self.tied_to} has weight {tuple(head.weight.shape)}, "
                             f"the embedding is {(self.num_embeddings, self.embedding_dim)}")
        self.weight, self.weight_scale, self.scheme = head.weight, head.weight_scale, head.scheme
        self._anchor_on(self.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup(ids, self.weight, self.weight_scale, self.scheme, self.dtype)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` moves the FP8 table and its float32 scale, never casts them (the anchor, and with it
        the lookup's dtype, follows a float cast)."""
        return super()._apply(keep_fp8_on_apply(fn, (self.weight, self.weight_scale)), recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.pop(prefix + "dtype_anchor", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.setdefault(prefix + "dtype_anchor", self.dtype_anchor)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.value}, dtype={self.dtype}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + (f", tied_to={self.tied_to}" if self.tied_to else ""))
