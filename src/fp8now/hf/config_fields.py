"""The size fields of a config.json, checked before transformers builds anything from them: a negative, zero,
fractional or string size otherwise fails deep inside a model's constructor (a negative dimension, a division
by zero, an allocator failure) or builds for minutes. Each error names the file and the field."""

from __future__ import annotations

# Size fields (top level, or in a multimodal config's text_config) -> the least value a model can have. A field
# may also be a list of such sizes (per-layer sizes) or null (not used by the family).
SIZE_FIELDS: dict[str, int] = {
    "num_hidden_layers": 1, "hidden_size": 1, "intermediate_size": 1, "vocab_size": 1,
    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1, "max_position_embeddings": 1,
    "moe_intermediate_size": 1, "shared_expert_intermediate_size": 0, "intermediate_size_mlp": 1,
    "num_experts": 0, "num_local_experts": 0, "n_routed_experts": 0, "n_shared_experts": 0,
    "num_experts_per_tok": 1, "first_k_dense_replace": 0, "decoder_sparse_step": 1, "kv_lora_rank": 1,
    "q_lora_rank": 1, "qk_rope_head_dim": 0, "qk_nope_head_dim": 0, "v_head_dim": 1, "n_group": 1,
    "topk_group": 1, "interleave_moe_layer_step": 0,
}
MAX_SIZE = 2**31 - 1   # beyond any tensor dimension (and any count of layers) a checkpoint can hold


def config_parts(raw: dict) -> list[tuple[str, dict]]:
    """(prefix, fields) of a config: the top level, and a multimodal config's text_config."""
    parts = [("", raw)]
    text = raw.get("text_config")
    if isinstance(text, dict):
        parts.append(("text_config.", text))
    return parts


# Fields that size no tensor (RoPE computes positions), so only their sign is checked.
UNBOUNDED = ("max_position_embeddings",)


def _bad(value, least: int, most: int | None) -> bool:
    whole = isinstance(value, int) and not isinstance(value, bool)
    return not (whole and value >= least and (most is None or value <= most))


def check_size_fields(raw: dict, where: str) -> None:
    """Every SIZE_FIELDS entry of `raw` (the parsed config.json at `where`) is a whole number in range, a list
    of them, or null; else a ValueError naming the field and what it holds. A text_config must be an object."""
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"{where}: text_config is {text!r} ({type(text).__name__}); it must be an object (a "
                         "multimodal model's language-model config); config.json is corrupt: re-download it")
    for prefix, fields in config_parts(raw):
        for name, least in SIZE_FIELDS.items():
            value = fields.get(name)
            if value is None:
                continue
            most = None if name in UNBOUNDED else MAX_SIZE
            values = value if isinstance(value, list) else [value]
            if not values or any(_bad(v, least, most) for v in values):
                span = f"at least {least}" if most is None else f"from {least} to {most}"
                raise ValueError(f"{where}: {prefix}{name} is {value!r}; it must be a whole number {span} (or a "
                                 "list of them); config.json is corrupt or hand-edited: re-download it")
