"""The two standard FP8 checkpoint formats, as data: what each can express, its config.json entry,
and its tensor names. export.py writes them, prequantized.py reads them.

compressed-tensors (`quant_method: "compressed-tensors"`, format `float-quantized`): `X.weight` F8_E4M3 and
`X.weight_scale` `[1]` / `[N, 1]` / `[ceil(N/128), ceil(K/128)]`; activations described per config group.
transformers' "fp8" (`quant_method: "fp8"`): `X.weight` and `X.weight_scale_inv` (the dequantization
multiplier despite its name), 128x128 blocks with dynamic 1x128-group activations. No per-channel form;
per-tensor files (`weight_block_size: null`) are read, not written: transformers names their scale
`weight_scale_inv` (shape `[]`), vLLM and SGLang `weight_scale`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..config import Scheme
from .qconfig_fields import check_quantization_config

FORMATS = ("compressed-tensors", "fp8")
BLOCK = 128

# On-disk name of the weight's scale, per format.
SCALE_LEAF: dict[str, str] = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv"}

# compressed-tensors strategy names <-> (fp8now weight scheme / activation kind).
_CT_WEIGHT = {Scheme.TENSOR: "tensor", Scheme.CHANNEL: "channel", Scheme.BLOCK: "block"}
_CT_ACT = {"token": "token", "tensor": "tensor", "group": "group"}

# (scheme, activation) pairs each format can state exactly.
EXPRESSIBLE: dict[str, frozenset[tuple[Scheme, str]]] = {
    "compressed-tensors": frozenset({(Scheme.TENSOR, "token"), (Scheme.TENSOR, "tensor"),
                                     (Scheme.CHANNEL, "token"), (Scheme.BLOCK, "group")}),
    # Per-tensor "fp8" files exist in two spellings that the readers do not share (transformers reads
    # `weight_scale_inv`, vLLM and SGLang `weight_scale`), so only blocks are written in this format.
    "fp8": frozenset({(Scheme.BLOCK, "group")}),
}
_WHY_NOT = {"fp8": " (it has no per-channel form, and its per-tensor files are named differently by transformers "
                   "and by vLLM/SGLang)", "compressed-tensors": ""}


def check_format(fmt: str) -> str:
    """`fmt` itself when it is a known format name, else a clear error."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def check_expressible(fmt: str, scheme: Scheme, act: str, what: str) -> None:
    """Raise when format `fmt` has no way to state `scheme` weights with `act` activations."""
    if (scheme, act) in EXPRESSIBLE[fmt]:
        return
    can = ", ".join(sorted(f"{s.value} weights + per-{a} activations" for s, a in EXPRESSIBLE[fmt]))
    raise ValueError(f"format {fmt!r} cannot express {what}: {scheme.value} weights with per-{act} "
                     f"activations; it can express: {can}{_WHY_NOT[fmt]}. Use "
                     + ("another --scheme" if fmt == "compressed-tensors" else "--format compressed-tensors"))


def _ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic, "strategy": strategy,
            "group_size": None, **extra}


# The fields llm-compressor 0.14 writes besides those above (weight_numerics other than "spec"): each
# quantization args' defaults, the weights' observer, and two top-level entries (no "version": that names
# the compressed-tensors release which wrote the file, and none did here).
LLMC_ARGS = {"actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {},
             "scale_dtype": None, "zp_dtype": None}
LLMC_WEIGHT_OBSERVER = "memoryless_minmax"
LLMC_TOP = {"global_compression_ratio": None, "transform_config": {}}


def quantization_config(fmt: str, groups: dict[tuple[Scheme, str], list[str]], left_alone: list[str],
                        numerics: str = "spec") -> dict:
    """config.json's `quantization_config` for layers grouped by (scheme, act); `left_alone`: linears kept
    in high precision. One group targets every `Linear`; several groups target their layers by name.
    `numerics` other than "spec" (llm-compressor's): compressed-tensors with every field llm-compressor writes."""
    llmc = numerics != "spec"
    if fmt == "fp8":
        if len(groups) != 1:
            raise ValueError(f"format 'fp8' holds one scheme per checkpoint, the model has {len(groups)}")
        (scheme, _), = groups
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK] if scheme is Scheme.BLOCK else None,
                "modules_to_not_convert": sorted(left_alone)}
    config_groups = {}
    for i, ((scheme, act), names) in enumerate(sorted(groups.items(), key=lambda kv: kv[0])):
        weights = _ct_args(_CT_WEIGHT[scheme], False,
                           **({"block_structure": [BLOCK, BLOCK]} if scheme is Scheme.BLOCK else {}))
        acts = _ct_args(_CT_ACT[act], True)
        if act == "group":
            acts["group_size"] = BLOCK
        if llmc:
            weights = {**LLMC_ARGS, **weights, "observer": LLMC_WEIGHT_OBSERVER}
            acts = {**LLMC_ARGS, **acts}
        targets = ["Linear"] if len(groups) == 1 else sorted(names)
        config_groups[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": acts,
                                       "output_activations": None, "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": config_groups,
            "ignore": sorted(left_alone), "kv_cache_scheme": None, "sparsity_config": {},
            **(LLMC_TOP if llmc else {})}


