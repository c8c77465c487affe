"""Sibling FP8 linears fed by one RMSNorm producer (q/k/v behind the attention's norm, gate/up behind the MLP's),
stacked: their FP8 weights, scales and biases become row slices of one buffer each, so that a one-token call
runs one GEMV over all of them (`kernels.triton_gemv`) where it ran one launch per layer.

Why: a Llama-3.1-8B decode step at B = 1 launches 224 GEMVs, and a read-only kernel costs ~2.9 µs beyond its
bytes on an H100, so the launches alone cap the step's GEMVs at ~2.34 TB/s (BENCHMARKS.md "Whole model");
stacked, q/k/v take one launch and gate/up one: 96 fewer a step.

When (`Stack.output`): the table's `stacked_gemv` is on, the call has one row, its FP8 input came from the
producer (the handoff), every member's plan for that call is the GEMV reading the producer's bytes, and every
member's weight, scale and bias still are the stack's slices (`intact`: a `.to()` or a re-bound parameter breaks
the stack, and the layers then run alone). The first member called computes every member's output and keeps the
others' until they are called with the same FP8 input, or until the module reading the norm returns (`clear`).

Bytes: the stacked launch runs the GEMV config each member runs alone (stacked only where they are one config,
`gemv_config`), and every output row's products and sums are the same operations in the same order, so the
outputs are bit-identical to the members' own launches (tests/test_stacked.py).

Storage: built at load (`producers.install`), once per group; a reload writes the slices in place (the
`Fp8Linear.load_` contract: same tensors, same data_ptr), so the stack and captured graphs stay valid. A member
moved to another device (`model.to(...)`) dissolves the stack (`dissolve`): nothing keeps the old buffers alive.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..kernels.plan import Weights
from . import decode_graphs
from .linear import Fp8Linear

STACKED_SCHEMES = ("channel", "block")   # one scale per row or per 128-row tile: the slices are whole rows


def gemv_config(layer: Fp8Linear) -> dict:
    """The GEMV config `kernels.triton_gemv` picks for one row of this layer."""
    from ..kernels.triton_gemv import gemv_config as config_of   # Triton is imported for the triton backend only
    return config_of(1, layer.scheme.value, layer.out_features)


def unstackable(layers: list[Fp8Linear]) -> str | None:
    """None if `layers` can share one buffer per tensor and one GEMV launch; else why not."""
    if len(layers) < 2:
        return "fewer than two layers"
    first = layers[0]
    if any(layer.backend != "triton" for layer in layers):
        return "not all on the triton backend"
    if first.scheme.value not in STACKED_SCHEMES:
        return f"scheme {first.scheme.value} (one scale per layer)"
    if any((layer.scheme, layer.act_kind, layer.in_features, layer.weight.device, layer.fast_accum,
            layer.batch_invariant) != (first.scheme, first.act_kind, first.in_features, first.weight.device,
                                       first.fast_accum, first.batch_invariant) for layer in layers):
        return "the layers differ in scheme, activation scales, K, device or accumulation"
    if any(not (layer.weight.is_contiguous() and layer.weight_scale.is_contiguous()) for layer in layers):
        return "a weight or scale is not contiguous"
    if len({None if layer.bias is None else layer.bias.dtype for layer in layers}) != 1:
        return "some layers have a bias and others not (or of another dtype)"
    if first.scheme.value == "block" and any(layer.out_features % 128 for layer in layers):
        return "block scales need every layer's N to be a multiple of 128"
    if len({tuple(sorted(gemv_config(layer).items())) for layer in layers}) != 1:
        return "the layers' one-row GEMVs run different configs"
    return None


def _addresses(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int]:
    """Where a weight, its scale and its bias (0: none) live: a member's slices, or the stack's buffers."""
    return weight.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr()


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(t.shape[0], -1) for t in tensors]).reshape(
        sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])


class Stack:
    """The stacked storage of `members` (FP8 linears reading one input) and the one-row GEMV over it."""

    def __init__(self, members: list[Fp8Linear]) -> None:
        why = unstackable(members)
        if why is not None:
            raise ValueError(f"cannot stack {', '.join(m.name or '?' for m in members)}: {why}")
        self.members = list(members)
        self.config = gemv_config(members[0])
        with torch.no_grad():
            self.weight = _stacked([m.weight for m in members])
            self.scale = _stacked([m.weight_scale for m in members])
            self.bias = None if members[0].bias is None else _stacked([m.bias for m in members])
        self.rows: list[tuple[int, int]] = []   # each member's rows of the stacked weight
        start = 0
        for m in members:
            self.rows.append((start, start + m.out_features))
            start += m.out_features
        for m, (a, b) in zip(members, self.rows):   # the members' tensors become the stack's slices
            sa, sb = a * self.scale.shape[0] // start, b * self.scale.shape[0] // start
            m.weight = nn.Parameter(self.weight[a:b], requires_grad=False)
            m.weight_scale = nn.Parameter(self.scale[sa:sb], requires_grad=False)
            if self.bias is not None:
                m.bias = nn.Parameter(self.bias[a:b], requires_grad=False)
            m.stack = self
        self.addresses = [self._addresses_of(m) for m in members]   # where each member's slices live
        graphed = all(m._graphs is not None for m in members)
        self.graph_rows = decode_graphs.max_rows(start, members[0].in_features) if graphed else 0
        self.graphs = decode_graphs.DecodeGraphs() if self.graph_rows else None
        self.key: torch.Tensor | None = None              # the FP8 input the kept outputs were made of
        self.kept: dict[int, torch.Tensor] = {}           # id(member) -> its output, until it takes it

    @staticmethod
    def _addresses_of(m: Fp8Linear) -> tuple[int, int, int]:
        return _addresses(m.weight, m.weight_scale, m.bias)

    def intact(self) -> bool:
        """Is every member's weight, scale and bias still its slice of the stack (same storage, same place)?
        (Their addresses as the stack made them: a `.to()` or a re-bound parameter moves one.)"""
        return all(self._addresses_of(m) == where for m, where in zip(self.members, self.addresses))

    def output(self, layer: Fp8Linear, x_q: torch.Tensor, x_s: torch.Tensor, out_dtype: torch.dtype
               ) -> torch.Tensor | None:
        """`layer`'s output [1, N] for the producer's FP8 row `x_q` [1, K] (scales `x_s`), from one GEMV over
        the stack (computed now, or kept from a sibling's call on the same bytes); None where the stack does
        not apply (the layer then runs alone)."""
        if x_q.shape[0] != 1 or not layer.table.stacked_gemv:
            return None
        if self.key is x_q and id(layer) in self.kept:
            return self.kept.pop(id(layer))
        paths = [m.planned(1, True) for m in self.members]
        if any(p.gemm != "triton-gemv" or p.quant != m.producer for p, m in zip(paths, self.members)):
            return None
        if not self.intact():
            return None
        path = replace(paths[0], config=tuple(self.config.items()), pdl=False)
        weights = Weights(self.weight, self.scale, self.bias, None)

        def call(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return layer._impl.linear_fp8(q, s, out_dtype, weights, path)
        if self.graph_rows and decode_graphs.usable(x_q):
            y = self.graphs.run((x_q, x_s), call, self.weight.shape[0], _addresses(self.weight, self.scale, self.bias),
                                out_dtype)
        else:
            y = call(x_q, x_s)
        self.key = x_q
        self.kept = {id(m): y[:, a:b] for m, (a, b) in zip(self.members, self.rows) if m is not layer}
        a, b = self.rows[self.members.index(layer)]
        return y[:, a:b]

    def dissolve(self) -> None:
        """Let go of the stacked buffers (a member moved to another device): the members run alone from now on."""
        for m in self.members:
            m.stack = None
        self.weight = self.scale = self.bias = self.graphs = None
        self.key, self.kept = None, {}

    def clear(self, *_) -> None:
        """Drop the kept outputs (the module reading the norm returned)."""
        self.key, self.kept = None, {}


def stack(layers: list[Fp8Linear]) -> Stack | None:
    """Stack `layers` (see the module's docstring) where they can be; None otherwise."""
    return Stack(layers) if unstackable(layers) is None else None
