"""The from_pretrained door: `AutoModelForCausalLM.from_pretrained(path, quantization_config=
fp8now.TransformersConfig(scheme="channel"))` returns the model with fp8now's `Fp8Linear`s and `Fp8Experts`,
quantized while transformers streams the checkpoint, with the bytes `fp8now.load` gives. Experts arrive as
transformers' own fused params (it merges per-expert files itself); a layer is quantized when all of them
arrived, by the same `load_` as fp8now.load.

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

from ..config import Fp8Config
from .modules import freeze_fp8, set_submodule, swap_linears, target_linears
from .head import check_options
from .experts import (BIAS_LEAVES, FUSED_LEAVES, empty_fp8_experts, experts_layout, hf_shapes, hf_to_fused,
                      target_experts)
from ..kernels import quantize_weight
from ..layers.guard import install as install_guard
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts

METHOD = "fp8now"


class TransformersConfig(QuantizationConfigMixin):
    """fp8now's quantization config for transformers' `from_pretrained` (fields as in `Fp8Config`; `head=True`
    quantizes an untied output head; `embedding=True` is refused: use fp8now.load for an FP8 embedding)."""

    def __init__(self, scheme: str = "channel", ignore: tuple[str, ...] | list[str] = (),
                 backend: str = "auto", activation: str = "auto", batch_invariant: bool = False,
                 decode_graphs: bool = True, fast_accum: bool = False, head: bool = False,
                 embedding: bool = False, weight_numerics: str = "spec", **kwargs) -> None:
        self.quant_method = METHOD
        self.scheme = str(getattr(scheme, "value", scheme))
        self.ignore = list(ignore) if not isinstance(ignore, str) else ignore
        self.backend, self.activation = backend, activation
        self.batch_invariant, self.decode_graphs = batch_invariant, decode_graphs
        self.fast_accum, self.head, self.embedding = fast_accum, head, embedding
        self.weight_numerics = weight_numerics
        self.fp8_config()   # validate now, with Fp8Config's errors
        if embedding:
            raise ValueError("TransformersConfig(embedding=True): the from_pretrained door does not store the "
                             "input embedding in FP8 (transformers loads it as a float parameter); use "
                             "fp8now.load(folder, Fp8Config(embedding=True)), or embedding=False here")

    def fp8_config(self) -> Fp8Config:
        return Fp8Config(scheme=self.scheme, ignore=tuple(self.ignore) if not isinstance(self.ignore, str)
                         else self.ignore, backend=self.backend, activation=self.activation,
                         batch_invariant=self.batch_invariant, decode_graphs=self.decode_graphs,
                         fast_accum=self.fast_accum, head=self.head, embedding=self.embedding,
                         weight_numerics=self.weight_numerics)


class _QuantizeOnLoad(ConversionOps):
    """transformers' conversion op for one Fp8Linear weight (float weight in, FP8 weight and scale out) or one
    experts parameter (held until its layer's others arrived, then the layer is quantized by `load_`)."""

    def __init__(self, hf_quantizer: HfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model: nn.Module | None = None, **kwargs) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in input_dict.items():
            w = value[0] if isinstance(value, list) else value                  # [N, K]
            prefix, _, leaf = key.rpartition(".")
            layer = model.get_submodule(prefix)
            if isinstance(layer, Fp8Experts):
                out.update(self._experts(prefix, leaf, layer, w))
                continue
            q, s = quantize_weight(w, layer.scheme, layer.name or None, layer.weight_numerics)
            layer.scale_dtype = s.dtype   # llm-compressor numerics: the weight's dtype (what save writes)
            out[key] = q
            out[f"{prefix}.weight_scale"] = s.float().reshape(layer.weight_scale.shape)
        return out

    def _experts(self, prefix: str, leaf: str, layer: Fp8Experts, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Hold `t`; once every transformers param of the layer arrived, quantize it as fp8now.load does.
        The float placeholders get an empty tensor (dropped after loading), the FP8 params their values."""
        held = self.hf_quantizer.held.setdefault(prefix, {})
        held[leaf] = t
        layout = self.hf_quantizer.layouts[prefix]
        if set(held) != set(hf_shapes(layer, layout)):
            return {f"{prefix}.{leaf}": t.new_empty(0)}
        del self.hf_quantizer.held[prefix]
        w13, w2, b13, b2 = hf_to_fused(layout, *(held.get(lf) for lf in (*FUSED_LEAVES, *BIAS_LEAVES)))
        layer.load_(w13, w2, b13, b2)
        out = {f"{prefix}.{lf}": t.new_empty(0) for lf in held}
        out.update({f"{prefix}.{n}": p.data for n, p in layer.named_parameters() if n not in held})
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
        if isinstance(module, Fp8Experts):
            return leaf in (*FUSED_LEAVES, *BIAS_LEAVES)
        return isinstance(module, Fp8Linear) and leaf == "weight"

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs) -> None:
        config = self.quantization_config.fp8_config()
        try:
            check_options(model, config, f"fp8now ({type(model).__name__}.from_pretrained)")   # head=: tied models
        except ValueError as e:   # a tied head needs embedding=True, which this door refuses
            raise ValueError(f"{e}. This door cannot store an FP8 embedding: for a tied model's FP8 head use "
                             "fp8now.load(folder, Fp8Config(head=True, embedding=True))") from None
        targets, self.ignored = target_linears(model, config)
        if not targets:
            raise ValueError(f"fp8now: nothing to quantize in {type(model).__name__}: all linear layers are "
                             "left alone; loosen TransformersConfig.ignore")
        self.held, self.layouts = {}, {}
        for name, module in target_experts(model, config)[0].items():
            # float placeholders under transformers' names, so that its loader routes the experts here
            layer = empty_fp8_experts(name, module, config, "meta")
            self.layouts[name] = experts_layout(name, module)
            for leaf, shape in hf_shapes(layer, self.layouts[name]).items():
                layer.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=module.gate_up_proj.dtype,
                                                                        device="meta"), requires_grad=False))
            set_submodule(model, name, layer)
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
            elif isinstance(module, Fp8Experts):
                if not module.is_loaded:
                    raise RuntimeError(f"fp8now: experts {name} were not quantized while loading; their tensors "
                                       "are missing from the checkpoint")
                for leaf in (*FUSED_LEAVES, *BIAS_LEAVES):
                    module._parameters.pop(leaf, None)   # the emptied float placeholders
        freeze_fp8(model)
        install_guard(model)   # reload_weights is atomic for this model's forwards (layers.guard)
        return model

    def get_quantize_ops(self) -> ConversionOps:
        return _QuantizeOnLoad(self)

    def is_serializable(self, *args, **kwargs) -> bool:
        """Asked only by save_pretrained, whose own refusal names nothing: say what to use instead."""
        raise ValueError("save_pretrained cannot write fp8now's FP8 layers (no reader knows a quant_method "
                         "'fp8now'): save the model with fp8now.save(model, folder, format='compressed-tensors' "
                         "or 'fp8'), which transformers, vLLM and SGLang read")

    @property
    def is_trainable(self) -> bool:
        return False


if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
    register_quantization_config(METHOD)(TransformersConfig)
if METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(METHOD)(Fp8nowQuantizer)
