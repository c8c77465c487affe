"""A transformers model's skeleton from a checkpoint folder's config.json: its parameters on the meta device
(zero bytes), its buffers real; clear errors for a missing, unreadable or unsupported config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config_fields import check_size_fields
from .custom_code import load_config
from .meta import ThreadDefaultDtype, parameters_on_meta

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def read_raw_config(model_dir: Path) -> dict:
    """config.json of a checkpoint folder as a dict, its model_type known to transformers and its size fields
    checked (config_fields); clear errors for a missing or odd folder, file or field."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist or is not a folder")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face checkpoint folder needs config.json "
                                "next to its *.safetensors files")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); re-download it") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ValueError(f"{path} has no 'model_type'; fp8now needs a transformers model config")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        hint = " (it uses custom code via auto_map, which fp8now does not run)" if "auto_map" in raw else ""
        raise ValueError(f"{path}: model_type {model_type!r} is not known to the installed transformers"
                         f"{hint}; upgrade transformers or use a supported architecture")
    check_size_fields(raw, str(path))
    return raw


def read_config(model_dir: Path) -> PretrainedConfig:
    """The transformers config of a checkpoint folder; clear errors for a missing/odd config.json."""
    read_raw_config(model_dir)
    return load_config(model_dir)


def auto_map_notice(model_dir: Path, raw: dict) -> str | None:
    """What to tell when config.json names custom code (auto_map) for a model_type transformers builds itself."""
    auto_map = raw.get("auto_map")
    if not auto_map:
        return None
    names = ", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else repr(auto_map)
    return (f"{model_dir / 'config.json'} names custom code under auto_map ({names}); fp8now never runs a "
            f"folder's code and built transformers' own {raw['model_type']!r} class instead: if that code changes "
            "the model, its outputs differ from the custom code's")


def build_skeleton(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The CausalLM of `model_dir/config.json` with parameters on meta and real buffers (CPU)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = read_config(model_dir)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "none listed"
        raise ValueError(f"{model_dir / 'config.json'}: model_type {config.model_type!r} (architectures: "
                         f"{archs}) has no causal-LM class in transformers; fp8now loads decoder LLMs")
    with parameters_on_meta(), ThreadDefaultDtype(dtype):
        model = AutoModelForCausalLM.from_config(config, dtype=None)  # None: no torch.set_default_dtype
    config.dtype = dtype
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
