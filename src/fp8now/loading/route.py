"""Where each tensor of a source goes (`Dest`), checked from its header alone: the model name it fills, its shape
and dtype against what the model expects, tied aliases, transformers' renaming and experts-merging rules, and
what is skipped and why. For a whole checkpoint also: nothing unknown, nothing twice, nothing missing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..hf.legacy import legacy_reason
from ..layers.weights import check_float_weight
from .files import ST_DTYPES
from .slots import Slot, resolve_name
from .source import FileSource, Header


@dataclass(frozen=True)
class Dest:
    """Where one tensor goes. `kind`: a slot kind ("fp8", "embedding", "experts", "param", "buffer"), "adopt"
    (a pre-quantized FP8 layer's `part`), "adopt_experts", "skip" (with `why`) or "unknown"."""

    kind: str
    name: str
    why: str = ""
    part: str = ""        # adopt: weight, scale, bias or input_scale; experts: "expert" for one expert's tensor
    alias: bool = False   # reached through a tied weight's other name


class Router:
    """The routes of one plan: its slots (name -> Slot), tied aliases, computed buffers, the experts being
    merged (loading.experts.ExpertsLoad) and keys the plan routes itself (pre-quantized FP8 layers)."""

    def __init__(self, slots: dict[str, Slot], alias_of: dict[str, str], computed: set[str], prefix: str,
                 experts=None, explicit: dict[str, Dest] | None = None) -> None:
        self.slots, self.alias_of, self.computed, self.prefix = slots, alias_of, computed, prefix
        self.experts, self.explicit = experts, explicit or {}
        self.known = set(slots) | set(alias_of) | computed
        self._parts: dict[str, Dest] = {}

    def route(self, h: Header) -> Dest:
        """The destination of `h`; raises (naming the tensor and `h.where`) for a wrong shape or dtype."""
        if h.name in self.explicit:
            return self.explicit[h.name]
        if self.experts is not None and self.experts.is_part(h.key):   # renamed before: one expert's tensor
            name, _ = self.experts.claim(h.key, h.where, h.dtype, self.known, self.prefix)
            return self._part(name)
        name = resolve_name(h.name, self.known, self.prefix)
        if name is None and (why := legacy_reason(h.key)):
            return Dest("skip", h.key, why)
        if name is None and self.experts is not None:   # transformers' renaming / expert-merging rules
            name, is_part = self.experts.claim(h.key, h.where, h.dtype, self.known, self.prefix)
            if is_part:   # one of the tensors merged into a fused experts param
                return self._part(name)
        if name is None:
            return Dest("unknown", h.key)
        if name in self.computed:
            return Dest("skip", name, "non-persistent buffer: the model computes it")
        canon = self.alias_of.get(name, name)
        check_header(self.slots[canon], h)
        return Dest(self.slots[canon].kind, canon, alias=canon != name)

    def _part(self, fused: str) -> Dest:
        """The destination of one expert's tensor of `fused` (one object per fused param: ~1e4 keys per load)."""
        dest = self._parts.get(fused)
        if dest is None:
            dest = self._parts[fused] = Dest("experts", fused, part="expert")
        return dest


def _torch_dtype(name: str) -> torch.dtype | None:
    """A safetensors dtype name, or torch's own name of an in-memory tensor's dtype, as a torch dtype."""
    if name in ST_DTYPES:
        return ST_DTYPES[name]
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def check_header(slot: Slot, h: Header) -> None:
    """Exact shape, and for float targets a float dtype, before any data is read."""
    if tuple(h.shape) != slot.shape:
        hint = " (the checkpoint does not match its config.json)" if h.where.endswith(".safetensors") else ""
        raise ValueError(f"{h.where}: tensor {h.key!r} has shape {tuple(h.shape)}, the model expects "
                         f"{slot.shape}{hint}")
    if slot.is_float:
        dt = _torch_dtype(h.dtype)
        if dt is None:
            raise ValueError(f"{h.where}: tensor {h.key!r} has dtype {h.dtype}; expected BF16, F16, F32 or F64 "
                             "(fp8now quantizes float checkpoints; pre-quantized ones are another path)")
        try:
            check_float_weight(torch.empty(h.shape, dtype=dt, device="meta"), h.key, slot.shape)
        except ValueError as e:
            raise ValueError(f"{h.where}: {e}") from None


def route_files(router: Router, source: FileSource) -> tuple[dict[str, dict[str, Dest]], list[tuple[str, str]]]:
    """Route every tensor of a checkpoint: -> ({file: {key: Dest}} to read, [(key, why)] skipped). Raises for
    unknown tensors (all named at once), a tensor stored twice, an index that lies, and missing tensors."""
    model_dir = source.model_dir
    reads: dict[str, dict[str, Dest]] = {str(p): {} for p in source.files}
    skipped: list[tuple[str, str]] = []
    unexpected: list[str] = []
    first: dict[str, Header] = {}
    via_alias: dict[str, list[tuple[Header, Dest]]] = {}
    for h in source.headers():
        d = router.route(h)
        if d.kind == "unknown":
            unexpected.append(f"{h.key!r} in {Path(h.where).name}")
        elif d.kind == "skip":
            skipped.append((h.key, d.why))
        elif d.kind in ("adopt", "adopt_experts") or d.part == "expert":
            reads[h.where][h.key] = d
        elif d.alias:
            via_alias.setdefault(d.name, []).append((h, d))
        elif d.name in first:
            raise ValueError(f"tensor {h.key!r} appears twice: in {first[d.name].where} and in {h.where}; each "
                             "tensor must be stored once (the checkpoint is inconsistent; re-download it)")
        else:
            first[d.name] = h
            reads[h.where][h.key] = d
    for canon, tied in via_alias.items():
        if canon not in first:
            h, d = tied.pop(0)
            first[canon] = h
            reads[h.where][h.key] = d
        skipped += [(h.key, f"tied to {canon}, loaded once") for h, _ in tied]
    if unexpected:
        raise ValueError(f"{model_dir}: {len(unexpected)} tensor(s) the model does not define, e.g. "
                         f"{', '.join(unexpected[:5])}; the checkpoint does not match its config.json")
    source.check_index()
    merged = router.experts.check_parts(model_dir) if router.experts is not None else set()
    missing = [n for n, s in router.slots.items() if n not in first and n not in merged and s.kind != "buffer"]
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                         f"{', '.join(missing[:5])}; the checkpoint is incomplete or does not match "
                         "config.json (re-download it)")
    return reads, skipped
