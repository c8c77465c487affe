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

from .checkpoint import checkpoint_files, scan_headers
from .cpu_quantizer import install as install_cpu_quantizer
from .config import Fp8Config, Scheme
from .finite import FiniteCheck
from .ckpt_names import find_key, model_key
from .formats import SCALE_LEAF, Prequantized, act_of, read_quantization_config, scheme_of
from .hf import build_skeleton, keep_fp32_names, model_slots, resolve_name, set_submodule
from .hf_moe import add_experts
from .linear import Fp8Linear
from .moe import Fp8Experts
from .prequantized_moe import PrequantizedExperts
from .report import LayerRow, plan_names
from .shared_input import share_inputs

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
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    return qc if isinstance(qc, dict) and qc else None


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


def load_prequantized(model_dir: Path, raw: dict, config: Fp8Config | None, device: torch.device,
                      dtype: torch.dtype):
    """fp8now.load for a checkpoint whose config.json has a `quantization_config` -> (model, report)."""
    from .loader import _check_header, _finish, _materialize, _read
    from .quantize import build_report

    config = config or Fp8Config()
    info = read_quantization_config(raw, str(model_dir / "config.json"))
    if config.head or config.embedding:
        raise ValueError(f"{model_dir} holds an FP8 checkpoint ({info.fmt}): its files decide which layers are "
                         "FP8 (an lm_head stored in FP8 loads as FP8), so head=True / embedding=True, which "
                         "quantize a bf16 checkpoint's head and embedding, do not apply; load it without them")
    model = build_skeleton(model_dir, dtype)
    files = checkpoint_files(model_dir)
    rename = model_key(model)
    headers, file_key = {}, {}   # model-side key -> (file, shape, dtype) / -> the key in the file
    for path in files:
        for key, shape, st in scan_headers(path):
            headers[rename(key)], file_key[rename(key)] = (path, shape, st), key
    prefix = getattr(model, "base_model_prefix", "") or ""
    ignored: list[tuple[str, str]] = []
    experts = PrequantizedExperts(model, headers, info, config, prefix, rename, ignored)
    plans = _plan_layers(model, headers, info, config, prefix, ignored)
    if not plans and not experts.layers:
        raise ValueError(f"{model_dir}: config.json declares {info.fmt} FP8 but no linear or experts weight is "
                         "F8_E4M3 in the files; the checkpoint does not match its config.json")
    slots, alias_of, computed = model_slots(model)
    for name in [n for n, s in slots.items() if isinstance(s.owner, Fp8Experts)]:
        del slots[name]   # filled from the per-expert tensors (experts.key_of)
    for name in keep_fp32_names(model, slots):
        slots[name].keep_fp32 = slots[name].kind == "param"   # as the float loader keeps them
    fp8_keys = {key: (name, part) for name, (_, parts) in plans.items() for part, key in parts.items()}
    known = set(slots) | set(alias_of) | computed
    route: dict[Path, list[tuple[str, tuple[str, str | None]]]] = {p: [] for p in files}
    skipped, unexpected, done = [], [], set()
    for key, (path, shape, st) in headers.items():
        if key in fp8_keys or key in experts.key_of:
            route[path].append((file_key[key], (key, None)))
            continue
        name = resolve_name(key, known, prefix)
        if name is None:
            unexpected.append(f"{file_key[key]!r} in {path.name}")
        elif name in computed or name in alias_of:
            skipped.append((file_key[key], "computed by the model" if name in computed
                            else f"tied to {alias_of[name]}"))
        elif slots[name].kind != "fp8":
            _check_header(slots[name], file_key[key], path, shape, st)
            route[path].append((file_key[key], (key, name)))
            done.add(name)
    if unexpected:
        raise ValueError(f"{model_dir}: {len(unexpected)} tensor(s) the model does not define, e.g. "
                         f"{', '.join(unexpected[:5])}; the checkpoint does not match its config.json")
    missing = [n for n, s in slots.items() if s.kind == "param" and n not in done]
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                         f"{', '.join(missing[:5])} (re-download it)")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    rows: list[LayerRow] = []
    finite = FiniteCheck()  # the tensors kept in high precision (FP8 bytes are what the file holds)
    for path, entries in route.items():
        if not entries:
            continue
        names = dict(entries)
        for fkey, t in _read(path, list(names)):
            key, name = names[fkey]
            if name is not None:
                finite.add(_materialize(slots[name], t, device, dtype), f"{path}: tensor {fkey!r}")
                continue
            if key in experts.key_of:
                if experts.add(key, t, path, device) is not None:
                    skipped.append((fkey, _STATIC_WHY))
                continue
            lname, part = fp8_keys[key]
            if part == "input_scale":
                skipped.append((fkey, _STATIC_WHY))
                continue
            layer, parts = plans[lname]
            got = pending.setdefault(lname, {})
            got[part] = t
            if all(p in got for p in parts if p != "input_scale"):
                _install(layer, pending.pop(lname), device, dtype, str(path))
                rows.append(LayerRow(lname, layer.scheme.value, layer.backend or "?", layer.out_features,
                                     layer.in_features, layer.bias is not None, None, None,
                                     plan=plan_names(layer)))
    finite.raise_if_bad()
    if experts.unfinished():   # cannot happen after the header checks; a guard against partial loads
        raise RuntimeError(f"experts left incomplete after reading every file: {', '.join(experts.unfinished())}")
    _finish(model, device, str(model_dir))
    share_inputs(model)
    first = next(iter(plans.values()))[0] if plans else next(iter(experts.layers.values()))[0]
    report = build_report(model, rows, ignored, f"{model_dir} ({info.fmt}, pre-quantized)", device, dtype,
                          Fp8Config(scheme=first.scheme, activation=first.act_kind))
    report.cpu_quantizer = install_cpu_quantizer(model, dtype)
    add_experts(report, model, experts.rows)
    report.skipped_tensors = skipped
    report.files = [p.name for p in files]
    return model, report
