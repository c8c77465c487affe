"""Quantize-on-load against quantize_ of the same model in memory, on real tiny transformers models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from fp8now import Fp8Config, Fp8Linear, quantize_weight
from fp8now import load, quantize_
from tiny import FAMILIES, save_checkpoint, tiny_model, unique_state_dict, write_tiny_checkpoint

SCHEMES = ("tensor", "channel", "block")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (single-file dir, 3-shard dir), both holding the same seeded weights."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            model = tiny_model(family)
            root = tmp_path_factory.mktemp(family)
            tensors = unique_state_dict(model)
            cache[family] = (save_checkpoint(tensors, model.config, root / "single"),
                             save_checkpoint(tensors, model.config, root / "sharded", shards=3))
        return cache[family]
    return get


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    """Same names, dtypes and bytes for every parameter and buffer (FP8 compared as raw bytes)."""
    for kind in ("named_parameters", "named_buffers"):
        ta, tb = dict(getattr(a, kind)()), dict(getattr(b, kind)())
        assert ta.keys() == tb.keys(), set(ta) ^ set(tb)
        for name in ta:
            assert ta[name].dtype == tb[name].dtype, name
            assert torch.equal(_raw(ta[name]), _raw(tb[name])), f"{name} differs"


def _no_meta(model: nn.Module) -> None:
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def _expected_targets(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


@pytest.mark.parametrize("family", FAMILIES)
def test_load_matches_quantize_in_memory(checkpoints, family):
    single, sharded = checkpoints(family)
    assert len(list(sharded.glob("*.safetensors"))) == 3 and (sharded / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(single, dtype=torch.bfloat16).eval()
    targets = _expected_targets(reference)
    for scheme in SCHEMES:
        config = Fp8Config(scheme=scheme)
        in_memory = copy.deepcopy(reference)
        report_mem = quantize_(in_memory, config)
        assert report_mem.quantized == targets
        for folder in (single, sharded):
            model, report = load(folder, config, device="cpu")
            assert report.quantized == targets, folder
            assert_same_model(model, in_memory)
            _no_meta(model)
            assert not model.training


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_bf16(checkpoints, family):
    single, _ = checkpoints(family)
    reference = AutoModelForCausalLM.from_pretrained(single, dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(tokens).logits.float()
        for scheme in SCHEMES:
            model, _ = load(single, Fp8Config(scheme=scheme), device="cpu")
            got = model(tokens).logits.float()
            assert torch.isfinite(got).all()
            cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
            assert cos > 0.99, (family, scheme, float(cos))
            # buffers stay real and float32 (RoPE inv_freq), equal to transformers' own
            ref_buffers = dict(reference.named_buffers())
            for name, buf in model.named_buffers():
                assert torch.equal(buf, ref_buffers[name]) and buf.dtype == ref_buffers[name].dtype, name


def test_report_lists_every_layer_and_every_ignored_one(checkpoints):
    single, _ = checkpoints("qwen2")
    model, report = load(single, Fp8Config(scheme="block"), device="cpu")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert report.quantized == list(layers) and len(layers) == 14
    # the head is governed by Fp8Config.head (off by default), no longer by a default ignore pattern
    assert report.ignored == [("lm_head", "outside the transformer blocks (output head; Fp8Config(head=True) "
                                          "quantizes it)")]
    row = report.layers[0]
    assert (row.name, row.scheme, row.backend, row.n, row.k, row.bias) == (
        "model.layers.0.self_attn.q_proj", "block", "cpu", 192, 192, True)
    assert all(r.sqnr_db > 25 and 0 < r.rel_diff < 1e-3 for r in report.layers)
    n_weights = sum(m.weight.numel() for m in layers.values())
    n_scales = sum(m.weight_scale.numel() for m in layers.values())
    assert report.bf16_bytes == 2 * n_weights and report.fp8_bytes == n_weights + 4 * n_scales
    assert report.model_bytes == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert report.load_s > 0 and report.peak_device_bytes is None and report.peak_host_rss_bytes > 2**20
    table = report.format_table()
    assert all(name in table for name in layers) and "lm_head" in table and "peak host RSS" in table
    assert json.loads(json.dumps(report.to_dict()))["layers"][0]["name"] == row.name
    # the in-memory path reports the same rows (error measured against the same float weights)
    reference = AutoModelForCausalLM.from_pretrained(single, dtype=torch.bfloat16)
    assert quantize_(reference, Fp8Config(scheme="block")).layers == report.layers


def test_ignore_patterns_exact_glob_and_regex(checkpoints):
    single, _ = checkpoints("llama")
    ignore = ("lm_head", "model.layers.0.self_attn.q_proj", "*.mlp.down_proj",
              r"re:model\.layers\.1\.self_attn\.[kv]_proj")
    model, report = load(single, Fp8Config(ignore=ignore), device="cpu")
    reasons = {name: why.removeprefix("matches ignore pattern ") for name, why in report.ignored}
    assert reasons == {
        "model.layers.0.self_attn.q_proj": repr(ignore[1]),
        "model.layers.0.mlp.down_proj": repr(ignore[2]),
        "model.layers.1.self_attn.k_proj": repr(ignore[3]),
        "model.layers.1.self_attn.v_proj": repr(ignore[3]),
        "model.layers.1.mlp.down_proj": repr(ignore[2]),
        "lm_head": repr(ignore[0]),
    }
    stored = load_file(single / "model.safetensors")
    for name in reasons:
        module = model.get_submodule(name)
        assert type(module) is nn.Linear and torch.equal(module.weight, stored[f"{name}.weight"])
    assert len(report.layers) == 14 - 5
    # an exact name also covers the modules under it; lm_head is no target unless head=True
    model, report = load(single, Fp8Config(ignore=("model.layers.1",)), device="cpu")
    assert all(r.name.startswith("model.layers.0.") for r in report.layers) and len(report.layers) == 7
    assert dict(report.ignored)["lm_head"].startswith("outside the transformer blocks")


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_tied_embeddings_stay_tied(tmp_path, family):
    folder = write_tiny_checkpoint(tmp_path / "ckpt", family, tie=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model, report = load(folder, Fp8Config(scheme="channel"), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert report.model_bytes == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    # a tied checkpoint that also stores lm_head.weight: read once, the duplicate is reported as skipped
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    both = save_checkpoint(tensors, json.loads((folder / "config.json").read_text()), tmp_path / "both")
    model2, report2 = load(both, Fp8Config(scheme="channel"), device="cpu")
    assert model2.lm_head.weight is model2.model.embed_tokens.weight
    assert report2.skipped_tensors == [("lm_head.weight", "tied to model.embed_tokens.weight, loaded once")]
    assert_same_model(model, model2)


def test_quantizing_nothing_raises(checkpoints):
    single, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="nothing to quantize"):
        load(single, Fp8Config(ignore=("re:.*",)), device="cpu")
    with pytest.raises(ValueError, match="nothing to quantize"):
        quantize_(tiny_model("llama"), Fp8Config(ignore=("lm_head", "model.layers")))


def test_quantize_is_idempotent():
    model = tiny_model("qwen2")
    first = quantize_(model, Fp8Config(scheme="tensor"))
    before = {n: (t.data_ptr(), t.clone()) for n, t in model.named_parameters()}
    second = quantize_(model, Fp8Config(scheme="block"))
    assert second.layers == [] and len(second.ignored) == len(first.layers) + 1
    assert all(why == "already FP8 (not quantized again)" for n, why in second.ignored if n != "lm_head")
    for name, t in model.named_parameters():
        assert t.data_ptr() == before[name][0] and torch.equal(_raw(t), _raw(before[name][1])), name


def test_fp32_checkpoint_quantizes_from_fp32(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", dtype=torch.float32)
    stored = load_file(folder / "model.safetensors")
    model, _ = load(folder, Fp8Config(scheme="channel"), device="cpu", dtype=torch.bfloat16)
    name = "model.layers.1.mlp.gate_proj"
    q, s = quantize_weight(stored[f"{name}.weight"], "channel")
    layer = model.get_submodule(name)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, stored["model.norm.weight"].bfloat16())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_checkpoint_without_model_prefix_and_with_computed_buffers(checkpoints, tmp_path):
    single, _ = checkpoints("mistral")
    tensors = load_file(single / "model.safetensors")
    renamed = {k.removeprefix("model."): v for k, v in tensors.items()}
    renamed["rotary_emb.inv_freq"] = torch.ones(16)  # some old checkpoints store it; the model computes it
    folder = save_checkpoint(renamed, json.loads((single / "config.json").read_text()), tmp_path / "bare")
    model, report = load(folder, Fp8Config(), device="cpu")
    assert report.skipped_tensors == [("rotary_emb.inv_freq", "non-persistent buffer: the model computes it")]
    assert_same_model(model, load(single, Fp8Config(), device="cpu")[0])


def test_biases_stay_in_dtype(checkpoints):
    single, _ = checkpoints("qwen2")
    stored = load_file(single / "model.safetensors")
    model, _ = load(single, Fp8Config(scheme="tensor"), device="cpu", dtype=torch.float16)
    bias = model.model.layers[0].self_attn.k_proj.bias
    assert bias.dtype == torch.float16
    assert torch.equal(bias, stored["model.layers.0.self_attn.k_proj.bias"].half())
    assert model.model.embed_tokens.weight.dtype == torch.float16


def test_moe_targets_shared_experts_not_routers():
    """MoE blocks: shared-expert linears are quantized; router / shared-expert gates are left alone."""
    from transformers import AutoConfig

    from fp8now.hf.meta import parameters_on_meta
    from fp8now.hf.modules import target_linears

    config = AutoConfig.for_model("qwen2_moe", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                  num_experts=4, num_experts_per_tok=2)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    targets, ignored = target_linears(model, Fp8Config())
    assert "model.layers.1.mlp.shared_expert.down_proj" in targets and len(targets) == 2 * 7
    assert not [n for n in targets if n.endswith("gate") or ".mlp.gate." in n]
    assert ("model.layers.0.mlp.shared_expert_gate", "MoE router (gate) layer") in ignored


def test_parameters_the_model_keeps_in_fp32(checkpoints, monkeypatch):
    from transformers import LlamaForCausalLM

    single, _ = checkpoints("llama")
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["norm"], raising=False)
    model, _ = load(single, Fp8Config(), device="cpu")
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, load_file(single / "model.safetensors")["model.norm.weight"].float())


def test_only_the_fp8_layers_are_frozen(tmp_path):
    """The FP8 layers' tensors take no gradient; every other parameter keeps `from_pretrained`'s
    requires_grad (frozen ones made torch copy the tied lm_head weight on every prefill), and a forward
    outside no_grad gives the same logits as one in inference mode."""
    folder = write_tiny_checkpoint(tmp_path / "m", "llama")
    model, _ = load(folder, Fp8Config(), device="cpu")
    plain = dict(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).named_parameters())
    fp8 = {f"{name}.{leaf}" for name, m in model.named_modules() if isinstance(m, Fp8Linear)
           for leaf, _ in m.named_parameters()}
    assert fp8
    for name, p in model.named_parameters():
        want = False if name in fp8 else plain[name].requires_grad
        assert p.requires_grad == want, name
    assert any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    got = model(input_ids=ids).logits
    assert got.requires_grad and torch.equal(got.detach(), want)
