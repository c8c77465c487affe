"""Load FP8 checkpoints (compressed-tensors or transformers' "fp8", by fp8now or any other tool) as they
are: the FP8 bytes and scales of the files go into `Fp8Linear`s unchanged, nothing is quantized again.

Each layer's scheme comes from its scale's shape (`[]`/`[1]` tensor, `[N, 1]`/`[N]` channel,
`[ceil(N/128), ceil(K/128)]` block), its activations from the config. A static `input_scale` (calibrated,
per tensor) is read and not used: fp8now's kernels scale activations per call, per token for tensor and
channel weights, which never clips a token the calibration did not see; the report lists each one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ..config import Fp8Config
from ..hf.modules import set_submodule
from ..hf.names import find_key
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..report import LayerRow, plan_names
from .formats import SCALE_LEAF, Prequantized, act_of, read_quantization_config, scheme_of
from .plan import Plan
from .prequantized_experts import PrequantizedExperts
from .route import Dest
from .slots import model_slots
from .source import Header

_FP8_ST = "F8_E4M3"
_SCALE_LEAVES = tuple(SCALE_LEAF.values())
_STATIC_WHY = ("static input scale: not used; fp8now scales activations per call (per token / per group), "
               "finer than one calibrated scale")


def prequantized_config(model_dir: Path) -> dict | None:
    """config.json's `quantization_config` (top level or the text config), or None for a float checkpoint."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None   # read_config reports these with its own clear error
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    qc = raw.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{path}: quantization_config is {qc!r} ({type(qc).__name__}); it must be an object "
                         "(an FP8 checkpoint's quant_method and its fields) or absent; config.json is corrupt")
    return qc or None


def _plan_layers(model: nn.Module, headers: dict[str, tuple[Path, tuple, str]], info: Prequantized,
                 config: Fp8Config, prefix: str, left: list[tuple[str, str]]
                 ) -> dict[str, tuple[Fp8Linear, dict[str, str]]]:
    """Swap every linear whose weight is FP8 in the files for an Fp8Linear of the file's scheme;
    -> layer name -> (layer, {part: checkpoint key})."""
    plans: dict[str, tuple[Fp8Linear, dict[str, str]]] = {}
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear):
            continue
        found = {leaf: find_key(f"{name}.{leaf}", headers, prefix)
                 for leaf in ("weight", "bias", "input_scale", *_SCALE_LEAVES)}
        wkey = found["weight"]
        if wkey is None or headers[wkey][2] != _FP8_ST:
            left.append((name, f"left in high precision by the {info.fmt} checkpoint"))
            if wkey is not None and headers[wkey][2].startswith("F8"):
                raise ValueError(f"{headers[wkey][0]}: {wkey!r} is {headers[wkey][2]}; fp8now runs F8_E4M3 only")
            continue
        path, wshape, _ = headers[wkey]
        skey = found[info.scale_leaf] or next((found[x] for x in _SCALE_LEAVES if found[x]), None)
        if skey is None:
            raise ValueError(f"{path}: FP8 weight {wkey!r} has no {info.scale_leaf!r} next to it; the "
                             "checkpoint is incomplete (re-download it)")
        n, k = linear.out_features, linear.in_features
        if tuple(wshape) != (n, k):
            raise ValueError(f"{path}: {wkey!r} has shape {tuple(wshape)}, the model expects {(n, k)}")
        act = act_of(name, info)
        scheme = scheme_of(tuple(headers[skey][1]), n, k, act == "group")
        if scheme is None:
            raise ValueError(f"{headers[skey][0]}: scale {skey!r} of shape {tuple(headers[skey][1])} fits no "
                             f"scheme for a [{n}, {k}] weight ([1], [{n}, 1] or [{math.ceil(n / 128)}, "
                             f"{math.ceil(k / 128)}])")
        try:
            layer_config = Fp8Config(scheme=scheme, activation=act if config.activation == "auto"
                                     else config.activation, ignore=config.ignore, backend=config.backend,
                                     batch_invariant=config.batch_invariant, decode_graphs=config.decode_graphs,
                                     fast_accum=config.fast_accum)
        except ValueError as e:
            raise ValueError(f"{path}: layer {name} ({scheme.value} weights, per-{act} activations): {e}") from None
        layer = Fp8Linear(k, n, linear.bias is not None, layer_config, device="meta",
                          dtype=linear.weight.dtype, name=name)
        set_submodule(model, name, layer)
        parts = {"weight": wkey, "scale": skey}
        if linear.bias is not None:
            if found["bias"] is None:
                raise ValueError(f"{path}: layer {name} has a bias in config.json but {name}.bias is missing")
            parts["bias"] = found["bias"]
        if found["input_scale"] is not None:
            parts["input_scale"] = found["input_scale"]
        plans[name] = (layer, parts)
    return plans


