"""fp8now.load on FP8 checkpoints written by other tools: compressed-tensors' own API and hand-made files
in the layouts other tools use. The FP8 bytes and scales must be the files', never re-quantized."""

from __future__ import annotations

import pytest
import torch
from test_export import file_tensors, logits, same_bytes
from tiny import save_checkpoint, tiny_model, unique_state_dict

import fp8now
from fp8now import Fp8Linear, rel_diff

FP8 = torch.float8_e4m3fn


def block_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def check_loaded_as_files(folder, bf16_model, scale_leaf: str, scheme: str) -> fp8now.LoadReport:
    """Every FP8 layer holds the file's bytes and scale; the logits stay near the bf16 model's."""
    model, report = fp8now.load(folder, device="cpu")
    files = file_tensors(folder)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(layers) == sorted(block_linears(bf16_model))
    for name, layer in layers.items():
        assert same_bytes(layer.weight, files[f"{name}.weight"])
        s = files[f"{name}.{scale_leaf}"]
        assert layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight_scale.reshape(-1), s.float().reshape(-1))   # bf16 -> float32 is exact
        assert layer.scheme.value == scheme
    assert rel_diff(logits(model), logits(bf16_model)) < 2e-2     # a misread scale gives ~1
    return report


@pytest.mark.parametrize("preset,scheme", [("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block"), ("FP8", "tensor")])
def test_checkpoint_written_by_compressed_tensors(tmp_path, preset, scheme):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = tiny_model("qwen2", seed=5)
    reference = tiny_model("qwen2", seed=5)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.detach().float()
        if args.strategy == "tensor":
            lo, hi = w.amin(), w.amax()
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            pad = torch.nn.functional.pad(w, (0, -w.shape[1] % 128, 0, -w.shape[0] % 128))
            tiles = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
            lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
        scale, _ = calculate_qparams(lo, hi, args)                 # compressed-tensors' own scale rule
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "input_scale"):                          # FP8: a calibrated static scale
            module.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(tmp_path / "ct")
    compressor.update_config(str(tmp_path / "ct"))
    assert file_tensors(tmp_path / "ct")["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    report = check_loaded_as_files(tmp_path / "ct", reference, "weight_scale", scheme)
    unused = [key for key, why in report.skipped_tensors if "static input scale" in why]
    assert len(unused) == (len(block_linears(reference)) if preset == "FP8" else 0)


def other_tool_checkpoint(folder, qconfig: dict, scale_leaf: str, rows: int | None, cols: int | None,
                          scale_dtype: torch.dtype, flat: bool = False, input_scale: bool = False):
    """A bf16 tiny model re-saved the way other tools do: scale = amax/448 in `scale_dtype` per
    (rows x cols) group (None spans the dim), q = fp8(w / scale). Returns the bf16 model."""
    model = tiny_model("qwen2", seed=6)
    tensors = unique_state_dict(model)
    for name in block_linears(model):
        w = tensors.pop(f"{name}.weight").float()
        n, k = w.shape
        gr, gc = rows or n, cols or k
        pad = torch.nn.functional.pad(w, (0, -k % gc, 0, -n % gr)).unflatten(0, (-1, gr)).unflatten(2, (-1, gc))
        scale = (pad.abs().amax((1, 3)) / 448).to(scale_dtype)     # [ceil(n/gr), ceil(k/gc)]
        spread = scale.float().repeat_interleave(gr, 0)[:n].repeat_interleave(gc, 1)[:, :k]
        tensors[f"{name}.weight"] = (w / spread).clamp(-448, 448).to(FP8)
        tensors[f"{name}.{scale_leaf}"] = scale.reshape(-1) if flat else scale
        if input_scale:
            tensors[f"{name}.input_scale"] = torch.tensor([0.02], dtype=torch.float32)
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    save_checkpoint(tensors, config, folder)
    return model


def test_channel_scales_in_bf16_of_shape_n(tmp_path):
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                     "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True}}}}
    model = other_tool_checkpoint(tmp_path / "c", ct, "weight_scale", 1, None, torch.bfloat16, flat=True)
    check_loaded_as_files(tmp_path / "c", model, "weight_scale", "channel")


def test_fp8_static_per_tensor_with_weight_scale_name(tmp_path):
    """vLLM-style `quant_method: fp8` per-tensor files: `weight_scale` + a static `input_scale`."""
    qc = {"quant_method": "fp8", "activation_scheme": "static"}
    model = other_tool_checkpoint(tmp_path / "t", qc, "weight_scale", None, None, torch.float32, input_scale=True)
    report = check_loaded_as_files(tmp_path / "t", model, "weight_scale", "tensor")
    unused = {key for key, why in report.skipped_tensors if "static input scale" in why}
    assert unused == {f"{n}.input_scale" for n in block_linears(model)}


def test_fp8_blocks_with_bf16_scale_inv(tmp_path):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model = other_tool_checkpoint(tmp_path / "b", qc, "weight_scale_inv", 128, 128, torch.bfloat16)
    check_loaded_as_files(tmp_path / "b", model, "weight_scale_inv", "block")


def test_bad_prequantized_checkpoints_say_what_is_wrong(tmp_path):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    other_tool_checkpoint(tmp_path / "ok", qc, "weight_scale_inv", 128, 128, torch.float32)
    files = file_tensors(tmp_path / "ok")
    config = tiny_model("qwen2").config.to_dict()

    def variant(name, tensors, quantization):
        save_checkpoint(tensors, {**config, "quantization_config": quantization}, tmp_path / name)
        return tmp_path / name

    no_scale = {k: v for k, v in files.items() if k != "model.layers.1.mlp.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match=r"model.safetensors: FP8 weight 'model.layers.1.mlp.up_proj.weight' "
                                         r"has no 'weight_scale_inv'"):
        fp8now.load(variant("no_scale", no_scale, qc), device="cpu")
    with pytest.raises(ValueError, match="quant_method 'awq' is not one fp8now reads"):
        fp8now.load(variant("awq", files, {"quant_method": "awq"}), device="cpu")
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        fp8now.load(variant("b64", files, {**qc, "weight_block_size": [64, 64]}), device="cpu")
    wrong = dict(files)
    wrong["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"scale 'model.layers.0.mlp.up_proj.weight_scale_inv' of shape \(2, 5\)"):
        fp8now.load(variant("shape", wrong, qc), device="cpu")
    e5 = dict(files)
    e5["model.layers.0.mlp.up_proj.weight"] = files["model.layers.0.mlp.up_proj.weight"].float().to(
        torch.float8_e5m2)
    with pytest.raises(ValueError, match="is F8_E5M2; fp8now runs F8_E4M3 only"):
        fp8now.load(variant("e5m2", e5, qc), device="cpu")
