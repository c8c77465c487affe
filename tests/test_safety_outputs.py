"""What fp8now says is true (issue 42): a refused bias leaves the layer as it was, a pre-quantized load reports its
load time, save_pretrained on a from_pretrained model points to fp8now.save, custom code named under auto_map and
not run is said, and an export that transformers cannot read (block-scaled MoE experts in compressed-tensors)
says so and what reads it."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
from torch import nn

import fp8now
from fp8now import Fp8Config, Fp8Linear
from fp8now.export import quantize
from moe_tiny import save_moe
from tiny import write_tiny_checkpoint


def _state(layer: nn.Module) -> dict[str, bytes]:
    return {n: bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, t in layer.state_dict().items()}


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("bias, what", [
    ("missing", "expects a bias of shape"), ("short", r"bias has shape \(95,\), expected \(96,\)"),
    ("nan", r"'proj\.bias' contains NaN or Inf"), ("inf", r"'proj\.bias' contains NaN or Inf"),
    ("int", r"bias has dtype torch\.int32")])
def test_a_refused_bias_leaves_weight_scale_bias_and_forward_as_they_were(scheme, bias, what):
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(160, 96).to(torch.bfloat16)
    with torch.no_grad():
        for p in linear.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    layer = Fp8Linear.from_linear(linear, Fp8Config(scheme=scheme), name="proj")
    x = torch.randn(5, 160, generator=g).to(torch.bfloat16)
    before, y = _state(layer), layer(x)
    w = torch.randn(96, 160, generator=g).to(torch.bfloat16) * 3   # a new weight that would change every byte
    b = {"missing": None, "short": torch.zeros(95), "int": torch.zeros(96, dtype=torch.int32),
         "nan": torch.zeros(96).index_fill(0, torch.tensor([7]), float("nan")),
         "inf": torch.zeros(96).index_fill(0, torch.tensor([7]), float("-inf"))}[bias]
    with pytest.raises(ValueError, match=what):
        layer.load_(w, b)
    assert _state(layer) == before and torch.equal(layer(x), y)
    layer.load_(w, torch.zeros(96))   # and the same layer still takes a good pair
    assert _state(layer) != before


def test_a_prequantized_load_reports_its_load_time(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "bf16", "llama", seed=1)
    out = fp8now.save(fp8now.load(folder, device="cpu")[0], tmp_path / "fp8")
    start = time.perf_counter()
    _, report = fp8now.load(out, device="cpu")
    wall = time.perf_counter() - start
    assert report.source.endswith("pre-quantized)") and 0.5 * wall <= report.load_s <= wall


def test_save_pretrained_of_a_from_pretrained_model_points_to_fp8now_save(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(tmp_path / "bf16", "qwen2", seed=2)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                 quantization_config=fp8now.TransformersConfig(scheme="channel"))
    with pytest.raises(ValueError, match=r"save_pretrained cannot write fp8now's FP8 layers.*fp8now\.save\(model"):
        model.save_pretrained(tmp_path / "saved")
    assert not list(tmp_path.glob("saved/*.safetensors"))
    assert fp8now.guard(model) is fp8now.guard(model.model)   # the door's model has its reload guard too


def test_custom_code_named_under_auto_map_and_not_run_is_said(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "custom", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_custom.CustomLlama"}}))
    model, report = fp8now.load(folder, device="cpu")
    said = [w for w in report.warnings() if "auto_map" in w]
    assert type(model).__name__ == "LlamaForCausalLM" and len(said) == 1 and len(report.warnings()) == 1
    assert "modeling_custom.CustomLlama" in said[0] and "transformers' own 'llama' class" in said[0]
    assert f"WARNING: {said[0]}" in report.format_table()
    plain = write_tiny_checkpoint(tmp_path / "plain", "llama")
    assert fp8now.load(plain, device="cpu")[1].warnings() == []


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """A Qwen3-MoE whose expert projections span two 128-wide tiles (what transformers fails on)."""
    return save_moe("qwen3_moe", tmp_path_factory.mktemp("wide"), seed=3, moe_intermediate_size=256)


def test_block_moe_experts_in_compressed_tensors_say_what_reads_them(tmp_path, wide_moe):
    from transformers import AutoModelForCausalLM

    out, report = quantize(wide_moe, tmp_path / "ct", Fp8Config(scheme="block"), "compressed-tensors")
    said = [w for w in report.warnings() if "transformers" in w and "cannot read" in w]
    assert len(said) == 1 and "--format fp8" in said[0] and "fp8now.load reads them" in said[0]
    with pytest.raises(RuntimeError, match="conversion"):   # what the warning says, checked on transformers itself
        AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    again, _ = fp8now.load(out, device="cpu")
    assert any(isinstance(m, fp8now.Fp8Experts) for m in again.modules())
    model, _ = fp8now.load(wide_moe, Fp8Config(scheme="block"), device="cpu")
    with pytest.warns(UserWarning, match="block-scaled MoE experts"):
        fp8now.save(model, tmp_path / "again")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the formats transformers reads carry no such warning
        fp8now.save(model, tmp_path / "fp8", format="fp8")
        _, channel = quantize(wide_moe, tmp_path / "channel", Fp8Config(scheme="channel"), "compressed-tensors")
    assert not [w for w in channel.warnings() if "cannot read" in w]
