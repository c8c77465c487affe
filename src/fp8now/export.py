"""Write an FP8 model as a standard checkpoint (compressed-tensors or transformers' "fp8"), shard by shard.

Every check runs before the first byte is written; files go to a hidden sibling folder that is renamed
into place at the end, so `out_dir` appears complete or not at all. Scales are stored as float32, the
exact values the FP8 bytes were computed with; under llm-compressor numerics in the weights' dtype (bf16), as
llm-compressor stores them, with its quantization_config fields.
"""

from __future__ import annotations

import json
import os
import shutil
import secrets
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .loading.files import INDEX_NAME, SINGLE_NAME
from .hf.names import checkpoint_module_names, to_checkpoint_names
from .config import Fp8Config
from .export_readers import reader_notes
from .loading.formats import SCALE_LEAF, check_expressible, check_format, quantization_config
from .layers.embedding import Fp8Embedding
from .layers.linear import Fp8Linear
from .hf.models import STAMP_FILE, chmod_files
from .layers.moe import Fp8Experts
from .loading.expert_files import expert_modules, expert_tensors

MAX_SHARD_BYTES = 5 * 10**9
# Files of a checkpoint folder that are weights, rewritten here or fp8now's own; everything else (tokenizer,
# generation config, chat template, licence) is copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_REWRITTEN = ("config.json", INDEX_NAME, STAMP_FILE)   # STAMP_FILE: the embedded model's cache stamp

Tensors = Iterator[tuple[str, torch.Tensor]]
EMBEDDING_REFUSED = ("{what}, and no standard checkpoint format (compressed-tensors, fp8) stores one: load the model "
                     "with Fp8Config(embedding=False) (CLI: without --fp8-embedding) to export it; an FP8 output "
                     "head (head=True) exports as an ordinary quantized linear")


def _scale_dtype(layer: Fp8Linear | Fp8Experts, fmt: str) -> torch.dtype:
    """On-disk scale dtype: the layer's (llm-compressor numerics: the weight's) in compressed-tensors files,
    float32 in "fp8" ones (transformers' FineGrainedFP8 format has float32 scales)."""
    return layer.scale_dtype if fmt == "compressed-tensors" else torch.float32


def _linear_tensors(model: nn.Module, name: str, layer: Fp8Linear, fmt: str) -> Tensors:
    """An Fp8Linear's on-disk tensors: FP8 weight, scale under the format's name (float32, or the weight's
    dtype under llm-compressor numerics: exact either way), bias."""
    scale = layer.weight_scale.detach()
    if scale.ndim == 0:
        scale = scale.reshape(1)   # compressed-tensors' per-tensor shape
    yield f"{name}.weight", layer.weight.detach()
    yield f"{name}.{SCALE_LEAF[fmt]}", scale.to(_scale_dtype(layer, fmt))
    if layer.bias is not None:
        yield f"{name}.bias", layer.bias.detach()


def _experts_tensors(model: nn.Module, name: str, layer: Fp8Experts, fmt: str) -> Tensors:
    """Fp8Experts' on-disk tensors: per expert and projection, FP8 weight and scale (float32, or the weight's
    dtype under llm-compressor numerics) under the family's checkpoint names (moe_files), padding cropped."""
    if layer.w13_bias is not None:
        raise ValueError(f"{name}: experts with biases have no per-expert FP8 layout in fp8now yet; keep them "
                         f"in high precision (Fp8Config.ignore=[..., {name!r}])")
    modules = expert_modules(model, name, layer.num_experts)
    for e in range(layer.num_experts):
        for part, (q, s) in expert_tensors(layer, e).items():
            yield f"{modules[e, part]}.weight", q.detach()
            yield f"{modules[e, part]}.{SCALE_LEAF[fmt]}", s.detach().to(_scale_dtype(layer, fmt))


# Module type -> its tensors on disk, as (model, module name, module, format) -> (key, tensor)s, under the
# model's names (renamed to the checkpoint's by ckpt_names) or, for the types in CHECKPOINT_NAMED, already
# under the checkpoint's.
WRITERS: dict[type, Callable[[nn.Module, str, nn.Module, str], Tensors]] = {
    Fp8Linear: _linear_tensors, Fp8Experts: _experts_tensors}
