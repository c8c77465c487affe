"""Quantize-on-load (SPEC §5): meta skeleton, header check of every tensor, then stream and quantize.

At most one layer's float weight is on the device at a time: a quantized layer's tensors wait on the
host until the layer is complete, then move, are quantized, and are dropped at once. Every other
tensor (embeddings, norms, lm_head) goes straight to the device in `dtype`, but an FP8 head (a layer
like the others) and an FP8 embedding (quantized as soon as it is read) under Fp8Config(head=, embedding=).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch
from torch import nn

from .config import Fp8Config
from .checkpoint import ST_DTYPES, checkpoint_files, corrupt_error, index_map, scan_headers
from .finite import FiniteCheck
from .hf import Slot, build_skeleton, keep_fp32_names, model_slots, resolve_name, swap_linears, target_linears
from .hf_head import load_embedding, prepare as prepare_head, tie_embeddings
from .hf_moe import add_experts, freeze_fp8
from .legacy import legacy_reason
from .linear import Fp8Linear, check_float_weight
from .moe_load import ExpertsLoad
from .quantize import build_report, layer_row, quantize_  # noqa: F401  (quantize_: also public here)
from .report import LayerRow, LoadReport
from .cpu_quantizer import install as install_cpu_quantizer
from .devices import default_device, resolve_device  # noqa: F401  (public here too)
from .shared_input import share_inputs
from .tensor_file import read_tensors
from .tp import TpState, shard

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Source weight bytes quantized between heap trims: the freed temporaries of a load are given back as it
# goes, so they do not pile up into the process peak.
TRIM_EVERY_BYTES = 32 << 20


def _source_map(model_dir: Path, files: list[Path], slots: dict[str, Slot], alias_of: dict[str, str],
                 computed: set[str], prefix: str, experts: ExpertsLoad | None = None
                 ) -> tuple[dict[Path, list[tuple[str, str]]], list[tuple[str, str]]]:
    """Check every header against the model; -> per file [(key, model name)], skipped (key, why)."""
    known = set(slots) | set(alias_of) | computed
    source: dict[str, tuple[Path, str]] = {}
    via_alias: dict[str, list[tuple[Path, str]]] = {}
    unexpected: list[str] = []
    skipped: list[tuple[str, str]] = []
    in_file: dict[str, set[str]] = {}
    parts: dict[Path, list[tuple[str, str]]] = {p: [] for p in files}  # per-expert tensors of fused params
    for path in files:
        headers = scan_headers(path)
        in_file[path.name] = {key for key, _, _ in headers}
        for key, shape, st_dtype in headers:
            name = resolve_name(key, known, prefix)
            if name is None and (why := legacy_reason(key)):
                skipped.append((key, why))
                continue
            if name is None and experts is not None:  # transformers' renaming / expert-merging rules
                name, is_part = experts.claim(key, path, st_dtype, known, prefix)
                if is_part:
                    parts[path].append((key, name))
                    continue
            if name is None:
                unexpected.append(f"{key!r} in {path.name}")
                continue
            if name in computed:
                skipped.append((key, "non-persistent buffer: the model computes it"))
                continue
            canon = alias_of.get(name, name)
            _check_header(slots[canon], key, path, shape, st_dtype)
            if name in alias_of:
                via_alias.setdefault(canon, []).append((path, key))
            elif canon in source:
                first = source[canon]
                raise ValueError(f"tensor {key!r} appears twice: in {first[0]} and in {path}; each tensor "
                                 "must be stored once (the checkpoint is inconsistent; re-download it)")
            else:
                source[canon] = (path, key)
    for canon, sources in via_alias.items():
        if canon not in source:
            source[canon] = sources.pop(0)
        skipped += [(key, f"tied to {canon}, loaded once") for _, key in sources]
    if unexpected:
        raise ValueError(f"{model_dir}: {len(unexpected)} tensor(s) the model does not define, e.g. "
                         f"{', '.join(unexpected[:5])}; the checkpoint does not match its config.json")
    for key, fname in (index_map(model_dir) or {}).items():
        if key not in in_file.get(fname, ()):
            raise ValueError(f"{model_dir / 'model.safetensors.index.json'} lists {key!r} in {fname}, "
                             "which does not contain it; re-download the checkpoint")
    merged = experts.check_parts(model_dir) if experts is not None else set()
    missing = [n for n, s in slots.items() if n not in source and n not in merged and s.kind != "buffer"]
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                         f"{', '.join(missing[:5])}; the checkpoint is incomplete or does not match "
                         "config.json (re-download it)")
    by_file: dict[Path, list[tuple[str, str]]] = parts
    for canon, (path, key) in source.items():
        by_file[path].append((key, canon))
    return by_file, skipped


def _check_header(slot: Slot, key: str, path: Path, shape: tuple[int, ...], st_dtype: str) -> None:
    """Float dtype (for float targets) and exact shape, before any data is read."""
    if slot.is_float:
        dt = ST_DTYPES.get(st_dtype)
        if dt is None:
            raise ValueError(f"{path}: tensor {key!r} has dtype {st_dtype}; expected BF16, F16, F32 or F64 "
                             "(fp8now quantizes float checkpoints; pre-quantized ones are another path)")
        try:
            check_float_weight(torch.empty(shape, dtype=dt, device="meta"), key, shape)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if tuple(shape) != slot.shape:
        raise ValueError(f"{path}: tensor {key!r} has shape {tuple(shape)}, the model expects {slot.shape} "
                         "(the checkpoint does not match its config.json)")


def _quantize_layer(layer: Fp8Linear, parts: dict[str, tuple[torch.Tensor, Path, str]],
                    device: torch.device, dtype: torch.dtype, measure: bool, finite: FiniteCheck,
                    tp: TpState | None) -> LayerRow:
    """Move a complete layer to the device, quantize it from its own float dtype, drop the float copy."""
    host_w, path, key = parts.pop("weight")
    w = host_w.to(device)
    del host_w
    bias = parts.pop("bias", None)
    b = None
    if bias is not None:
        b = bias[0].to(device=device, dtype=dtype)
        finite.add(b, f"{bias[1]}: tensor {bias[2]!r}")
    try:
        layer.load_(w, b) if tp is None else tp.load_layer(layer, w, b)  # tp: SPEC §6 scales
    except ValueError as e:
        raise ValueError(f"{path}: tensor {key!r}: {e}") from None
    return layer_row(layer, w if measure else None)


def _materialize(slot: Slot, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Put a non-quantized tensor on the device (floats in `dtype`, or float32 where the model keeps
    them so), replacing the meta one. Returns the stored tensor."""
    if slot.kind == "buffer":
        old = slot.owner._buffers[slot.leaf]
        slot.owner._buffers[slot.leaf] = out = t.to(dtype=old.dtype).to(device)
        return out
    want = torch.float32 if slot.keep_fp32 else dtype
    out = t.to(want) if t.is_floating_point() and t.dtype != want else t  # cast on the host
    param = nn.Parameter(out.to(device), requires_grad=out.is_floating_point())   # as from_pretrained
    for owner, leaf in [(slot.owner, slot.leaf), *slot.aliases]:
        owner._parameters[leaf] = param
    return param


