"""Tiny random MoE models of every family transformers ships, saved with save_pretrained (the real layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "llama4_text")

EXPERT_GAIN = 0.5  # routed experts add a modest update to the residual stream, as in trained models
_COMMON: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    vocab_size=256, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)
# Per family: experts E = 4-8, expert intermediate I = 128-192, top-k 2; shared experts where the family has them.
_PER_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                      shared_expert_intermediate_size=128, intermediate_size=256, decoder_sparse_step=1,
                      norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=256,
                      decoder_sparse_step=1, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=192, sliding_window=None),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=128),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                        intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                        topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4,
                        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=192,
                        intermediate_size_mlp=256, interleave_moe_layer_step=1, attn_temperature_tuning=False),
}


def moe_config(family: str, **overrides: Any):
    """A small transformers config of a MoE `family` (see MOE_FAMILIES)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **_PER_FAMILY[family], **overrides})


def moe_model(family: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, spread: float = 40.0,
              **overrides: Any):
    """The CausalLM of `moe_config(family)` with seeded random weights; expert magnitudes differ by
    `spread` (40x shows a scale shared across experts; 1 keeps routing flips from dominating a KL)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **overrides), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:  # fused experts [E, ., .]: expert e scaled by 1 .. spread
                mag = torch.linspace(1.0, spread, p.shape[0]).reshape(-1, 1, 1) / spread
                p.copy_(torch.randn(p.shape, generator=g) * mag * EXPERT_GAIN / p.shape[-1] ** 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        for p in model.parameters():   # parameters only: buffers such as RoPE inv_freq stay float32
            p.data = p.data.to(dtype)
    return model.eval()


def save_moe(family: str, folder: Path, seed: int = 0, spread: float = 40.0, **overrides: Any) -> Path:
    """Save `moe_model(family)` with save_pretrained into folder/family; returns that path."""
    path = Path(folder) / family
    moe_model(family, seed, spread=spread, **overrides).save_pretrained(path)
    return path
