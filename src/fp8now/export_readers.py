"""Which readers read what fp8now.save writes, where one known reader cannot: said when the file is written,
not only in the README (the files themselves are right; fp8now.load reads them back byte-identical)."""

from __future__ import annotations

from torch import nn

from .config import Scheme
from .layers.moe import Fp8Experts

BLOCK = 128


def reader_notes(model: nn.Module, fmt: str) -> list[str]:
    """One line per limitation of a known reader that the checkpoint `model` makes in `fmt` runs into."""
    if fmt != "compressed-tensors":
        return []
    wide = [name for name, m in model.named_modules() if isinstance(m, Fp8Experts) and m.is_loaded
            and m.scheme is Scheme.BLOCK and max(m.hidden_size, m.intermediate_size) > BLOCK]
    if not wide:
        return []
    return [f"block-scaled MoE experts ({wide[0]}{', ...' if len(wide) > 1 else ''}) in compressed-tensors files: "
            "transformers (5.25, compressed-tensors 0.20) cannot read them (its dequantizer does not spread a "
            f"block scale over its {BLOCK}x{BLOCK} tiles and fails with a broadcast error); fp8now.load reads "
            "them back byte-identical. For transformers write --format fp8 (format='fp8'), or use the channel "
            "scheme for the experts (moe_scheme)"]
