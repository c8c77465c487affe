"""`fp8now.load`: the load pipeline (loading.load), and with `Fp8Config(keep_bf16="auto:F")` first the scores of
the layers (or the cached ones), the ones to keep in bf16 (select.py) left alone by the load, and the load report
saying so. The public `fp8now.load` is `load` here, so that the pipeline below never imports this pass."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from ..config import Fp8Config, keep_bf16_fraction
from ..loading.load import load as load_pipeline
from .select import Selection, select


def load(model_dir: str | Path, config: Fp8Config | None = None, device: torch.device | str | None = None,
         dtype: torch.dtype = torch.bfloat16, *, measure_error: bool = True, tp_plan=None, tp_group=None,
         moe_parallel: str | None = None):
    """Load a bf16/fp16/fp32 Hugging Face checkpoint folder with its block linears quantized to FP8: the
    arguments and the result of `fp8now.loading.load.load` (its docstring says everything). With
    `config.keep_bf16="auto:F"` the sensitivity pass runs first (or its cached result is read) and the layers it
    chooses stay in bf16, each with its reason in the report."""
    config = config or Fp8Config()
    if config.keep_bf16 is not None:
        return load_keeping(load_pipeline, model_dir, config, device, dtype, measure_error, tp_plan, tp_group,
                            moe_parallel)
    return load_pipeline(model_dir, config, device, dtype, measure_error=measure_error, tp_plan=tp_plan,
                         tp_group=tp_group, moe_parallel=moe_parallel)


def chosen_layers(model_dir: str | Path, config: Fp8Config, device: torch.device | str | None = None,
                  progress: bool = False) -> tuple[Selection, dict]:
    """(the layers `config.keep_bf16` keeps in bf16, the sensitivity record they were chosen from)."""
    from .score import sensitivity

    if config.keep_bf16 is None:
        raise ValueError("chosen_layers needs Fp8Config(keep_bf16='auto:F')")
    record = sensitivity(model_dir, config, device, progress=progress)
    blocked = unkeepable_experts(Path(model_dir), record["layers"])
    return select(record["layers"], keep_bf16_fraction(config.keep_bf16), config.ignore, blocked), record


def unkeepable_experts(model_dir: Path, layers: list[dict]) -> dict[str, str]:
    """{experts module: why} for the experts modules whose checkpoint stores one tensor per expert: the load
    merges such tensors only into FP8 experts (loading.experts), so these cannot stay in bf16."""
    from ..loading.files import checkpoint_files, scan_headers

    experts = [row["name"] for row in layers if row["kind"] == "experts"]
    if not experts:
        return {}
    keys = {key for path in checkpoint_files(model_dir) for key, _, _ in scan_headers(path)}
    fused = {name for name in experts for key in keys if key.endswith(f"{name.partition('.')[2]}.gate_up_proj")}
    return {name: "its checkpoint stores one tensor per expert, which fp8now merges only into FP8 experts"
            for name in experts if name not in fused}


def load_keeping(load: Callable, model_dir: str | Path, config: Fp8Config, device, dtype: torch.dtype,
                 measure_error: bool, tp_plan, tp_group, moe_parallel) -> tuple:
    """fp8now.load's `load(model_dir, config, device, dtype, ...)` with the chosen layers added to `ignore`;
    the report's reasons for them give their rank and scores, `report.keep_bf16` the totals."""
    from ..loading.prequantized import prequantized_config

    model_dir = Path(model_dir)
    if tp_plan is not None:
        raise ValueError(f"keep_bf16={config.keep_bf16!r} with tp_plan: the sensitivity pass would run the whole "
                         "bf16 model on every rank. Choose the layers once in one process (fp8now.sensitivity.keep."
                         "chosen_layers, or `fp8now sensitivity MODEL --json`) and pass them as Fp8Config(ignore=...)")
    if prequantized_config(model_dir) is not None:
        raise ValueError(f"{model_dir} holds an FP8 checkpoint (quantization_config): its files decide which "
                         f"layers are FP8, so keep_bf16={config.keep_bf16!r} does not apply; load the bf16 "
                         "checkpoint with it, or this one without it")
    chosen, record = chosen_layers(model_dir, config, device)
    plain = dataclasses.replace(config, keep_bf16=None, ignore=(*config.ignore, *chosen.names))
    model, report = load(model_dir, plain, device, dtype, measure_error=measure_error, tp_plan=tp_plan,
                         tp_group=tp_group, moe_parallel=moe_parallel)
    why = {row["name"]: reason(config.keep_bf16, row, len(record["layers"])) for row in chosen.kept}
    report.ignored = [(name, why.get(name, text)) for name, text in report.ignored]
    report.keep_bf16 = summary(config.keep_bf16, chosen, record)
    return model, report


def reason(keep: str, row: dict, count: int) -> str:
    """Why one layer stayed in bf16, for the load report."""
    return (f"kept in bf16 by keep_bf16={keep!r}: sensitivity rank {row['rank']} of {count}, score "
            f"{row['score']:.3e} nats/token per MiB (KL alone {row['alone']:.3e} ± {row['alone_se']:.1e})")


def summary(keep: str, chosen: Selection, record: dict) -> dict:
    """The load report's `keep_bf16` entry: what was kept, the budget, where the scores came from."""
    source = record.get("cache_file") or record.get("cache_error", "")
    return {"keep_bf16": keep, "layers": chosen.names, "kept_bytes": chosen.kept_bytes,
            "budget_bytes": chosen.budget_bytes, "total_bytes": chosen.total_bytes,
            "ignored_by_pattern": [name for name, _ in chosen.ignored], "baseline_kl": record["baseline"],
            "unkeepable": [list(x) for x in chosen.unkeepable],
            "scores": ("read from " if record["cached"] else "computed and stored in ") + source
            if "cache_file" in record else f"computed, not cached ({source})"}