def _install(layer: Fp8Linear, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
             where: str) -> None:
    """Put the file's FP8 weight and (float32) scale into `layer` as they are; choose its backend."""
    q, s = tensors["weight"], tensors["scale"]
    if not s.is_floating_point() or s.element_size() < 2:
        raise ValueError(f"{where}: scale of {layer.name} has dtype {s.dtype}; expected float32/bf16/fp16")
    shape = tuple(layer.weight_scale.shape)
    layer.weight = nn.Parameter(q.to(device), requires_grad=False)
    layer.weight_scale = nn.Parameter(s.to(torch.float32).reshape(shape).to(device), requires_grad=False)
    if "bias" in tensors:
        layer.bias = nn.Parameter(tensors["bias"].to(device=device, dtype=dtype), requires_grad=False)
    layer.pick_backend()


class Adopted:
    """The FP8 layers and experts of a pre-quantized checkpoint, filled with the files' bytes as they arrive."""

    def __init__(self, linears: dict[str, tuple[Fp8Linear, dict[str, str]]], experts: PrequantizedExperts) -> None:
        self.linears, self.experts = linears, experts
        self.got: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, d: Dest, key: str, t: torch.Tensor, where: str, device: torch.device, dtype: torch.dtype
            ) -> tuple[LayerRow | None, str | None]:
        """Take one tensor: -> (the row of a layer it completed, or None; why it is not used, or None)."""
        if d.kind == "adopt_experts":
            unused = self.experts.add(d.name, t, Path(where), device)   # the key of a static input scale
            return None, None if unused is None else _STATIC_WHY
        if d.part == "input_scale":
            return None, _STATIC_WHY
        layer, parts = self.linears[d.name]
        got = self.got.setdefault(d.name, {})
        got[d.part] = t
        if not all(p in got for p in parts if p != "input_scale"):
            return None, None
        _install(layer, self.got.pop(d.name), device, dtype, where)
        return LayerRow(d.name, layer.scheme.value, layer.backend or "?", layer.out_features, layer.in_features,
                        layer.bias is not None, None, None, plan=plan_names(layer)), None

    def unfinished(self) -> list[str]:
        return [*self.got, *self.experts.unfinished()]


def plan_prequantized(model: nn.Module, headers: list[Header], model_dir: Path, raw: dict, config: Fp8Config | None,
                      rename) -> tuple[Plan, Prequantized]:
    """The plan of loading an FP8 checkpoint as it is: every linear and experts module whose files hold F8_E4M3
    weights becomes an FP8 layer of the scheme its scales' shapes say -> (plan, the checkpoint's format).
    `headers` carry the model's names of the keys (`rename`: checkpoint name -> model name)."""
    config = config or Fp8Config()
    info = read_quantization_config(raw, str(model_dir / "config.json"))
    if config.head or config.embedding:
        raise ValueError(f"{model_dir} holds an FP8 checkpoint ({info.fmt}): its files decide which layers are "
                         "FP8 (an lm_head stored in FP8 loads as FP8), so head=True / embedding=True, which "
                         "quantize a bf16 checkpoint's head and embedding, do not apply; load it without them")
    by_key = {h.name: (Path(h.where), h.shape, h.dtype) for h in headers}
    prefix = getattr(model, "base_model_prefix", "") or ""
    ignored: list[tuple[str, str]] = []
    experts = PrequantizedExperts(model, by_key, info, config, prefix, rename, ignored)
    linears = _plan_layers(model, by_key, info, config, prefix, ignored)
    if not linears and not experts.layers:
        raise ValueError(f"{model_dir}: config.json declares {info.fmt} FP8 but no linear or experts weight is "
                         "F8_E4M3 in the files; the checkpoint does not match its config.json")
    slots, alias_of, computed = model_slots(model)
    for name in [n for n, s in slots.items() if isinstance(s.owner, (Fp8Linear, Fp8Experts))]:
        del slots[name]   # routed by the plan itself, below
    explicit = {key: Dest("adopt", name, part=part) for name, (_, parts) in linears.items()
                for part, key in parts.items()}
    explicit.update({key: Dest("adopt_experts", key) for key in experts.key_of})
    first = (next(iter(linears.values()))[0] if linears else next(iter(experts.layers.values()))[0])
    plan = Plan(model, slots, alias_of, computed, ignored, adopted=Adopted(linears, experts), explicit=explicit,
                scheme=first.scheme.value)
    plan.keep_fp32()
    return plan, info