CHECKPOINT_NAMED = (Fp8Experts,)
_ROUTERS = ("gate", "router")   # a MoE block's router, next to its experts: kept in high precision


def _quantized(model: nn.Module) -> tuple[dict[tuple, list[str]], list[str]]:
    """FP8 modules grouped by (scheme, activation kind), and the float linears and MoE routers left alone,
    all under the checkpoint's module names (experts: one per expert and projection), as compressed-tensors'
    targets and ignore list name them."""
    dense: dict[tuple, list[str]] = {}
    experts: dict[tuple, list[str]] = {}
    left: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            dense.setdefault((module.scheme, module.act_kind), []).append(name)
        elif isinstance(module, Fp8Experts):
            if module.is_loaded:
                names = expert_modules(model, name, module.num_experts).values()
                experts.setdefault((module.scheme, module.act_kind), []).extend(sorted(names))
            parent = name.rpartition(".")[0]
            left += [f"{parent}.{r}" for r in _ROUTERS if isinstance(getattr(
                model.get_submodule(parent), r, None), nn.Module) and f"{parent}.{r}" not in left]
        elif isinstance(module, nn.Linear) and name not in left:
            left.append(name)
    groups = {key: checkpoint_module_names(model, names) for key, names in dense.items()}
    for key, names in experts.items():
        groups.setdefault(key, []).extend(names)
    return groups, checkpoint_module_names(model, left)


def _numerics(model: nn.Module) -> str:
    """The weight numerics of the model's FP8 layers (llm-compressor's as soon as one layer has them)."""
    found = {m.weight_numerics for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))}
    return next((n for n in sorted(found) if n != "spec"), "spec")


