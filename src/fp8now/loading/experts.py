"""Streaming load of MoE experts: checkpoint tensors -> fused experts params -> Fp8Experts, per layer.

Most families store experts one by one on disk (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`); transformers merges them at load with its own conversion
rules (`get_model_conversion_mapping`), and so do we: a key is renamed by those rules, and the
per-expert tensors of a fused parameter wait on the host until all experts of the layer arrived;
then transformers' converter builds the fused tensor, and the layer is quantized at once.
"""

from __future__ import annotations

import re
from collections import Counter
from copy import deepcopy
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..hf.experts import BIAS_LEAVES, FUSED_LEAVES, ExpertsLayout, hf_shapes, hf_to_fused
from ..layers.finite import NonFiniteExperts
from ..layers.weights import check_float_weight
from ..layers.moe import Fp8Experts
from ..report import ExpertsRow
from .expert_merge import one_copy_merge
from .files import ST_DTYPES
from .rows import experts_row
from .slots import Slot

# Fp8Experts leaf -> the transformers parameter it is quantized from (error messages name the latter).
HF_LEAF = {"w13": "gate_up_proj", "w2": "down_proj", "w13_bias": "gate_up_proj_bias", "w2_bias": "down_proj_bias"}


def _natural(key: str) -> tuple:
    """Sort key that orders `experts.10` after `experts.9`."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))


def expert_index(key: str, pattern: str) -> int | None:
    """The expert number that the `*` of a transformers source pattern matches in `key`."""
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else None


class ExpertsLoad:
    """The experts of one load (`layers`: swapped to meta `Fp8Experts` by `hf.experts.swap_experts`) or of one
    `reload_weights` call (None: the model's loaded `Fp8Experts`, rewritten in place), fed tensor by tensor."""

    def __init__(self, model: nn.Module, layers: dict[str, tuple[Fp8Experts, ExpertsLayout]] | None = None,
                 tp=None) -> None:
        """`tp`: a reload on a tensor-parallel model, the load's `parallel.experts.ExpertsTp` (full tensors in,
        this rank's parts kept)."""
        self.model = model
        reload = layers is None
        if layers is None:
            layers = {name: (m, m.hf_layout) for name, m in model.named_modules()
                      if isinstance(m, Fp8Experts) and m.hf_layout is not None}
        self.layers = layers
        self.fused = {f"{name}.{leaf}": (name, shape) for name, (layer, layout) in self.layers.items()
                      for leaf, shape in hf_shapes(layer, layout).items()}
        if tp is not None:   # the checkpoint's shapes, not this rank's part
            self.fused = {fused: (name, tp.full_shape(fused, shape)) for fused, (name, shape) in self.fused.items()}
        self.rules: tuple[list, list] | None = None
        # key -> (model name or None, source pattern, expert id) by transformers' rules: pure for one model, so a
        # reload keeps it on the model for the next (an RL refit renames the same ~1e4 per-expert keys every step)
        self._renamed: dict[str, tuple] = {} if not reload else model.__dict__.setdefault("_fp8now_renamed", {})
        self.parts: dict[str, dict[str, list[str]]] = {}      # fused name -> source pattern -> keys
        self.pattern_of: dict[str, str] = {}                  # checkpoint key -> its source pattern
        self.converter_of: dict[str, object] = {}             # source pattern -> transformers converter
        self.pending: dict[str, dict[str, object]] = {}       # layer -> fused leaf -> tensor or {key: tensor}
        self.rows: list[ExpertsRow] = []
        self._lookup: dict[str, bool] | None = None
        self.checked = False   # NaN/Inf of every tensor were checked before the first write (a reload's dict)
        self.tp = tp     # parallel.experts.ExpertsTp under tensor parallelism: which parts to read, how to quantize

    def add_slots(self, slots: dict[str, Slot]) -> None:
        """Replace the swapped layers' own FP8 params in `slots` by the transformers names they load from."""
        for name in [n for n, s in slots.items() if isinstance(s.owner, Fp8Experts)]:
            del slots[name]
        for fused, (name, shape) in self.fused.items():
            slots[fused] = Slot("experts", self.layers[name][0], fused.rsplit(".", 1)[1], shape)

    def _rules(self) -> tuple[list, list]:
        if self.rules is None:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            transforms = get_model_conversion_mapping(self.model, add_legacy=False)
            self.rules = ([t for t in transforms if isinstance(t, WeightRenaming)],
                          [t for t in transforms if isinstance(t, WeightConverter)])
            self.converter_of = {p: c for c in self.rules[1] for p in c.source_patterns}
        return self.rules

    def rename(self, key: str, known: set[str], prefix: str) -> tuple[str | None, str | None]:
        """A key our names do not know, renamed by transformers' rules: (model name or None, the source
        pattern when it is one of several tensors (e.g. one expert) that make a fused experts param)."""
        from transformers.core_model_loading import rename_source_key

        renamings, converters = self._rules()
        if self._lookup is None:   # built once: a checkpoint may hold ~1e5 per-expert keys
            self._lookup = dict.fromkeys(known | set(self.fused), True)
        renamed, pattern = rename_source_key(key, renamings, converters, prefix or None, self._lookup)
        return (renamed, pattern) if renamed in self._lookup else (None, None)

    def is_part(self, key: str) -> bool:
        """Was `key` renamed before (this load, or an earlier reload of the model) as one expert's tensor of a
        fused param? Then it is no model name (renaming is only tried for keys that are none)."""
        memo = self._renamed.get(key)
        return memo is not None and memo[0] is not None and memo[1] is not None

    def claim(self, key: str, path: Path | str, st_dtype: str, known: set[str], prefix: str
              ) -> tuple[str | None, bool]:
        """`rename`, and note a per-expert tensor as a part of its fused param: (model name or None, is_part).
        `path`: where the key comes from (its file, or the call), for messages."""
        self._rules()   # (the converters, also when the memo answers)
        memo = self._renamed.get(key)
        if memo is None:
            renamed, pattern = self.rename(key, known, prefix)
            memo = self._renamed[key] = (renamed, pattern,
                                         None if renamed is None or pattern is None else expert_index(key, pattern))
        renamed, pattern, expert = memo
        if renamed is None or pattern is None:
            return renamed, False
        if renamed not in self.fused:
            raise ValueError(f"{path}: tensor {key!r} merges into {renamed!r}, an experts module left in "
                             "bf16 (Fp8Config.ignore); fp8now cannot merge per-expert tensors into an "
                             "unquantized experts module yet: do not ignore these experts")
        if ST_DTYPES.get(st_dtype) not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{path}: tensor {key!r} has dtype {st_dtype}; expected BF16, F16 or F32")
        count = self.fused[renamed][1][0]
        if expert is not None and expert >= count:   # it would merge into another expert's place
            raise ValueError(f"{path}: tensor {key!r} is expert {expert}, but {renamed} holds {count} experts "
                             f"(ids 0-{count - 1}, the config's expert count) and would take another's place; the "
                             "checkpoint (or the names given) does not match the model's config.json")
        if key not in self.pattern_of:   # reload_weights checks a dict before applying it: claimed twice
            self.parts.setdefault(renamed, {}).setdefault(pattern, []).append(key)
            self.pattern_of[key] = pattern
            if self.tp is not None:
                self.tp.claim(renamed, key, pattern)
        return renamed, True

    def check_parts(self, model_dir: Path) -> set[str]:
        """Every merged param has all its experts (one key per expert and source pattern); -> those names."""
        for fused, by_pattern in self.parts.items():
            num_experts = self.fused[fused][1][0]   # all experts, whichever this rank holds
            converter = self.converter_of[next(iter(by_pattern))]
            for pattern in converter.source_patterns:
                got = len(by_pattern.get(pattern, []))
                if got != num_experts:
                    raise ValueError(f"{model_dir}: {fused} needs {num_experts} tensors matching "
                                     f"{pattern!r}, the checkpoint has {got}; it is incomplete or does not "
                                     "match config.json (re-download it)")
        return set(self.parts)

    def add(self, fused: str, key: str, t: torch.Tensor, path: Path | str, device: torch.device,
            dtype: torch.dtype, pending: list | None, quantizer=None) -> bool:
        """Keep `t`; when the layer of `fused` is complete, quantize it, add its row (its error sums into
        `pending`, when given) and return True. `path`: where `t` comes from (its file, or the call).
        `quantizer(w)`: the compiled CPU weight quantizer for weight `w` (or None), for whole layers only."""
        name, _ = self.fused[fused]
        leaf = fused.rsplit(".", 1)[1]
        held = self.pending.setdefault(name, {})
        if leaf in held and isinstance(held[leaf], dict) != (key in self.pattern_of):
            raise ValueError(f"{path}: {key!r}: {fused} was given both whole and as per-expert tensors; "
                             "pass one of the two")
        if key in self.pattern_of:
            parts = held.setdefault(leaf, {})
            parts[key] = t
            if len(parts) < self.fused[fused][1][0] * len(self._patterns(parts)):   # this leaf waits for more
                return False
        else:
            held[leaf] = t
        layer, layout = self.layers[name]
        leaves = hf_shapes(layer, layout)
        if any(lf not in held or (isinstance(held[lf], dict) and len(held[lf]) < self.fused[f"{name}.{lf}"][1][0]
                * len(self._patterns(held[lf]))) for lf in leaves):   # all experts' keys pass, other ranks' as None
            return False
        return self._complete(name, held, path, device, dtype, pending, quantizer)

    @torch.no_grad()
    def _complete(self, name: str, held: dict, path: Path | str, device: torch.device, dtype: torch.dtype,
                  pending: list | None, quantizer) -> bool:
        """Layer `name` has all its tensors in `held`: merge, check, quantize, add its row; -> True."""
        layer, layout = self.layers[name]
        leaves = hf_shapes(layer, layout)
        tensors = {lf: self._merge(f"{name}.{lf}", held.pop(lf), path) for lf in leaves}
        del self.pending[name]
        for lf, shape in leaves.items():
            check_float_weight(tensors[lf], f"{name}.{lf}", shape)
        w13, w2, b13, b2 = hf_to_fused(layout, *(tensors.get(lf) for lf in (*FUSED_LEAVES, *BIAS_LEAVES)))
        w13, w2 = w13.to(device), w2.to(device)
        compiled = None if self.tp is not None or quantizer is None else quantizer(w13)
        load = (partial(layer.load_, checked=self.checked, quantizer=compiled) if self.tp is None
                else partial(self.tp.load, layer))
        try:
            stats = load(w13, w2, *(None if b is None else b.to(device=device, dtype=dtype) for b in (b13, b2)))
        except NonFiniteExperts as e:
            raise ValueError(f"{path}: {self._nonfinite_text(name, e.where)} contains NaN or Inf; fix or "
                             "re-export the weights (nothing of this experts module was written)") from None
        except ValueError as e:
            raise ValueError(f"{path}: experts {name}: {e}") from None
        self.rows.append(experts_row(layer, w13, w2, pending, stats if compiled is not None else None))
        return True

    def _patterns(self, parts: dict) -> list[str]:
        """The source patterns of the converter that merges `parts` (per-expert keys)."""
        return self.converter_of[self.pattern_of[next(iter(parts))]].source_patterns

    def missing(self, name: str) -> list[str]:
        """What layer `name` still waits for: whole transformers params, or experts of a per-expert pattern."""
        layer, layout = self.layers[name]
        held = self.pending.get(name, {})
        out = []
        for lf in hf_shapes(layer, layout):
            fused, got = f"{name}.{lf}", held.get(lf)
            if got is None:
                out.append(fused)
            elif isinstance(got, dict):
                for pattern in self._patterns(got):
                    have = {expert_index(k, pattern) for k in got if self.pattern_of[k] == pattern}
                    lacking = [str(e) for e in range(layer.num_experts) if e not in have]
                    if lacking:
                        out.append(f"{fused}: experts {', '.join(lacking)} of {pattern!r}")
        return out

    def _nonfinite_text(self, name: str, where: list[tuple[str, int, int]]) -> str:
        """The checkpoint tensors (or fused params and experts) that NonFiniteExperts found bad."""
        texts = []
        for leaf, e, part in where:
            fused = f"{name}.{HF_LEAF[leaf]}"
            by_pattern, keys = self.parts.get(fused), []
            if by_pattern:   # stored one tensor per expert: name that expert's tensor
                patterns = self.converter_of[next(iter(by_pattern))].source_patterns
                pattern = patterns[min(part, len(patterns) - 1)]   # gate_up from two patterns: gate, then up
                keys = [k for k in by_pattern.get(pattern, []) if expert_index(k, pattern) == e]
            texts.append(repr(keys[-1]) if keys else f"{fused!r} (expert {e})")
        more = f" (and {len(texts) - 1} more: {', '.join(texts[1:4])})" if len(texts) > 1 else ""
        return f"tensor {texts[0]}{more}"

    def check_merges(self, given: dict[str, torch.Tensor], where: str) -> None:
        """Merge every complete set of per-expert tensors in `given` on the meta device (no data) and check
        the fused shape, so that a wrong expert shape fails before anything is written."""
        merged_like: dict[tuple, tuple] = {}   # what the parts looked like -> the merged shape (layers are alike)
        for fused, by_pattern in self.parts.items():
            keys = [k for ks in by_pattern.values() for k in ks if k in given]
            shape = self.fused[fused][1]   # [E, ...]: all experts, whichever this rank holds
            if keys and len(keys) == shape[0] * len(self.converter_of[self.pattern_of[keys[0]]].source_patterns):
                pattern_of = self.pattern_of
                looks = (fused.rsplit(".", 1)[1], tuple(sorted(Counter(
                    (pattern_of[k], (t := given[k]).shape, t.dtype) for k in keys).items(), key=str)))
                if looks not in merged_like:
                    merged = self._merge(fused, {k: given[k].to("meta") for k in keys}, where)
                    merged_like[looks] = (tuple(merged.shape), merged.dtype)
                check_float_weight(torch.empty(merged_like[looks][0], dtype=merged_like[looks][1], device="meta"),
                                   fused, shape)

    def _ordered(self, held: dict, pattern: str) -> list[str]:
        """The keys of `held` matching `pattern`, by expert id (from the rename memo; else natural order)."""
        keys = [k for k in held if self.pattern_of[k] == pattern]
        ids = [self._renamed[k][2] if k in self._renamed else None for k in keys]
        if None in ids:
            return sorted(keys, key=_natural)
        return [keys[i] for i in sorted(range(len(keys)), key=ids.__getitem__)]

    def _merge(self, fused: str, held, path: Path | str) -> torch.Tensor:
        """A fused tensor: as stored, or merged from its parts by transformers' own converter (its plain stack and
        stack + concatenate in one copy: `one_copy_merge`)."""
        if not isinstance(held, dict):
            return held
        held = {k: t for k, t in held.items() if t is not None}  # None: another rank's expert, not read
        rule = self.converter_of[self.pattern_of[next(iter(held))]]
        ordered = [self._ordered(held, pattern) for pattern in rule.source_patterns]
        merged = one_copy_merge(rule, [[held[k] for k in keys] for keys in ordered])
        if merged is not None:
            return merged
        converter = deepcopy(rule)
        for pattern, keys in zip(rule.source_patterns, ordered):
            for key in keys:
                converter.add_tensor(fused, key, pattern, held[key])
        try:
            out = converter.convert(fused, model=self.model, config=getattr(self.model, "config", None))
        except (RuntimeError, ValueError) as e:
            shapes = sorted({tuple(t.shape) for t in held.values()})
            raise ValueError(f"{path}: the per-expert tensors of {fused} cannot be merged (shapes {shapes}: "
                             f"{e}); the checkpoint does not match config.json") from None
        if len(out) != 1:
            raise ValueError(f"{path}: merging the experts of {fused} gave {sorted(out)}, not one tensor")
        return next(iter(out.values()))

    def unfinished(self) -> list[str]:
        """Layers still waiting for tensors (none after a complete checkpoint)."""
        return [n for n, (layer, _) in self.layers.items() if not layer.is_loaded]
