"""Bad values (issue 30 items 2-4): NaN/Inf anywhere refused at load and reload, reloads that write all or
nothing, and an outlier weight that flushes its scale group to zero flagged in the report."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8now import Fp8Config
from fp8now.loading.load import load
from fp8now.loading.reload import reload_weights
from tiny import save_checkpoint, write_tiny_checkpoint

Q0, Q1 = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"
NON_QUANTIZED = ["model.norm.weight", f"{Q0}.bias", "lm_head.weight", "model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(folder, tensors, config) of an untied qwen2 (q/k/v biases, a separate lm_head), and other tensors."""
    root = tmp_path_factory.mktemp("values")
    folder = write_tiny_checkpoint(root / "a", "qwen2", seed=0, tie=False)
    other = load_file(write_tiny_checkpoint(root / "b", "qwen2", seed=1, tie=False) / "model.safetensors")
    return folder, load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text()), other


def _state(model) -> dict[str, bytes]:
    return {n: bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _poison(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 3] = value
    return t


@pytest.mark.parametrize("name", NON_QUANTIZED)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_tensor_that_is_not_quantized_is_refused_at_load(tmp_path, qwen2, name, value):
    folder, tensors, config, _ = qwen2
    bad = save_checkpoint({**tensors, name: _poison(tensors[name], value)}, config, tmp_path / "bad")
    with pytest.raises(ValueError) as info:
        load(bad, device="cpu")
    message = str(info.value)
    assert f"'{name}'" in message and "model.safetensors" in message and "NaN or Inf" in message


@pytest.mark.parametrize("name", NON_QUANTIZED)
@pytest.mark.parametrize("container", ["dict", "iterator"])
def test_nonfinite_tensor_that_is_not_quantized_is_refused_at_reload(qwen2, name, container):
    folder, tensors, _, other = qwen2
    model, _ = load(folder, device="cpu")
    before = _state(model)
    new = {**other, name: _poison(other[name], float("nan"))}
    if container == "iterator":  # the poisoned tensor first: nothing may be written before it
        new = iter([(name, new[name]), *((k, v) for k, v in new.items() if k != name)])
    with pytest.raises(ValueError, match=rf"'{name}' contains NaN or Inf.*nothing of this call was applied"):
        reload_weights(model, new)
    assert _state(model) == before


@pytest.mark.parametrize("container", ["dict", "list"])
def test_a_refit_with_nan_in_its_second_layer_changes_no_byte(qwen2, container):
    folder, _, _, other = qwen2
    model, _ = load(folder, device="cpu")
    before = _state(model)
    first = {k: v for k, v in other.items() if k.startswith(Q0)}
    second = {k: v for k, v in other.items() if k.startswith(Q1)}
    second[f"{Q1}.weight"] = _poison(second[f"{Q1}.weight"], float("nan"))
    new = {**first, **second}
    with pytest.raises(ValueError, match=rf"'{Q1}\.weight' contains NaN or Inf.*nothing of this call"):
        reload_weights(model, new if container == "dict" else list(new.items()))
    assert _state(model) == before


def test_an_iterator_refit_applies_whole_layers_and_says_which(qwen2):
    folder, _, _, other = qwen2
    model, _ = load(folder, device="cpu")
    fresh, _ = load(folder, device="cpu")
    first = [(k, v) for k, v in other.items() if k.startswith(Q0)]
    bias = f"{Q1}.bias"
    second = [(f"{Q1}.weight", other[f"{Q1}.weight"]), (bias, _poison(other[bias], float("inf")))]
    with pytest.raises(ValueError) as info:
        reload_weights(model, iter([*first, ("model.norm.weight", other["model.norm.weight"]), *second]))
    assert str(info.value).endswith(f"already applied by this call: FP8 layers {Q0}; tensors model.norm.weight")
    reload_weights(fresh, dict([*first, ("model.norm.weight", other["model.norm.weight"])]))
    assert _state(model) == _state(fresh)  # exactly the first layer and the norm; q_proj 1 untouched


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_an_outlier_that_flushes_its_group_is_flagged(tmp_path, qwen2, scheme):
    folder, tensors, config, _ = qwen2
    name = "model.layers.1.mlp.down_proj"
    w = tensors[f"{name}.weight"].clone()                 # [192, 320], no zeros
    assert bool((w != 0).all())
    r, c = 130, 7
    w[r, c] = 1e30
    bad = save_checkpoint({**tensors, f"{name}.weight": w}, config, tmp_path / "outlier")
    model, report = load(bad, Fp8Config(scheme=scheme), device="cpu")
    n, k = w.shape
    group = {"tensor": n * k, "channel": k,                # the weights sharing the outlier's scale
             "block": (min(n, 256) - 128) * 128}[scheme]  # tile (1, 0): rows 128-191, columns 0-127
    out = report.to_dict()
    row = next(x for x in out["layers"] if x["name"] == name)
    assert row["zero_flushed"] == pytest.approx((group - 1) / (n * k), rel=1e-9)
    assert row["worst_group_flushed"] == pytest.approx((group - 1) / group, rel=1e-9)
    assert row["sqnr_db"] is not None and 100 < row["sqnr_db"] < 1e4 and 0 <= row["rel_diff"] < 1e-6
    assert len(out["warnings"]) == 1 and name in out["warnings"][0]
    assert all(x["zero_flushed"] < 1e-3 for x in out["layers"] if x["name"] != name)
    assert f"WARNING: layer {name}:" in report.format_table()
    q = model.get_submodule(name).weight.float()
    assert float(q[r, c]) != 0 and int((q == 0).sum()) == group - 1


def test_healthy_checkpoint_has_no_warnings(qwen2):
    folder, *_ = qwen2
    for scheme in ("tensor", "channel", "block"):
        _, report = load(folder, Fp8Config(scheme=scheme), device="cpu")
        assert report.to_dict()["warnings"] == [] and "WARNING" not in report.format_table()
