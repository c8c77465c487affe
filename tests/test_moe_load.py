"""fp8now.load streams MoE checkpoints saved by transformers itself (per-expert names or fused tensors)."""

import json

import pytest
import torch
from moe_tiny import MOE_FAMILIES, moe_model, save_moe
from safetensors import safe_open
from safetensors.torch import save_file

import fp8now
from fp8now import Fp8Config, Fp8Experts

# One scheme per family keeps the file fast; every scheme meets every layout across the list.
CASES = [("qwen2_moe", "block"), ("qwen3_moe", "tensor"), ("mixtral", "channel"), ("olmoe", "block"),
         ("deepseek_v3", "channel"), ("gpt_oss", "block"), ("llama4_text", "tensor"), ("mixtral", "block")]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _checkpoint(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family,scheme", CASES)
def test_streaming_load_equals_quantize_byte_for_byte(tmp_path, family, scheme):
    path = save_moe(family, tmp_path, seed=3)
    stored = _checkpoint(path)
    per_expert = any(".experts.0." in k for k in stored)
    assert per_expert == (family not in ("gpt_oss", "llama4_text"))   # the real on-disk layouts
    config = Fp8Config(scheme=scheme)
    loaded, report = fp8now.load(path, config, device="cpu")
    reference = moe_model(family, seed=3)
    fp8now.quantize_(reference, config)
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(_bytes(got[name]), _bytes(want[name].to(got[name].dtype))), name
    experts = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Experts)}
    assert experts and [r.name for r in report.experts] == list(experts)
    for row in report.experts:
        layer = experts[row.name]
        assert (row.num_experts, row.hidden, row.intermediate, row.scheme, row.backend) == (
            layer.num_experts, layer.hidden_size, layer.intermediate_size, scheme, "cpu")
        assert 25 < row.min_sqnr_db <= row.median_sqnr_db
        assert f"experts: {row.name} E={row.num_experts}" in report.format_table()
    # routers bit-equal to the checkpoint, in the precision the model asks for
    for key, t in stored.items():
        if key.endswith(("gate.weight", "router.weight", "router.bias", "e_score_correction_bias")):
            name = key.replace("block_sparse_moe", "mlp")
            param = loaded.get_parameter(name) if "correction" not in key else loaded.get_buffer(name)
            assert torch.equal(param.float(), t.float()), key
            if family == "deepseek_v3":
                assert param.dtype == torch.float32
    ids = torch.randint(3, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_missing_expert_names_the_fused_parameter(tmp_path):
    path = save_moe("qwen3_moe", tmp_path)
    tensors = _checkpoint(path)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj needs 8 tensors "
                                         r"matching .*up_proj.*has 7"):
        fp8now.load(path, Fp8Config(), device="cpu")


def test_wrong_expert_shape_names_the_layer(tmp_path):
    path = save_moe("mixtral", tmp_path)
    tensors = _checkpoint(path)
    tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(128, 96, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts"):
        fp8now.load(path, Fp8Config(), device="cpu")


def test_sharded_checkpoint_with_a_layer_across_shards(tmp_path):
    """Small shards split a layer's experts over several files; the layer waits for all of them."""
    model = moe_model("olmoe", seed=4)
    model.save_pretrained(tmp_path / "olmoe", max_shard_size="100KB")
    weight_map = json.loads((tmp_path / "olmoe" / "model.safetensors.index.json").read_text())["weight_map"]
    layer0 = {f for k, f in weight_map.items() if k.startswith("model.layers.0.mlp.experts.")}
    assert len(layer0) >= 2   # one experts module spread over several shards
    loaded, report = fp8now.load(tmp_path / "olmoe", Fp8Config(scheme="block"), device="cpu")
    fp8now.quantize_(model, Fp8Config(scheme="block"))
    got, want = loaded.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and len(report.files) > 4
    assert all(torch.equal(_bytes(got[n]), _bytes(want[n])) for n in got)


@pytest.mark.parametrize("family,key,expert", [
    ("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight", None),            # per-expert weight
    ("mixtral", "model.layers.0.block_sparse_moe.experts.2.w2.weight", None),      # renamed per-expert
    ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj_bias", 3),                # fused bias
    ("gpt_oss", "model.layers.0.mlp.experts.down_proj", 3)])                       # fused weight
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_expert_weights_and_biases_name_the_checkpoint_tensor(tmp_path, family, key, expert, bad):
    path = save_moe(family, tmp_path)
    tensors = _checkpoint(path)
    t = tensors[key].clone()
    t.view(-1)[t.numel() - 5] = bad   # in the last expert's slice of a fused tensor
    tensors[key] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    where = rf"tensor '{key}'" + ("" if expert is None else rf" \(expert {expert}\)")
    with pytest.raises(ValueError, match=rf"model\.safetensors: {where.replace('.', '[.]')} contains NaN or Inf"):
        fp8now.load(path, Fp8Config(scheme="channel"), device="cpu")


def test_quantize_refuses_a_nonfinite_expert_bias_without_casting_it():
    """In memory (quantize_): the error names the tensor and the expert; nothing is swapped."""
    model = moe_model("gpt_oss")
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj_bias[2, 7] = float("inf")   # interleaved: odd columns are up entries
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.gate_up_proj_bias' \(expert 2\) "
                                         r"contains NaN or Inf.*nothing of this experts module was written"):
        fp8now.quantize_(model, Fp8Config(scheme="block"))
    assert model.model.layers[1].mlp.experts is experts
