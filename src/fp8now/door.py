"""The from_pretrained door: `AutoModelForCausalLM.from_pretrained(path, quantization_config=
fp8now.TransformersConfig(scheme="channel"))` returns the model with fp8now's `Fp8Linear`s, quantized
while transformers streams the checkpoint, with the bytes `fp8now.load` gives.

Registered through transformers' public `register_quantization_config` / `register_quantizer` when this
module is imported, which `fp8now.TransformersConfig` does on first use (so `import fp8now` stays light).
Written against transformers 5.17 and 5.25: only the hooks both share are used (`param_needs_quantization`,
`get_quantize_ops`, `_process_model_before/after_weight_loading`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .config import Fp8Config
from .hf import swap_linears, target_linears
from .kernels import quantize_weight
from .linear import Fp8Linear

METHOD = "fp8now"


class TransformersConfig(QuantizationConfigMixin):
    """fp8now's quantization config for transformers' `from_pretrained` (fields as in `Fp8Config`)."""

    def __init__(self, scheme: str = "channel", ignore: tuple[str, ...] | list[str] = ("lm_head",),
                 backend: str = "auto", activation: str = "auto", batch_invariant: bool = False,
                 decode_graphs: bool = True, fast_accum: bool = False, **kwargs) -> None:
        self.quant_method = METHOD
        self.scheme = str(getattr(scheme, "value", scheme))
        self.ignore = list(ignore) if not isinstance(ignore, str) else ignore
        self.backend, self.activation = backend, activation
        self.batch_invariant, self.decode_graphs = batch_invariant, decode_graphs
        self.fast_accum = fast_accum
        self.fp8_config()   # validate now, with Fp8Config's errors

    def fp8_config(self) -> Fp8Config:
        return Fp8Config(scheme=self.scheme, ignore=tuple(self.ignore) if not isinstance(self.ignore, str)
                         else self.ignore, backend=self.backend, activation=self.activation,
                         batch_invariant=self.batch_invariant, decode_graphs=self.decode_graphs,
                         fast_accum=self.fast_accum)


class _QuantizeOnLoad(ConversionOps):
    """transformers' conversion op for one Fp8Linear weight: float weight in, FP8 weight and scale out."""

    def __init__(self, hf_quantizer: HfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model: nn.Module | None = None, **kwargs) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in input_dict.items():
            w = value[0] if isinstance(value, list) else value                  # [N, K]
            prefix = key.rpartition(".")[0]
            layer = model.get_submodule(prefix)
            q, s = quantize_weight(w, layer.scheme, name=layer.name or None)
            out[key] = q
            out[f"{prefix}.weight_scale"] = s.reshape(layer.weight_scale.shape)
        return out


class Fp8nowQuantizer(HfQuantizer):
    """Swaps the block linears for meta `Fp8Linear`s, quantizes each weight as it arrives."""

    requires_calibration = False

    def validate_environment(self, *args, **kwargs) -> None:
        if self.pre_quantized:
            raise ValueError("quant_method 'fp8now' in a checkpoint's config.json: fp8now does not save that; "
                             "load bf16 checkpoints with TransformersConfig, FP8 ones with fp8now.load")

    @property
    def quantized_element_size(self) -> float:
        return 1

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs) -> bool:
        prefix, _, leaf = param_name.rpartition(".")
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            return False
        return isinstance(module, Fp8Linear) and leaf == "weight"

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs) -> None:
        config = self.quantization_config.fp8_config()
        targets, self.ignored = target_linears(model, config)
        if not targets:
            raise ValueError(f"fp8now: nothing to quantize in {type(model).__name__}: all linear layers are "
                             "left alone; loosen TransformersConfig.ignore")
        dtypes = {name: linear.weight.dtype for name, linear in targets.items()}
        for name, layer in swap_linears(model, targets, config, "meta").items():
            # The float weight arrives in the model's dtype; a float placeholder keeps transformers from
            # casting it to FP8 before the quantize op sees it (5.17 casts to the parameter's dtype).
            layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtypes[name],
                                                    device="meta"), requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(torch.empty(layer.out_features, dtype=dtypes[name], device="meta"),
                                          requires_grad=False)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs) -> nn.Module:
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear):
                if module.weight.dtype.itemsize != 1 or module.weight.is_meta:
                    raise RuntimeError(f"fp8now: {name}.weight was not quantized while loading (it is "
                                       f"{module.weight.dtype}); its tensor is missing from the checkpoint")
                module.pick_backend()
        model.requires_grad_(False)
        return model

    def get_quantize_ops(self) -> ConversionOps:
        return _QuantizeOnLoad(self)

    def is_serializable(self, *args, **kwargs) -> bool:
        return False   # save with fp8now.save (compressed-tensors / fp8), which every reader knows

    @property
    def is_trainable(self) -> bool:
        return False


if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
    register_quantization_config(METHOD)(TransformersConfig)
if METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(METHOD)(Fp8nowQuantizer)
