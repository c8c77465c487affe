"""Data-free sensitivity: how much quantizing each layer moves the output distribution (issue 40, part 2).

`sensitivity(folder, config)`: load the bf16 checkpoint, let it continue a few fixed openings (text.py),
quantize every target once and measure each layer (measure.py); the record is cached under the checkpoint's
hash, the scheme and the pass settings (cache.py), so a second call, or `fp8now.load` with keep_bf16, reads it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Fp8Config, scheme_key


def run_pass(model_dir: Path, config: Fp8Config, device: torch.device, prompts: tuple[str, ...],
             new_tokens: int, progress: bool = False) -> dict:
    """Load bf16, generate the text, quantize every target once, measure: the record sensitivity() stores
    (without its cache fields)."""
    from ..hf.bf16 import load_bf16
    from ..hf.tokenizer import load_tokenizer
    from .measure import measure, quantize_all
    from .text import generate

    seconds: dict[str, float] = {}
    start = t0 = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    model = load_bf16(model_dir, device)
    seconds["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sample = generate(model, tokenizer, prompts, new_tokens)
    seconds["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    units, report = quantize_all(model, config)
    seconds["quantize"] = time.perf_counter() - t0
    if not units:
        raise ValueError(f"{model_dir}: no layer to score: the model has no dense linear or MoE experts inside "
                         "its transformer blocks")
    t0 = time.perf_counter()
    measured = measure(model, sample, units, progress)
    seconds["measure"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - start
    texts = tokenizer.batch_decode(sample.ids[:, -new_tokens:], skip_special_tokens=False)
    return {**measured, "tokens": sample.tokens, "answers": texts, "seconds": seconds, "report": report,
            "sample": {"ids": sample.ids.tolist(), "mask": sample.mask.tolist()}}


def scoring_config(config: Fp8Config) -> Fp8Config:
    """The fields of `config` that change the FP8 numbers; every target scored (no ignore, no keep_bf16)."""
    return Fp8Config(scheme=config.scheme, moe_scheme=config.moe_scheme, activation=config.activation,
                     backend=config.backend, fast_accum=config.fast_accum, weight_numerics=config.weight_numerics)


def settings_of(config: Fp8Config, device: torch.device, prompts: tuple[str, ...], new_tokens: int) -> dict:
    """What a cached result depends on besides the checkpoint: the scoring config, the device type, the text."""
    fields = {"scheme": config.scheme.value, "moe_scheme": config.expert_scheme.value,
              "activation": config.act_kind(), "backend": config.backend, "fast_accum": config.fast_accum,
              "weight_numerics": config.weight_numerics}
    return {"config": fields, "device": device.type, "prompts": list(prompts), "new_tokens": new_tokens}


def sensitivity(model_dir: str | Path, config: Fp8Config | None = None, device: torch.device | str | None = None,
                *, prompts: tuple[str, ...] | None = None, new_tokens: int | None = None, refresh: bool = False,
                progress: bool = False, cache_dir: str | Path | None = None) -> dict:
    """Score every quantizable layer of the bf16 checkpoint `model_dir` under `config`'s scheme; cached.

    The result is read from the fp8now cache when this checkpoint (its files' hash), scheme and settings
    were scored before (`refresh=True` scores again). Returns the record: {"scheme", "settings", "baseline",
    "layers": [{"name", "kind", "bytes", "alone", "alone_se", "score"}] in model order (measure.measure), "tokens", "answers", "seconds", "forwards", "report", "cached": whether it
    was read from the cache, "cache_file" (or "cache_error" when it could not be written)}.
    """
    from ..loading.devices import resolve_device
    from .cache import VERSION, read, result_path, write_json
    from .text import NEW_TOKENS, PROMPTS

    model_dir = Path(model_dir)
    config = scoring_config(config or Fp8Config())
    device = resolve_device(device)
    settings = settings_of(config, device, tuple(prompts or PROMPTS), new_tokens or NEW_TOKENS)
    scheme = scheme_key(config.scheme, config.act_kind())
    path = result_path(model_dir, scheme, settings, cache_dir)
    record = None if refresh else read(path)
    if record is not None:
        return {**record, "cached": True, "cache_file": str(path)}
    record = run_pass(model_dir, config, device, tuple(settings["prompts"]), settings["new_tokens"], progress)
    record = {"version": VERSION, "model": str(model_dir), "scheme": scheme, "settings": settings,
              **record}
    try:
        write_json(path, record)
    except OSError as e:
        return {**record, "cached": False, "cache_error": f"cannot write {path}: {e.strerror or e}"}
    return {**record, "cached": False, "cache_file": str(path)}
