"""config.json against the checkpoint's headers, before the skeleton is built: a config whose sizes the files
cannot hold (num_hidden_layers 10**6 for a 2-layer file, an intermediate_size of 10**12) would otherwise build
for minutes, or fail in the allocator, before any header said that the checkpoint does not match.

Both rules hold for every real checkpoint, so they refuse only configs that cannot match their files:
- each decoder layer holds at least one tensor under its own number (`layers.N.`, `h.N.`, `blocks.N.`), so
  num_hidden_layers is at most the number of layer numbers the files name (and at most their tensor count);
- every size the DIM_FIELDS name is the extent of some tensor along one dimension, or a factor of one (heads
  and head_dim in the q/k/v rows, the experts in the router's rows), so none exceeds the largest dimension
  of any tensor in the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..hf.config_fields import config_parts
from .source import Header

DIM_FIELDS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp",
              "num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_LAYER_NUMBER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def check_sizes(raw: dict, headers: list[Header], model_dir: Path) -> None:
    """Raise (naming config.json, the field and what the files hold) when a size of `raw` cannot fit them."""
    where = model_dir / "config.json"
    numbers = {int(m.group(1)) for h in headers if (m := _LAYER_NUMBER.search(h.key))}
    largest = max((d for h in headers for d in h.shape), default=0)
    for prefix, fields in config_parts(raw):
        layers = fields.get("num_hidden_layers")
        if isinstance(layers, int):
            held = len(numbers) if numbers else len(headers)
            if layers > held:
                what = (f"name {len(numbers)} layer numbers (largest {max(numbers)})" if numbers
                        else f"hold {len(headers)} tensors")
                raise ValueError(f"{where}: {prefix}num_hidden_layers is {layers}, but the checkpoint's files "
                                 f"{what}; config.json does not match the checkpoint (nothing was built)")
        for name in DIM_FIELDS:
            value = fields.get(name)
            sizes = value if isinstance(value, list) else [value]
            big = max((v for v in sizes if isinstance(v, int)), default=0)
            if big > largest:
                raise ValueError(f"{where}: {prefix}{name} is {value}, larger than every dimension of every tensor "
                                 f"in the checkpoint (the largest is {largest}); config.json does not match the "
                                 "checkpoint (nothing was built)")
