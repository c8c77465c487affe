"""fp8now.load on FP8 MoE checkpoints in the layouts other tools write (per-expert tensors, bf16 or
float32 scales, per-tensor scales that differ between gate and up, static input scales): the experts hold
the files' bytes, never quantized again; broken files are named."""

from __future__ import annotations

import pytest
import torch
from moe_tiny import save_moe
from test_export import file_tensors
from test_export_moe import experts_of, logits
from tiny import save_checkpoint

import fp8now
from fp8now import rel_diff

FP8 = torch.float8_e4m3fn
CT_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"g": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                            "dynamic": True}}}}
FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


def quantized_files(src, scale_leaf: str, per_row: bool, scale_dtype: torch.dtype, input_scale: bool = False):
    """The bf16 files of `src` with every 2-D weight but embeddings, lm_head and routers in FP8: one
    scale per row (flat `[N]`) or per tensor (gate and up apart), amax / 448 in `scale_dtype`."""
    tensors = file_tensors(src)
    for key in [k for k, t in tensors.items() if t.dim() == 2 and k.endswith("proj.weight")
                or ".experts." in k]:
        w = tensors.pop(key).float()
        amax = w.abs().amax(1) if per_row else w.abs().amax().reshape(1)
        scale = (amax / 448).to(scale_dtype)
        spread = scale.float().reshape(-1, 1) if per_row else scale.float()
        tensors[key] = (w / spread).clamp(-448, 448).to(FP8)
        stem = key.removesuffix(".weight")
        tensors[f"{stem}.{scale_leaf}"] = scale
        if input_scale:
            tensors[f"{stem}.input_scale"] = torch.tensor([0.03])
    return tensors


def write(tensors, src, qconfig, folder):
    import json

    config = json.loads((src / "config.json").read_text())
    return save_checkpoint(tensors, {**config, "quantization_config": qconfig}, folder)


def check_experts_hold_the_files(model, files, gate_up_down) -> None:
    """Every expert's w13 / w2 rows are the file's bytes (padding aside)."""
    for name, layer in experts_of(model).items():
        i, h, ip = layer.intermediate_size, layer.hidden_size, layer.i_pad
        for e in range(layer.num_experts):
            gate, up, down = (files[name.replace(".mlp.experts", p.format(e=e)) + ".weight"]
                              for p in gate_up_down)
            assert torch.equal(layer.w13[e, :i, :h].view(torch.uint8), gate.view(torch.uint8))
            assert torch.equal(layer.w13[e, ip:ip + i, :h].view(torch.uint8), up.view(torch.uint8))
            assert torch.equal(layer.w2[e, :h, :i].view(torch.uint8), down.view(torch.uint8))


QWEN = (".mlp.experts.{e}.gate_proj", ".mlp.experts.{e}.up_proj", ".mlp.experts.{e}.down_proj")
MIXTRAL = (".block_sparse_moe.experts.{e}.w1", ".block_sparse_moe.experts.{e}.w3", ".block_sparse_moe.experts.{e}.w2")


def test_channel_experts_with_flat_bf16_scales(tmp_path):
    src = save_moe("qwen3_moe", tmp_path, seed=21, spread=1.0)
    files = quantized_files(src, "weight_scale", True, torch.bfloat16)
    model, report = fp8now.load(write(files, src, CT_CHANNEL, tmp_path / "ct"), device="cpu")
    assert {row.scheme for row in report.experts} == {"channel"} and len(report.experts) == 2
    check_experts_hold_the_files(model, files, QWEN)
    for name, layer in experts_of(model).items():
        gate = files[f"{name}.0.gate_proj.weight_scale"]
        assert torch.equal(layer.w13_scale[0, :layer.intermediate_size, 0], gate.float())   # bf16 -> f32: exact
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    assert rel_diff(logits(model), logits(reference)) < 2e-2        # a misread scale gives ~1


def test_static_per_tensor_experts_whose_gate_and_up_scales_differ(tmp_path):
    """vLLM-style `quant_method: fp8` per-tensor files (Mixtral names): gate and up were scaled apart, so
    the layer keeps their scales per row; same bytes; the input scales are listed as unused."""
    from transformers import AutoModelForCausalLM

    src = save_moe("mixtral", tmp_path, seed=22, spread=1.0)
    files = quantized_files(src, "weight_scale", False, torch.float32, input_scale=True)
    model, report = fp8now.load(write(files, src, FP8_STATIC, tmp_path / "fp8"), device="cpu")
    check_experts_hold_the_files(model, files, MIXTRAL)
    for name, layer in experts_of(model).items():
        stem = name.replace(".mlp.experts", ".block_sparse_moe.experts")
        gate, up = files[f"{stem}.1.w1.weight_scale"], files[f"{stem}.1.w3.weight_scale"]
        assert not torch.equal(gate, up)
        i = layer.intermediate_size
        assert layer.scheme.value == "channel"
        assert torch.equal(layer.w13_scale[1, :i, 0], gate.expand(i))
        assert torch.equal(layer.w13_scale[1, i:, 0], up.expand(i))
    unused = {key for key, why in report.skipped_tensors if "static input scale" in why}
    assert unused == {k for k in files if k.endswith("input_scale")}
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    assert rel_diff(logits(model), logits(reference)) < 2e-2


def test_bad_moe_checkpoints_say_what_is_wrong(tmp_path):
    src = save_moe("qwen3_moe", tmp_path, seed=23)
    files = quantized_files(src, "weight_scale", True, torch.float32)
    expert = "model.layers.1.mlp.experts.3"

    def variant(name, **change):
        tensors = {k: v for k, v in files.items() if change.get(k, True) is not None}
        tensors.update({k: v for k, v in change.items() if v is not None})
        return write(tensors, src, CT_CHANNEL, tmp_path / name)

    with pytest.raises(ValueError, match=rf"{expert}.gate_proj.weight is missing \(expert 3 of "
                                         r"model.layers.1.mlp.experts\)"):
        fp8now.load(variant("no_w", **{f"{expert}.gate_proj.weight": None}), device="cpu")
    with pytest.raises(ValueError, match=rf"'{expert}.up_proj.weight' has no 'weight_scale'"):
        fp8now.load(variant("no_s", **{f"{expert}.up_proj.weight_scale": None}), device="cpu")
    with pytest.raises(ValueError, match=rf"scale '{expert}.down_proj.weight_scale' of shape \(3, 5\) fits no"):
        fp8now.load(variant("shape", **{f"{expert}.down_proj.weight_scale": torch.ones(3, 5)}), device="cpu")
    with pytest.raises(ValueError, match=r"experts of model.layers.1.mlp.experts mix weight schemes "
                                         r"\(channel, tensor\)"):
        fp8now.load(variant("mixed", **{f"{expert}.down_proj.weight_scale": torch.ones(1)}), device="cpu")
    with pytest.raises(ValueError, match=rf"'{expert}.gate_proj.weight' is BF16"):
        fp8now.load(variant("bf16", **{f"{expert}.gate_proj.weight": torch.zeros(128, 128, dtype=torch.bfloat16)}),
                    device="cpu")
    extra = "model.layers.1.mlp.experts.8.down_proj.weight"
    with pytest.raises(ValueError, match=rf"does not define, e.g. '{extra}'"):
        fp8now.load(variant("extra", **{extra: files[f"{expert}.down_proj.weight"].clone()}), device="cpu")
    scale = f"{expert}.gate_proj.weight_scale"
    with pytest.raises(ValueError, match=rf"scale '{scale}' has dtype torch.int32"):
        fp8now.load(variant("int", **{scale: files[scale].to(torch.int32)}), device="cpu")