def _read(path: Path, keys: list[str]):
    """Yield (key, tensor) for `keys` of one file, each in fresh memory (no mapping of the file)."""
    try:
        yield from read_tensors(path, keys)
    except (OSError, ValueError, KeyError) as e:
        raise corrupt_error(path, e) from None


def _stream(by_file: dict[Path, list[tuple[str, str]]], slots: dict[str, Slot], device: torch.device,
            dtype: torch.dtype, measure: bool, experts: ExpertsLoad | None = None,
            tp: TpState | None = None) -> list[LayerRow]:
    rows: list[LayerRow] = []
    pending: dict[str, dict[str, tuple[torch.Tensor, Path, str]]] = {}
    finite = FiniteCheck()  # non-quantized tensors; the quantizer checks the weights it quantizes
    since_trim = 0          # source weight bytes quantized (and freed) since the heap was last trimmed
    for path, entries in by_file.items():
        names = dict(entries)
        reader = _read(path, list(names)) if tp is None else tp.read_file(path, names)  # tp: its slices
        for key, t in reader:
            slot = slots[names[key]]
            if slot.kind == "experts":
                experts.add(names[key], key, t, path, device, dtype, measure)
                continue
            if slot.kind == "embedding":   # Fp8Config(embedding=True): quantized as it is read
                rows.append(load_embedding(slot.owner, t, device, measure, f"{path}: tensor {key!r}"))
                continue
            if slot.kind != "fp8":
                finite.add(_materialize(slot, t, device, dtype), f"{path}: tensor {key!r}")
                del t
                continue
            layer = slot.owner
            assert isinstance(layer, Fp8Linear)
            parts = pending.setdefault(layer.name, {})
            parts[slot.leaf] = (t, path, key)
            del t
            if "weight" in parts and (layer.bias is None or "bias" in parts):
                w = parts["weight"][0]
                since_trim += w.numel() * w.element_size()
                del w
                rows.append(_quantize_layer(layer, pending.pop(layer.name), device, dtype, measure, finite, tp))
                if since_trim >= TRIM_EVERY_BYTES:
                    _trim_heap()
                    since_trim = 0
    pending_names = [*pending, *(experts.unfinished() if experts is not None else [])]
    if pending_names:  # cannot happen after _source_map; kept as a guard against silent partial loads
        raise RuntimeError(f"layers left incomplete after reading every file: {', '.join(pending_names)}")
    finite.raise_if_bad()
    return rows


