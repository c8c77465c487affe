"""Finite but absurd values (issue 42): 1e30 in a norm weight, the head, an embedding row, a bias, an expert or a
quantized weight is warned about, naming the tensor, at load and at reload (the values are used as they are);
and per-expert checkpoint names whose expert ids exceed the config's expert count are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8now
from fp8now import Fp8Config
from moe_tiny import save_moe
from tiny import save_checkpoint, write_tiny_checkpoint

FP16_MAX = torch.finfo(torch.float16).max   # the warning's threshold: beyond what any fp16 checkpoint holds
PLAIN = ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.bias"]
QUANTIZED = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(folder, tensors, config) of an untied qwen2 (q/k/v biases, a separate lm_head)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("absurd") / "a", "qwen2", seed=2, tie=False)
    return folder, load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def _with(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


def _named(warnings: list[str], key: str) -> list[str]:
    return [w for w in warnings if f"'{key}'" in w]


def _magnitude(warning: str) -> float:
    """The magnitude a warning states (from the weight itself, or from its FP8 scales: 448 x the scale)."""
    return float(warning.split("magnitude ")[1].split(",")[0])


@pytest.mark.parametrize("name", PLAIN)
def test_an_absurd_value_outside_the_quantized_linears_is_warned_about_at_load(tmp_path, qwen2, name):
    _, tensors, config = qwen2
    folder = save_checkpoint({**tensors, name: _with(tensors[name], 1e30)}, config, tmp_path / "bad")
    model, report = fp8now.load(folder, device="cpu")
    found = _named(report.warnings(), name)
    assert len(found) == 1 and "model.safetensors" in found[0] and f"{FP16_MAX:g}" in found[0]
    assert len(report.warnings()) == 1 and f"WARNING: {found[0]}" in report.format_table()
    stored = dict(model.named_parameters())[name].detach()
    assert float(stored.float().abs().max()) == float(torch.tensor(1e30).to(stored.dtype))   # used as it is


def test_values_up_to_fp16s_range_are_not_warned_about(tmp_path, qwen2):
    _, tensors, config = qwen2
    name = "model.norm.weight"
    folder = save_checkpoint({**tensors, name: _with(tensors[name], 6e4)}, config, tmp_path / "big")
    _, report = fp8now.load(folder, device="cpu")
    assert report.warnings() == []


def test_an_absurd_quantized_weight_is_warned_about_without_error_figures(tmp_path, qwen2):
    _, tensors, config = qwen2
    folder = save_checkpoint({**tensors, QUANTIZED: _with(tensors[QUANTIZED], -3e30)}, config, tmp_path / "bad")
    _, report = fp8now.load(folder, device="cpu", measure_error=False)   # no flush figures: the scales tell
    found = _named(report.warnings(), QUANTIZED)
    assert len(report.warnings()) == 1 and len(found) == 1 and _magnitude(found[0]) == pytest.approx(3e30, rel=0.01)


@pytest.mark.parametrize("container", ["dict", "iterator"])
@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.self_attn.k_proj.bias", QUANTIZED])
def test_an_absurd_value_is_warned_about_at_reload(qwen2, name, container):
    folder, tensors, _ = qwen2
    model, _ = fp8now.load(folder, device="cpu")
    new = {**tensors, name: _with(tensors[name], 2e30)}
    with pytest.warns(UserWarning, match=rf"'{name}' holds a value of magnitude"):
        report = fp8now.reload_weights(model, new if container == "dict" else iter(new.items()))
    assert len(report.warnings) == 1 and name in report.warnings[0] and "WARNING" in str(report)
    assert _magnitude(report.warnings[0]) == pytest.approx(2e30, rel=0.01)
    healthy = fp8now.reload_weights(model, tensors)
    assert healthy.warnings == []


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = save_moe("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=1)
    return folder, load_file(folder / "model.safetensors")


def _rewrite(folder, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_an_absurd_expert_weight_is_warned_about(tmp_path, moe):
    import shutil

    src, tensors = moe
    folder = tmp_path / "moe"
    shutil.copytree(src, folder)
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    _rewrite(folder, {**tensors, key: _with(tensors[key], 1e31)})
    _, report = fp8now.load(folder, device="cpu")
    found = [w for w in report.warnings() if "model.layers.1.mlp.experts" in w]
    assert len(report.warnings()) == 1 and len(found) == 1 and _magnitude(found[0]) == pytest.approx(1e31, rel=0.01)


def test_expert_ids_beyond_the_configs_count_are_refused_at_load_and_reload(tmp_path, moe):
    import shutil

    src, tensors = moe
    config = json.loads((src / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    folder = tmp_path / "moe"
    shutil.copytree(src, folder)
    last = f"model.layers.0.mlp.experts.{experts - 1}."
    moved = {k.replace(last, f"model.layers.0.mlp.experts.{experts + 90}."): v for k, v in tensors.items()}
    _rewrite(folder, moved)   # as many experts as the config says, one of them under an id beyond it
    with pytest.raises(ValueError, match=rf"experts\.{experts + 90}\..*is expert {experts + 90}, but .* holds "
                                         rf"{experts} experts"):
        fp8now.load(folder, device="cpu")
    model, _ = fp8now.load(src, Fp8Config(scheme="channel"), device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"reload_weights: .*is expert {experts + 90}, but"):
        fp8now.reload_weights(model, {k: v for k, v in moved.items() if ".layers.0.mlp.experts." in k})
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t   # noqa: E731  (FP8 compared as bytes)
    assert all(torch.equal(raw(p), raw(before[n])) for n, p in model.named_parameters())
