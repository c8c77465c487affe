"""Model folders for `fp8now bench`: a checkpoint folder, the embedded SmolLM2, or a shape preset written
to disk once as a random-weight bf16 checkpoint of a real model's shapes.

Why on disk: the load phase times what a user's load does (safetensors shards -> ready model), so a
preset must be a real checkpoint, written by transformers' own `save_pretrained` in shards as published
checkpoints are. The weights are generated tensor by tensor on the target device (seeded; rows of varied
magnitude, as trained weights have) and copied into a host model, so host memory holds one bf16 copy
of the model and nothing more.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

STAMP_FILE = "fp8now-bench-preset.json"
SHARD_SIZE = "5GB"        # the shard size of the published Llama-3.1 and Qwen3 checkpoints
EMBEDDED = "smollm2"      # the embedded model (real weights, through models.default_model_dir)


@dataclass(frozen=True)
class Preset:
    """A transformers model type, its config fields, and the decoder layers written by default."""

    model_type: str
    fields: dict = field(default_factory=dict)
    layers: int = 2


PRESETS: dict[str, Preset] = {
    # meta-llama/Llama-3.1-8B's config.json: all 32 layers, RoPE with llama3 scaling
    "llama3.1-8b": Preset("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001, hidden_act="silu", attention_bias=False, mlp_bias=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)), layers=32),
    # Qwen/Qwen3-30B-A3B's config.json (48 layers there; 8 by default here: each layer is alike)
    "qwen3-30b-a3b": Preset("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645, attention_bias=False, use_sliding_window=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), layers=8),
    # issue 37's CPU load: Llama-shaped (Llama-3.2-1B's widths, a 32000-token vocabulary), 8 layers, 1.1 GB bf16
    "llama-1gb": Preset("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, hidden_act="silu"), layers=8),
    # a CPU smoke run
    "tiny": Preset("llama", dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2), layers=2),
}
NAMES = (*PRESETS, EMBEDDED)


def preset_config(name: str, layers: int | None = None):
    """The transformers config of preset `name` with `layers` decoder layers (default: the preset's)."""
    from transformers import AutoConfig

    p = PRESETS[name]
    layers = p.layers if layers is None else layers
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    return AutoConfig.for_model(p.model_type, **p.fields, num_hidden_layers=layers)


def fill_random_(model: torch.nn.Module, device: torch.device | str, seed: int = 0) -> None:
    """Seeded weights, generated one tensor at a time on `device` in float32, stored in bf16 in the
    (host) model: matrices N(0, 1/fan_in) with each row scaled by exp(N(0, 0.5^2)), embeddings with
    unit rows, 1-D norm weights 1 + N(0, 0.1^2), biases N(0, 0.02^2)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if len(shape) >= 2:
                rows = torch.exp(0.5 * torch.randn(shape[:-1] + (1,), generator=g, device=device))
                base = 1.0 if "embed" in name else 1.0 / math.sqrt(shape[-1])
                value = torch.randn(shape, generator=g, device=device).mul_(rows).mul_(base)
            elif name.endswith("bias"):
                value = 0.02 * torch.randn(shape, generator=g, device=device)
            else:
                value = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
            p.copy_(value.to(torch.bfloat16))
            del value


def write_random(config, folder: Path, device: torch.device | str, seed: int = 0) -> Path:
    """Write the CausalLM of transformers `config` with fill_random_'s weights into the new folder
    `folder` (config.json + safetensors shards of SHARD_SIZE)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")              # the one host copy, filled tensor by tensor
    fill_random_(model, device, seed)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder), max_shard_size=SHARD_SIZE)
    finally:
        hf_logging.enable_progress_bar()
    return folder


def preset_dir(name: str, workdir: str | os.PathLike, layers: int | None, device: torch.device | str,
               seed: int = 0, log=None) -> Path:
    """The folder of preset `name` in `workdir`, written on first use: into a temporary sibling that is
    renamed when complete, so an interrupted write is never taken for a checkpoint."""
    layers = PRESETS[name].layers if layers is None else layers
    stamp = {"preset": name, "layers": layers, "seed": seed}
    target = Path(workdir) / f"{name}-{layers}l-seed{seed}"
    try:
        if json.loads((target / STAMP_FILE).read_text()) == stamp:
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{secrets.token_hex(4)}"
    if log:
        log(f"writing preset {name} ({layers} layers, random weights) to {target}")
    try:
        write_random(preset_config(name, layers), tmp, device, seed)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def bench_model_dir(arg: str | None, workdir: str | os.PathLike, layers: int | None,
                    device: torch.device | str, log=None) -> tuple[str, Path]:
    """(model name for the rows, folder): a preset written into `workdir` (named with its layer count,
    e.g. `qwen3-30b-a3b-8l`), the embedded model, or a checkpoint folder / repo id as every command
    takes it."""
    from ..hf.models import resolve_model

    if arg in PRESETS:
        folder = preset_dir(arg, workdir, layers, device, log=log)
        return f"{arg}-{PRESETS[arg].layers if layers is None else layers}l", folder
    if layers is not None:
        raise ValueError(f"--layers applies to the presets ({', '.join(PRESETS)}), not to {arg or EMBEDDED}")
    folder = resolve_model(arg, progress=False)
    return (EMBEDDED if arg is None or str(arg).strip().lower() == EMBEDDED else folder.name), folder
