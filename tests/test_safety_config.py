"""Every config field fp8now reads is checked and named before anything is built (issue 42): a config whose sizes
the checkpoint cannot hold fails at once instead of building a skeleton for minutes or failing in the allocator;
negative, zero or mistyped sizes, malformed quantization_config fields and meta tensors given to reload_weights
give one clear error naming the field or tensor, never a raw error from deep inside."""

from __future__ import annotations

import json
import re
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

import fp8now
from fp8now import Fp8Config
from moe_tiny import save_moe
from tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    folder = write_tiny_checkpoint(root / "llama", "llama", seed=6)
    model, _ = fp8now.load(folder, Fp8Config(scheme="block"), device="cpu")
    exported = fp8now.save(model, root / "fp8", format="fp8")
    return folder, exported


def _with_config(src, dst, **fields):
    folder = shutil.copytree(src, dst)
    config = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _returns(fn, *args, seconds: float = 120):
    """fn(*args) in a daemon thread: its result or exception, asserting it did not build for minutes."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(_call(fn, *args)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the load kept building instead of refusing the config"
    return box[0]


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as e:   # handed back to the test
        return e


def test_a_config_with_far_more_layers_than_the_files_fails_before_building(tmp_path, good):
    folder = _with_config(good[0], tmp_path / "layers", num_hidden_layers=10**6)
    error = _returns(fp8now.load, folder, None, "cpu")
    assert isinstance(error, ValueError)
    assert "num_hidden_layers is 1000000" in str(error) and "2 layer numbers (largest 1)" in str(error)
    assert "config.json" in str(error) and "nothing was built" in str(error)


@pytest.mark.parametrize("field, value, span", [
    ("hidden_size", -4, "from 1"), ("vocab_size", -1, "from 1"), ("num_attention_heads", 0, "from 1"),
    ("num_hidden_layers", "2", "from 1"), ("intermediate_size", 1.5, "from 1"), ("head_dim", True, "from 1"),
    ("intermediate_size", 10**12, "from 1 to 2147483647"), ("max_position_embeddings", -7, "at least 1"),
    ("num_key_value_heads", [2, -1], "from 1")])
def test_a_bad_size_field_is_named_before_transformers_sees_it(tmp_path, good, field, value, span):
    folder = _with_config(good[0], tmp_path / "field", **{field: value})
    with pytest.raises(ValueError, match=rf"config\.json: {field} is {re.escape(repr(value))}.*whole number {span}"):
        fp8now.load(folder, device="cpu")


@pytest.mark.parametrize("field, value", [("intermediate_size", 10**6), ("vocab_size", 10**7),
                                          ("num_attention_heads", 4096)])
def test_a_size_larger_than_any_tensor_fails_before_the_skeleton_is_built(tmp_path, good, field, value):
    folder = _with_config(good[0], tmp_path / "big", **{field: value})
    error = _returns(fp8now.load, folder, None, "cpu")
    assert isinstance(error, ValueError), error
    assert f"{field} is {value}, larger than every dimension" in str(error) and "the largest is 512" in str(error)


def test_a_moe_config_with_more_experts_than_its_router_fails_before_building(tmp_path):
    folder = save_moe("qwen3_moe", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    key = "num_experts" if "num_experts" in config else "num_local_experts"
    config[key] = 10**5
    (folder / "config.json").write_text(json.dumps(config))
    error = _returns(fp8now.load, folder, None, "cpu")
    assert isinstance(error, ValueError) and f"{key} is 100000, larger than every dimension" in str(error)


def _qc(folder, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


CT = {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                                       "strategy": "block", "block_structure": [128, 128]},
                                    "input_activations": {"dynamic": True, "strategy": "group", "group_size": 128}}}}


@pytest.mark.parametrize("fmt, path, value, message", [
    ("fp8", ["weight_block_size"], 128, r"weight_block_size is 128 \(int\); it must be a list or null"),
    ("fp8", ["modules_to_not_convert"], "lm_head", r"modules_to_not_convert is 'lm_head' \(str\)"),
    ("fp8", ["weight_block_size"], [128, "128"], r"weight_block_size holds '128'; it must be a list of whole numbers"),
    ("fp8", ["quant_method"], 5, r"quant_method is 5"),
    ("ct", ["config_groups"], ["group_0"], r"config_groups is \['group_0'\] \(list\); it must be an object or null"),
    ("ct", ["config_groups", "group_0"], "Linear", r"config_groups\.group_0 is str; it must be an object"),
    ("ct", ["config_groups", "group_0", "targets"], "Linear", r"config_groups\.group_0\.targets is 'Linear'"),
    ("ct", ["config_groups", "group_0", "weights"], "fp8", r"group_0\.weights is 'fp8' \(str\)"),
    ("ct", ["config_groups", "group_0", "weights", "num_bits"], "8", r"weights\.num_bits is '8' \(str\)"),
    ("ct", ["ignore"], "lm_head", r"ignore is 'lm_head' \(str\)"),
])
def test_a_malformed_quantization_config_field_is_named(tmp_path, good, fmt, path, value, message):
    folder = shutil.copytree(good[1], tmp_path / "qc")

    def edit(qc):
        if fmt == "ct":
            qc.clear()
            qc.update(json.loads(json.dumps(CT)))
        node = qc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    _qc(folder, edit)
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\..*" + message):
        fp8now.load(folder, device="cpu")


@pytest.mark.parametrize("field, value", [("quantization_config", "fp8"), ("quantization_config", ["fp8"]),
                                          ("text_config", ["not", "an", "object"])])
def test_a_quantization_config_or_text_config_that_is_no_object_is_named(tmp_path, good, field, value):
    folder = _with_config(good[1], tmp_path / "qc", **{field: value})
    with pytest.raises(ValueError, match=rf"config\.json: {field}"):
        fp8now.load(folder, device="cpu")


def test_the_unedited_exports_load(tmp_path, good):
    folder = shutil.copytree(good[1], tmp_path / "ct")
    _qc(folder, lambda qc: (qc.clear(), qc.update(CT)))
    for path in (good[1], folder):   # the fields above, as written, are accepted
        model, report = fp8now.load(path, device="cpu")
        assert report.layers and all(row.scheme == "block" for row in report.layers)


@pytest.mark.parametrize("container", ["dict", "iterator"])
def test_meta_tensors_given_to_reload_weights_are_refused_by_name(good, container):
    model, _ = fp8now.load(good[0], device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = load_file(good[0] / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    new = {**tensors, name: torch.empty(tensors[name].shape, dtype=torch.bfloat16, device="meta")}
    with pytest.raises(ValueError, match=rf"reload_weights: '{name}' is on the meta device"):
        fp8now.reload_weights(model, new if container == "dict" else iter(new.items()))
    if container == "dict":   # all-or-nothing; a stream applies whole layers before it and says so
        raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t   # noqa: E731
        assert all(torch.equal(raw(p), raw(before[n])) for n, p in model.named_parameters())
