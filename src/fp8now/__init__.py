"""fp8now: run bf16/fp16 LLM checkpoints in FP8, quantized while they load."""

from .config import Fp8Config, Scheme
from .export import save
from .layers.guard import ReloadInProgress, TornWeights, guard
from .layers.linear import Fp8Linear
from .layers.moe import Fp8Experts
from .sensitivity.keep import load
from .loading.quantize import quantize_
from .loading.reload import reload_weights
from .numerics import dequantize, quantize_activation, quantize_weight, rel_diff, sqnr
from .report import LoadReport

__all__ = [
    "Fp8Config", "Fp8Experts", "Fp8Linear", "LoadReport", "Scheme", "load", "quantize_", "reload_weights",
    "guard", "ReloadInProgress", "TornWeights",
    "dequantize", "quantize_activation", "quantize_weight", "rel_diff", "sqnr", "save", "TransformersConfig",
]


def __getattr__(name: str):
    """`TransformersConfig` imports transformers and registers fp8now with it: done on first use only."""
    if name == "TransformersConfig":
        from .hf.door import TransformersConfig

        return TransformersConfig
    raise AttributeError(f"module 'fp8now' has no attribute {name!r}")
__version__ = "0.1.0"
