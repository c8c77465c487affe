"""The MoE experts of a pre-quantized FP8 checkpoint, loaded as they are: each expert's FP8 projections
and scales (one tensor per expert and projection, moe_files) go into an `Fp8Experts` unchanged.

The scheme comes from the scales' shapes, as for linears. Per-tensor files carry one scale for gate and one
for up; where they differ (other tools calibrate them apart) the layer keeps them as per-row scales, which
gives the same products as two per-tensor scales without touching a byte.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ..hf.names import find_key
from ..config import Fp8Config, Scheme
from .formats import SCALE_LEAF, Prequantized, act_of, scheme_of
from ..hf.modules import set_submodule
from ..hf.experts import empty_fp8_experts, is_experts
from ..layers.moe import Fp8Experts
from .expert_files import PARTS, expert_modules, stacked
from .rows import experts_row
from ..report import ExpertsRow

Headers = dict[str, tuple[Path, tuple[int, ...], str]]   # model-side key -> (file, shape, safetensors dtype)
_FP8_ST = "F8_E4M3"


class PrequantizedExperts:
    """Every experts module whose files hold FP8 experts: swapped for a meta `Fp8Experts`, filled by `add`."""

    def __init__(self, model: nn.Module, headers: Headers, info: Prequantized, config: Fp8Config, prefix: str,
                 rename, ignored: list[tuple[str, str]]) -> None:
        self.model, self.info, self.config = model, info, config
        self.layers: dict[str, tuple[Fp8Experts, nn.Module]] = {}
        self.key_of: dict[str, tuple[str, int, str, str]] = {}   # key -> (layer, expert, part, weight|scale|input)
        self.pending: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
        self.rows: list[ExpertsRow] = []
        for name, module in list(model.named_modules()):
            if not is_experts(module):
                continue
            if find_key(f"{name}.gate_up_proj", headers, prefix) is not None:
                ignored.append((name, f"left in high precision by the {info.fmt} checkpoint"))
                continue
            self._plan(name, module, headers, prefix, rename)

    def _plan(self, name: str, module: nn.Module, headers: Headers, prefix: str, rename) -> None:
        num = module.gate_up_proj.shape[0]
        layer = empty_fp8_experts(name, module, Fp8Config(), "meta")   # the shapes; scheme set below
        h, i = layer.hidden_size, layer.intermediate_size
        schemes: set[Scheme] = set()
        modules = expert_modules(self.model, name, num)
        folder = next(iter(headers.values()))[0].parent
        act = act_of(modules[0, "gate"], self.info)
        for (e, part), mod in modules.items():
            wkey = find_key(rename(f"{mod}.weight"), headers, prefix)
            if wkey is None:
                raise ValueError(f"{folder}: {mod}.weight is missing (expert {e} of {name}); the checkpoint is "
                                 "incomplete or does not match config.json (re-download it)")
            path, wshape, st = headers[wkey]
            if st != _FP8_ST:
                raise ValueError(f"{path}: {wkey!r} is {st}; fp8now reads the experts of an FP8 checkpoint as "
                                 "F8_E4M3 only (experts kept in high precision one by one are not supported yet)")
            rows, cols = (h, i) if part == "down" else (i, h)
            if tuple(wshape) != (rows, cols):
                raise ValueError(f"{path}: {wkey!r} has shape {tuple(wshape)}, the model expects {(rows, cols)}")
            skey = next((k for leaf in (self.info.scale_leaf, *SCALE_LEAF.values())
                         if (k := find_key(rename(f"{mod}.{leaf}"), headers, prefix)) is not None), None)
            if skey is None:
                raise ValueError(f"{path}: FP8 weight {wkey!r} has no {self.info.scale_leaf!r} next to it; the "
                                 "checkpoint is incomplete (re-download it)")
            sshape = tuple(headers[skey][1])
            scheme = scheme_of(sshape, rows, cols, act == "group")
            if scheme is None:
                raise ValueError(f"{headers[skey][0]}: scale {skey!r} of shape {sshape} fits no scheme for a "
                                 f"[{rows}, {cols}] weight ([1], [{rows}, 1] or [{math.ceil(rows / 128)}, "
                                 f"{math.ceil(cols / 128)}])")
            schemes.add(scheme)
            self.key_of[wkey], self.key_of[skey] = (name, e, part, "weight"), (name, e, part, "scale")
            ikey = find_key(rename(f"{mod}.input_scale"), headers, prefix)
            if ikey is not None:
                self.key_of[ikey] = (name, e, part, "input")
        if len(schemes) != 1:
            raise ValueError(f"{folder}: the experts of {name} mix weight schemes "
                             f"({', '.join(sorted(s.value for s in schemes))}); fp8now keeps one per layer")
        self._swap(name, module, schemes.pop(), act)

    def _swap(self, name: str, module: nn.Module, scheme: Scheme, act: str) -> None:
        """Put a meta Fp8Experts of `scheme` at `name` (again, when per-tensor scales become per-row)."""
        c = self.config
        try:
            config = Fp8Config(scheme=scheme, activation=act if c.activation == "auto" else c.activation,
                               ignore=c.ignore, backend=c.backend, batch_invariant=c.batch_invariant,
                               decode_graphs=c.decode_graphs)
            layer = empty_fp8_experts(name, module, config, "meta")
        except ValueError as e:
            hint = "; pass Fp8Config(activation='token') to fp8now.load" if act == "tensor" else ""
            raise ValueError(f"experts {name} ({scheme.value} weights, per-{act} activations in the checkpoint): "
                             f"{e}{hint}") from None
        set_submodule(self.model, name, layer)
        self.layers[name] = (layer, module)

    def add(self, key: str, t: torch.Tensor, path: Path, device: torch.device) -> str | None:
        """Keep one expert tensor; install the layer when it is complete. -> `key` when it is an unused
        static input scale, else None."""
        name, e, part, kind = self.key_of[key]
        if kind == "input":
            return key
        if kind == "scale" and (not t.is_floating_point() or t.element_size() < 2):
            raise ValueError(f"{path}: scale {key!r} has dtype {t.dtype}; expected float32/bf16/fp16")
        got = self.pending.setdefault(name, {})
        got[e, part, kind] = t
        layer, module = self.layers[name]
        if len(got) == 2 * len(PARTS) * layer.num_experts:
            self._install(name, self.pending.pop(name), device)
        return None

    def _install(self, name: str, got: dict, device: torch.device) -> None:
        layer, module = self.layers[name]
        parts = {(e, p): (got[e, p, "weight"], got[e, p, "scale"].float())
                 for e in range(layer.num_experts) for p in PARTS}
        if layer.scheme is Scheme.TENSOR and any(not torch.equal(parts[e, "gate"][1], parts[e, "up"][1])
                                                 for e in range(layer.num_experts)):
            self._swap(name, module, Scheme.CHANNEL, "token")
            layer = self.layers[name][0]
            parts = {k: (w, s.reshape(()).expand(w.shape[0], 1)) for k, (w, s) in parts.items()}
        layer.install_(*(t.to(device) for t in stacked(layer, parts)))
        self.rows.append(experts_row(layer, layer.w13, layer.w2, None))

    def unfinished(self) -> list[str]:
        return [n for n, (layer, _) in self.layers.items() if not layer.is_loaded]
