"""reload_weights on MoE models loaded from save_pretrained checkpoints: per-expert and fused names, in place."""

import pytest
import torch
from moe_tiny import moe_model, save_moe
from safetensors.torch import load_file
from test_moe_hf import assert_each_expert_quantized_alone

import fp8now
from fp8now import Fp8Config, Fp8Experts
from fp8now.loading.reload import reload_weights
from test_reload import changed, snapshot

# (family, scheme): per-expert names (Qwen3-MoE), Mixtral's renamed w1/w3/w2, GPT-OSS's fused
# interleaved weights with biases, Llama4's fused transposed ones.
CASES = [("qwen3_moe", "block"), ("mixtral", "channel"), ("gpt_oss", "tensor"), ("llama4_text", "block")]


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Experts)}


def _loaded(tmp_path, family, scheme, seed=1):
    path = save_moe(family, tmp_path, seed=seed)
    model, _ = fp8now.load(path, Fp8Config(scheme=scheme), device="cpu")
    return model, load_file(path / "model.safetensors")


@pytest.mark.parametrize("family,scheme", CASES)
def test_reloading_the_checkpoint_is_the_identity_in_place(tmp_path, family, scheme):
    model, tensors = _loaded(tmp_path, family, scheme)
    per_expert = any(".experts.0." in k for k in tensors)
    assert per_expert == (family in ("qwen3_moe", "mixtral"))
    before = snapshot(model)
    report = reload_weights(model, tensors)
    assert report.complete and set(_experts(model)) <= set(report.updated_layers)
    assert changed(model, before) == set()   # same bytes, same Parameter objects, same data_ptr


@pytest.mark.parametrize("family,scheme", CASES)
def test_new_expert_weights_by_fused_names_are_each_experts_own_quantization(tmp_path, family, scheme):
    """transformers' fused names (a state_dict of another model), as a streaming iterable."""
    model, _ = _loaded(tmp_path, family, scheme)
    before = snapshot(model)
    other = moe_model(family, seed=7)
    fused = {k: v for k, v in other.state_dict().items() if ".experts." in k}
    assert fused and all(".experts.0." not in k for k in fused)
    report = reload_weights(model, iter(fused.items()))
    assert report.complete and sorted(report.updated_layers) == sorted(_experts(model))
    moved = changed(model, before)
    for name, layer in _experts(model).items():
        assert {f"{name}.w13", f"{name}.w2"} <= moved
        module = other.get_submodule(name)
        assert_each_expert_quantized_alone(family, module, layer, scheme)
        if family == "gpt_oss":   # biases de-interleaved like the weights: gate entries, then up
            b = module.gate_up_proj_bias.detach()
            assert torch.equal(layer.w13_bias, torch.cat([b[:, 0::2], b[:, 1::2]], dim=1).to(layer.w13_bias.dtype))
            assert torch.equal(layer.w2_bias, module.down_proj_bias.detach().to(layer.w2_bias.dtype))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_names_give_the_bytes_of_a_fresh_load(tmp_path, family):
    model, _ = _loaded(tmp_path / "a", family, "block", seed=1)
    fresh, other = _loaded(tmp_path / "b", family, "block", seed=2)
    names = [k for k in other if ".experts." in k]
    assert any(".w1." in k for k in names) == (family == "mixtral")
    before = snapshot(model)
    report = reload_weights(model, {k: other[k] for k in reversed(names)})   # any order
    assert report.complete and sorted(report.updated_layers) == sorted(_experts(model))
    want = dict(fresh.named_parameters())
    moved = changed(model, before)
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert torch.equal(p.view(torch.uint8) if p.element_size() == 1 else p,
                               want[name].view(torch.uint8) if p.element_size() == 1 else want[name]), name
            assert name in moved
        else:
            assert name not in moved


def test_a_partial_expert_set_is_not_processed_and_the_report_says_so(tmp_path):
    model, _ = _loaded(tmp_path / "a", "mixtral", "channel", seed=1)
    _, other = _loaded(tmp_path / "b", "mixtral", "channel", seed=2)
    layer0 = {k: v for k, v in other.items() if k.startswith("model.layers.0.block_sparse_moe.experts.")}
    layer1 = {k: v for k, v in other.items() if k.startswith("model.layers.1.block_sparse_moe.experts.")}
    del layer0["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    before = snapshot(model)
    report = reload_weights(model, {**layer0, **layer1})
    assert report.updated_layers == ["model.layers.1.mlp.experts"] and not report.complete
    assert report.partial == [("model.layers.0.mlp.experts",
                               ["model.layers.0.mlp.experts.gate_up_proj: experts 2 of '.experts.*.w3.weight'"])]
    assert "NOT updated (partial): model.layers.0.mlp.experts" in str(report)
    assert {n for n in changed(model, before)} == {f"model.layers.1.mlp.experts.{leaf}" for leaf in
                                                   ("w13", "w2", "w13_scale", "w2_scale")}
    only_down = {k: v for k, v in layer0.items() if ".w2." in k}   # a whole param, but not the module
    report = reload_weights(model, only_down)
    assert report.partial == [("model.layers.0.mlp.experts", ["model.layers.0.mlp.experts.gate_up_proj"])]


def test_bad_expert_tensors_are_refused_before_anything_is_written(tmp_path):
    model, tensors = _loaded(tmp_path, "qwen3_moe", "channel")
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    before = snapshot(model)
    nan = {**experts, "model.layers.1.mlp.experts.6.gate_proj.weight":
           experts["model.layers.1.mlp.experts.6.gate_proj.weight"] * float("nan")}
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.6\.gate_proj\.weight'.*NaN or Inf.*"
                                         "nothing of this call was applied"):
        reload_weights(model, nan)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.6\.gate_proj\.weight'.*NaN or Inf"):
        reload_weights(model, iter(nan.items()))   # streaming: layer 0 is applied, layer 1 not at all
    assert changed(model, before) == set()         # layer 0 got its own bytes again
    wrong = {**experts, "model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*nothing of this call"):
        reload_weights(model, wrong)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.w13' is not a tensor of this model"):
        reload_weights(model, {"model.layers.0.mlp.experts.w13": model.model.layers[0].mlp.experts.w13.float()})
    with pytest.raises(ValueError, match="already quantized"):
        reload_weights(model, {"model.layers.0.mlp.experts.gate_up_proj":
                               torch.zeros(8, 256, 128, dtype=torch.float8_e4m3fn)})
    assert changed(model, before) == set()