def _finish(model: nn.Module, device: torch.device, source: str) -> None:
    """Buffers to the device; nothing may remain on meta; FP8 layers frozen; eval mode."""
    for module in model.modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[leaf] = buf.to(device)
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t.is_meta:
                raise RuntimeError(f"{kind} {name} is still on the meta device after loading {source}; "
                                   "this is a bug in fp8now: please report it with the model's config.json")
    freeze_fp8(model)
    model.eval()


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them after a load's many temporaries)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load(model_dir: str | Path, config: Fp8Config | None = None,
         device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16, *,
         measure_error: bool = True, tp_plan: str | dict[str, str] | None = None,
         tp_group=None, moe_parallel: str | None = None) -> tuple[nn.Module, LoadReport]:
    """Load a bf16/fp16/fp32 Hugging Face checkpoint folder with its block linears quantized to FP8.

    Builds the transformers model on the meta device, swaps the target linears for `Fp8Linear`,
    checks every tensor header (names, shapes, dtypes) against the model, then streams the tensors:
    each layer is quantized as soon as its weight (and bias) arrived, on `device` (None or "auto":
    cuda if available, else cpu). Non-quantized tensors are stored in `dtype`. `measure_error` computes each
    layer's SQNR / rel_diff for the report (one chunked dequantize per layer).
    Returns `(model, report)`; the model is in eval mode with no tensor left on meta.

    `tp_plan="auto"` (the model's own transformers plan) or a dict {module pattern: style}, inside
    torchrun with torch.distributed initialised: each rank of `tp_group` (default: all) reads only
    its slice of every planned tensor and quantizes it to the bytes of that slice at TP=1 (SPEC §6).
    MoE experts go by `moe_parallel`: "ep" (default: whole experts per rank) or "tp" (every expert
    split across the ranks), or by the experts styles of a plan dict.
    """
    start = time.perf_counter()
    config = config or Fp8Config()
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16, float16 or float32, got {dtype}")
    device = resolve_device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        torch.cuda.reset_peak_memory_stats(device)
        at_start = torch.cuda.memory_allocated(device)
    model_dir = Path(model_dir)
    from .prequantized import load_prequantized, prequantized_config  # FP8 checkpoints: loaded as they are
    if (quantization := prequantized_config(model_dir)) is not None:
        if tp_plan is not None or moe_parallel is not None:
            raise ValueError(f"{model_dir} holds an FP8 checkpoint (quantization_config): tp_plan is not "
                             "supported for pre-quantized loading yet; load the bf16 checkpoint with tp_plan, "
                             "or this one without it")
        return load_prequantized(model_dir, quantization, config, device, dtype)
    model = build_skeleton(model_dir, dtype)
    files = checkpoint_files(model_dir)
    prepare_head(model, config, str(model_dir), dtype, tp=tp_plan is not None)   # head=, embedding=
    targets, ignored = target_linears(model, config)
    experts = ExpertsLoad(model, config)
    if not targets and not experts.layers:
        raise ValueError(f"{model_dir}: nothing to quantize: all {len(ignored)} linear layers are left "
                         f"alone (e.g. {ignored[0] if ignored else 'none found'}); loosen Fp8Config.ignore")
    swap_linears(model, targets, config, "meta", dtype)
    if moe_parallel is not None and tp_plan is None:
        raise ValueError("moe_parallel splits MoE experts across a tensor-parallel group: pass tp_plan too")
    tp = None if tp_plan is None else shard(model, tp_plan, config, tp_group, experts.layers, moe_parallel)
    slots, alias_of, computed = model_slots(model)
    if tp is not None:
        tp.full_shapes_into(slots)
        model._fp8now_tp = tp
        experts.tp = tp.moe
    experts.add_slots(slots)
    for name in keep_fp32_names(model, slots):
        slots[name].keep_fp32 = slots[name].kind == "param"
    by_file, skipped = _source_map(model_dir, files, slots, alias_of, computed,
                                   getattr(model, "base_model_prefix", "") or "", experts)
    rows = _stream(by_file, slots, device, dtype, measure_error, experts, tp)
    tie_embeddings(model)
    _finish(model, device, str(model_dir))
    share_inputs(model)
    _trim_heap()
    report = build_report(model, rows, ignored + experts.ignored, str(model_dir), device, dtype, config)
    report.cpu_quantizer = install_cpu_quantizer(model, dtype)
    add_experts(report, model, experts.rows)
    report.skipped_tensors = skipped
    report.files = [p.name for p in files]
    report.load_s = time.perf_counter() - start
    if device.type == "cuda":
        report.peak_device_bytes = torch.cuda.max_memory_allocated(device)
        report.device_bytes_at_start = at_start
    return model, report
