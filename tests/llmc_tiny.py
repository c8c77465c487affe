"""The tiny bf16 (and one fp16) checkpoints that llm-compressor quantized for tests/fixtures/llmc (issue 40).

Rebuilt from a seed rather than stored: every parameter is drawn from its own generator, seeded by the model
and parameter names, so the values depend on torch's generator and the names only, not on the order or the
initialisation of transformers' modules. The fixture script (scripts/llmc_fixtures.py, run with
llm-compressor's transformers) and the tests (this project's transformers) build the same bytes; the
fixtures record each input tensor's SHA-256 (`inputs.json`), and the tests check it first.

Sizes are small but cover the cases that differ between rules: 128x128 tiles that are full and partial
(hidden 160 = 1.25 tiles, intermediate 144), an all-zero row and an all-zero 128x128 tile (the zero
guards), rows of very different magnitudes, and MoE experts whose intermediate size (64) is not a
multiple of 128.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import torch

# name -> (transformers model_type, config fields, dtype)
_COMMON: dict[str, Any] = dict(
    hidden_size=160, num_hidden_layers=1, num_attention_heads=5, num_key_value_heads=1, head_dim=32,
    vocab_size=32, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(intermediate_size=144), torch.bfloat16),
    "llama_fp16": ("llama", dict(intermediate_size=144), torch.float16),   # scales in float16
    "qwen3": ("qwen3", dict(intermediate_size=144), torch.bfloat16),
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=144, moe_intermediate_size=64, num_experts=4,
                                    num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True),
                  torch.bfloat16),
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None), torch.bfloat16),
}
# More MoE families llm-compressor linearizes, kept as SHA-256 of its output only (fixtures/llmc/moe_families.json):
# smaller layers (4 heads), one MoE layer each, expert intermediate 64. (Llama 4's text model is not among them:
# llm-compressor 0.14 fails on Llama4TextConfig, which has no text_config.)
_MOE: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2)
HASHED: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "qwen2_moe": ("qwen2_moe", dict(_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=96, intermediate_size=96,
                                    decoder_sparse_step=1), torch.bfloat16),
    "olmoe": ("olmoe", dict(_MOE, num_experts=4, num_experts_per_tok=2, intermediate_size=64), torch.bfloat16),
    "deepseek_v3": ("deepseek_v3", dict(_MOE, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                        intermediate_size=96, n_shared_experts=1, first_k_dense_replace=0,
                                        n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=None,
                                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                        num_key_value_heads=4, head_dim=16), torch.bfloat16),
    "gpt_oss": ("gpt_oss", dict(_MOE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                sliding_window=64, layer_types=["full_attention"]), torch.bfloat16),
}
SEED = 40


def _values(key: str, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Float32 values of model `key`'s parameter `name`: rows of varied magnitude (2-D and up), norms
    around 1."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{key}/{name}".encode()))
    if len(shape) < 2:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    rows = torch.exp(torch.randn(shape[:-1] + (1,), generator=g))    # magnitudes over ~e^±3
    return torch.randn(shape, generator=g) * rows / shape[-1] ** 0.5


def _special_(name: str, t: torch.Tensor) -> None:
    """Zero guards: in every layer's o_proj, an all-zero 128x128 tile and an all-zero row."""
    if name.endswith("self_attn.o_proj.weight"):
        t[:128, :128] = 0.0
        t[150] = 0.0


def build(key: str, seed: int = SEED):
    """The CausalLM `key` (see MODELS, HASHED) with seeded values in its dtype, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields, dtype = {**MODELS, **HASHED}[key]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **fields})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = _values(key, name, tuple(p.shape), seed)
            _special_(name, v)
            p.data = v.to(dtype)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    return model.eval()


def write(key: str, folder: str | Path, seed: int = SEED) -> Path:
    """Save `build(key)` with save_pretrained into folder/key; returns that folder."""
    path = Path(folder) / key
    build(key, seed).save_pretrained(path)
    return path


def tensor_hashes(folder: str | Path) -> dict[str, str]:
    """SHA-256 of every tensor's bytes in a checkpoint folder's safetensors files, with dtype and shape."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
                out[name] = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {digest}"
    return out


def digest(hashes: dict[str, str]) -> str:
    """One SHA-256 of a `tensor_hashes` dict."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
