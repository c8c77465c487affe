"""reload_weights (SPEC §7): in-place re-quantization with stable Parameter objects and pointers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp8now import Fp8Config, Fp8Linear, quantize_weight
from fp8now.loading.load import load
from fp8now.loading.reload import reload_weights
from tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(checkpoint dir, its tensors, checkpoint of other weights, its tensors); qwen2 has q/k/v biases."""
    root = tmp_path_factory.mktemp("reload")
    a = write_tiny_checkpoint(root / "a", "qwen2", seed=0)
    b = write_tiny_checkpoint(root / "b", "qwen2", seed=1)
    return a, load_file(a / "model.safetensors"), b, load_file(b / "model.safetensors")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def snapshot(model) -> dict[str, tuple[int, int, torch.Tensor]]:
    """name -> (Parameter object id, data_ptr, copy of the bytes)."""
    return {n: (id(p), p.data_ptr(), _raw(p).clone()) for n, p in model.named_parameters()}


def changed(model, before) -> set[str]:
    """Names whose bytes changed; asserts no Parameter object or pointer changed."""
    out = set()
    for name, p in model.named_parameters():
        obj, ptr, data = before[name]
        assert id(p) == obj and p.data_ptr() == ptr, f"{name} was reallocated"
        if not torch.equal(_raw(p), data):
            out.add(name)
    return out


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_reloading_the_original_weights_is_the_identity(qwen2, scheme):
    folder, tensors, _, _ = qwen2
    model, report = load(folder, Fp8Config(scheme=scheme), device="cpu")
    before = snapshot(model)
    result = reload_weights(model, tensors)
    assert result.complete and sorted(result.updated_layers) == sorted(report.quantized)
    assert len(result.copied) == len(tensors) - 2 * (7 + 3)  # per layer: 7 FP8 weights + 3 biases
    assert changed(model, before) == set()


def test_other_weights_give_the_bytes_of_a_fresh_load(qwen2):
    folder, _, other_folder, other = qwen2
    model, _ = load(folder, Fp8Config(scheme="block"), device="cpu")
    before = snapshot(model)
    reload_weights(model, ((k, v) for k, v in other.items()))  # a streaming iterable
    fresh, _ = load(other_folder, Fp8Config(scheme="block"), device="cpu")
    fresh_params = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(_raw(p), _raw(fresh_params[name])), name
    assert changed(model, before) == set(before)  # everything moved to the new values, in place


def test_a_new_weight_changes_exactly_that_layer(qwen2):
    folder, tensors, _, _ = qwen2
    model, _ = load(folder, Fp8Config(scheme="channel"), device="cpu")
    before = snapshot(model)
    name = "model.layers.1.mlp.up_proj"
    new = tensors[f"{name}.weight"] * torch.linspace(0.5, 3.0, 320).to(torch.bfloat16)[:, None]
    report = reload_weights(model, {f"{name}.weight": new})
    assert report.updated_layers == [name] and report.copied == [] and report.complete
    assert changed(model, before) == {f"{name}.weight", f"{name}.weight_scale"}
    q, s = quantize_weight(new, "channel")
    layer = model.get_submodule(name)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)


def test_a_layer_missing_its_bias_is_reported_and_not_processed(qwen2):
    folder, tensors, _, other = qwen2
    model, _ = load(folder, Fp8Config(scheme="tensor"), device="cpu")
    before = snapshot(model)
    q_proj, o_proj = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    k_bias = "model.layers.1.self_attn.k_proj.bias"
    report = reload_weights(model, {f"{q_proj}.weight": other[f"{q_proj}.weight"],
                                    f"{o_proj}.weight": other[f"{o_proj}.weight"], k_bias: other[k_bias]})
    assert report.updated_layers == [o_proj]
    assert report.partial == [(q_proj, [f"{q_proj}.bias"]),
                              ("model.layers.1.self_attn.k_proj", ["model.layers.1.self_attn.k_proj.weight"])]
    assert not report.complete and "NOT updated (partial)" in str(report)
    assert changed(model, before) == {f"{o_proj}.weight", f"{o_proj}.weight_scale"}


def test_plain_parameters_are_copied_in_place_and_ties_follow(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tied", "llama", tie=True)
    model, _ = load(folder, Fp8Config(), device="cpu")
    before = snapshot(model)
    new = torch.randn(512, 192).to(torch.bfloat16)
    report = reload_weights(model, {"model.embed_tokens.weight": new, "norm.weight": torch.ones(192)})
    assert report.copied == ["model.embed_tokens.weight", "model.norm.weight"]  # prefix-less names resolve
    assert changed(model, before) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert torch.equal(model.lm_head.weight, new) and model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)


def test_unknown_names_and_bad_tensors_raise_before_writing_anything(qwen2):
    folder, tensors, _, other = qwen2
    model, _ = load(folder, Fp8Config(), device="cpu")
    before = snapshot(model)
    good = {"model.layers.0.mlp.up_proj.weight": other["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.nope\.weight' is not a tensor of this model"):
        reload_weights(model, {**good, "model.layers.0.mlp.nope.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(3, 4\)"):
        reload_weights(model, [*good.items(), ("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 4))])
    with pytest.raises(ValueError, match="already quantized"):
        reload_weights(model, {**good, "model.layers.1.mlp.up_proj.weight":
                               tensors["model.layers.1.mlp.up_proj.weight"].to(torch.float8_e4m3fn)})
    nan = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    nan[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*NaN"):
        reload_weights(model, {"model.layers.1.mlp.down_proj.weight": nan})
    assert changed(model, before) == set()
