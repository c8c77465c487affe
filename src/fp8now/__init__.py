"""fp8now: run bf16/fp16 LLM checkpoints in FP8, quantized while they load."""

from .config import Fp8Config, Scheme
from .linear import Fp8Linear
from .numerics import dequantize, quantize_activation, quantize_weight, rel_diff, sqnr

__all__ = [
    "Fp8Config", "Fp8Linear", "Scheme",
    "dequantize", "quantize_activation", "quantize_weight", "rel_diff", "sqnr",
]
__version__ = "0.1.0"