def _named_tensors(model: nn.Module, fmt: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor to write under the checkpoint's names; tied tensors once (first name); no data is copied."""
    out: list[tuple[str, torch.Tensor]] = []
    ready: list[tuple[str, torch.Tensor]] = []   # already under the checkpoint's names
    exact: set[str] = set()                      # FP8 layers' tensors: renamed at most, never converted
    seen: set[int] = set()
    skip: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if skip and name.startswith(skip):
            continue
        prefix = f"{name}." if name else ""
        writer = WRITERS.get(type(module))
        if writer is not None:
            if isinstance(module, Fp8Experts) and not module.is_loaded:
                raise ValueError(f"{name} has no weight yet (meta device): load the model fully before saving")
            written = list(writer(model, name, module, fmt))
            if any(t.is_meta for _, t in written):
                raise ValueError(f"{name} has no weight yet (meta device): load the model fully before saving")
            if isinstance(module, CHECKPOINT_NAMED):
                ready += written
            else:
                out += written
                exact.update(key for key, _ in written)
            skip = (prefix,)
            continue
        own = [(leaf, p) for leaf, p in module._parameters.items() if p is not None]
        own += [(leaf, b) for leaf, b in module._buffers.items()
                if b is not None and leaf not in module._non_persistent_buffers_set]
        for leaf, t in own:
            if t.is_meta:
                raise ValueError(f"{prefix}{leaf} is on the meta device: load the model fully before saving")
            if t.dtype.itemsize == 1 and t.is_floating_point():
                raise ValueError(f"{type(module).__name__} {name} holds FP8 tensor {leaf!r} and fp8now has no "
                                 "writer for it; it cannot be exported")
            if id(t) not in seen:
                seen.add(id(t))
                out.append((prefix + leaf, t.detach()))
    return to_checkpoint_names(model, out, exact) + ready


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in storage of its own: safetensors refuses tensors sharing one (e.g. the slices of a
    `layers.stacked.Stack`)."""
    t = t.contiguous().cpu()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _shards(tensors: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `max_bytes` each (a larger single tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += n
    return shards


def _copy_side_files(source: Path | None, dest: Path) -> list[str]:
    """Copy tokenizer, generation and other non-weight files of `source` into `dest`."""
    if source is None or not source.is_dir():
        return []
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in _REWRITTEN \
                and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    return copied


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not an empty folder; choose a new --out path")


def save(model: nn.Module, out_dir: str | Path, format: str = "compressed-tensors", *,
         source: str | Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write an fp8now model as an FP8 checkpoint folder readable by transformers, vLLM and SGLang.

    format: "compressed-tensors" (every scheme) or "fp8" (transformers' FineGrainedFP8: block only).
    `source`: the folder the model came from, for its tokenizer and generation files (default: the
    config's `_name_or_path`). Shards hold at most `max_shard_bytes`, with an index when several.
    A known reader that cannot read the result is warned about (export_readers.reader_notes).
    """
    out = _save(model, out_dir, format, source, max_shard_bytes)
    for note in reader_notes(model, format):
        warnings.warn(f"fp8now: {note}", stacklevel=2)
    return out


def _save(model: nn.Module, out_dir: str | Path, format: str, source: str | Path | None,
          max_shard_bytes: int) -> Path:
    from safetensors.torch import save_file

    fmt = check_format(format)
    out_dir = Path(out_dir)
    _check_target(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    fp8_embedding = next((name for name, m in model.named_modules() if isinstance(m, Fp8Embedding)), None)
    if fp8_embedding is not None:
        raise ValueError(EMBEDDING_REFUSED.format(what=f"{fp8_embedding} is an FP8 embedding"))
    tp = getattr(model, "_fp8now_tp", None)
    if tp is not None:   # each rank holds slices: written as they are, they would pass for a whole model
        raise ValueError(f"{type(model).__name__} is split over a tensor-parallel group (rank {tp.rank} of "
                         f"{tp.size} holds slices of its layers and experts); saving needs the whole model: "
                         "load it without tp_plan in one process and save that (the FP8 bytes are the same)")
    groups, left = _quantized(model)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no FP8 layers: load it with fp8now.load (or quantize_) "
                         "before saving")
    for (scheme, act), names in groups.items():
        check_expressible(fmt, scheme, act, f"layer {names[0]}")
    qconfig = quantization_config(fmt, groups, left, _numerics(model))
    shards = _shards(_named_tensors(model, fmt), max_shard_bytes)
    if source is None:
        source = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{secrets.token_hex(8)}"
    tmp.mkdir(mode=0o777)   # the ordinary mode: 0777 less the umask
    try:
        _copy_side_files(Path(source) if source else None, tmp)
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: _own(t) for k, t in shard}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k, _ in shard})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for shard in shards for _, t in shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        # safetensors writes private files (0600) and copies keep their source's mode: give every file
        # the ordinary mode that config.json, written above, shows (without touching the process umask)
        chmod_files(tmp, (tmp / "config.json").stat().st_mode & 0o777)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_export(config: Fp8Config, format: str, out_dir: str | Path) -> str:
    """The checks `quantize` makes before loading anything: format name, scheme it can state, free target."""
    fmt = check_format(format)
    if config.embedding:
        raise ValueError(EMBEDDING_REFUSED.format(what="embedding=True (--fp8-embedding) asks for an FP8 embedding"))
    check_expressible(fmt, config.scheme, config.act_kind(), "the requested scheme")
    _check_target(Path(out_dir))
    return fmt


def quantize(model_dir: str | Path, out_dir: str | Path, config: Fp8Config | None = None,
             format: str = "compressed-tensors", *, device: torch.device | str | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES):
    """Quantize a bf16 checkpoint while loading it (fp8now.load) and save it in `format`: returns
    (out_dir, load report; its warnings name what a known reader cannot read). The format is checked against
    the scheme before anything is loaded."""
    from .sensitivity.keep import load

    config = config or Fp8Config()
    fmt = check_export(config, format, out_dir)
    model, report = load(model_dir, config, device=device, measure_error=False)
    out = _save(model, out_dir, fmt, model_dir, max_shard_bytes)
    report.notices += reader_notes(model, fmt)
    return out, report