@dataclass(frozen=True)
class Prequantized:
    """What config.json says about a pre-quantized checkpoint: its format, scale name, activations."""

    fmt: str
    scale_leaf: str
    act_by_target: dict[str, str]      # CT target ("Linear", a name, "re:...") -> activation kind
    static_input: bool                 # activations with a static (calibrated) input_scale
    ignore: tuple[str, ...]


def read_quantization_config(raw: dict, where: str) -> Prequantized:
    """Parse a `quantization_config` of either format; anything fp8now cannot run raises, naming `where`."""
    check_quantization_config(raw, where)   # every field below of the JSON type it is read as
    method = raw.get("quant_method")
    if method == "fp8":
        if raw.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"{where}: activation_scheme {raw.get('activation_scheme')!r} is not dynamic/static")
        block = raw.get("weight_block_size")
        if block is not None and list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"{where}: weight_block_size {block} is not supported; fp8now's block kernels use "
                             f"[{BLOCK}, {BLOCK}] tiles")
        act = "group" if block else "token"
        return Prequantized("fp8", SCALE_LEAF["fp8"], {"Linear": act},
                            raw.get("activation_scheme") == "static",
                            tuple(raw.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        if raw.get("format") not in ("float-quantized", None) or raw.get("quantization_status") == "frozen":
            raise ValueError(f"{where}: compressed-tensors format {raw.get('format')!r} is not FP8 "
                             "'float-quantized'; fp8now reads FP8 checkpoints only")
        acts: dict[str, str] = {}
        static = False
        for name, group in (raw.get("config_groups") or {}).items():
            w, a = group.get("weights") or {}, group.get("input_activations")
            if w.get("type") != "float" or w.get("num_bits") != 8 or group.get("format", "float-quantized") \
                    != "float-quantized":
                raise ValueError(f"{where}: config group {name!r} is not FP8 weights ({w}); fp8now reads "
                                 "8-bit float checkpoints only")
            if w.get("strategy") == "block" and list(w.get("block_structure") or []) != [BLOCK, BLOCK]:
                raise ValueError(f"{where}: group {name!r} has block_structure {w.get('block_structure')}; "
                                 f"fp8now's block kernels use [{BLOCK}, {BLOCK}]")
            act = {"block": "group"}.get(w.get("strategy"), "token")
            if a:
                static = static or not a.get("dynamic", True)
                if a.get("dynamic", True):
                    act = {"token": "token", "tensor": "tensor", "group": "group"}.get(a.get("strategy"), act)
            for target in group.get("targets") or ["Linear"]:
                acts[target] = act
        if not acts:
            raise ValueError(f"{where}: compressed-tensors config has no config_groups")
        return Prequantized("compressed-tensors", SCALE_LEAF["compressed-tensors"], acts, static,
                            tuple(raw.get("ignore") or ()))
    raise ValueError(f"{where}: quant_method {method!r} is not one fp8now reads; it loads bf16/fp16/fp32 "
                     f"checkpoints and the FP8 formats {', '.join(FORMATS)}")


def scheme_of(scale_shape: tuple[int, ...], n: int, k: int, prefer_block: bool) -> Scheme | None:
    """The weight scheme a scale of `scale_shape` means for an [n, k] weight (None: no scheme fits)."""
    block = (math.ceil(n / 128), math.ceil(k / 128))
    if prefer_block and scale_shape == block:
        return Scheme.BLOCK
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
        return Scheme.TENSOR
    if scale_shape in ((n, 1), (n,)):
        return Scheme.CHANNEL
    return Scheme.BLOCK if scale_shape == block else None


def act_of(name: str, info: Prequantized) -> str:
    """The activation kind the config gives layer `name` (exact name, `re:` target, then `Linear`)."""
    acts = info.act_by_target
    if name in acts:
        return acts[name]
    for target, act in acts.items():
        if target.startswith("re:") and re.fullmatch(target[3:], name):
            return act
    return acts.get("Linear", "token")
