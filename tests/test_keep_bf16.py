"""fp8now.load with Fp8Config(keep_bf16="auto:F") on tiny real checkpoints: the chosen layers stay in bf16, the
report says why, an explicit ignore wins, and what cannot take the option says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8now
from fp8now import Fp8Config, Fp8Experts, Fp8Linear, load, quantize_
from fp8now.hf.bf16 import load_bf16
from fp8now.sensitivity.select import ranked, select
from fp8now.sensitivity.score import sensitivity

from test_evaluate import save_byte_tokenizer
from test_sensitivity import own_cache, tiny_dir  # noqa: F401  (fixtures)

KEEP = "auto:0.3"


def test_the_chosen_layers_stay_in_bf16_and_the_report_says_why(tiny_dir):
    model, report = load(tiny_dir, Fp8Config(scheme="channel", keep_bf16=KEEP), device="cpu")
    record = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu")   # what the load scored, from the cache
    assert record["cached"] is True
    kept = report.keep_bf16["layers"]
    assert kept and kept == select(record["layers"], 0.3).names
    total = sum(row["bytes"] for row in record["layers"])
    assert report.keep_bf16["total_bytes"] == total and report.keep_bf16["kept_bytes"] <= 0.3 * total
    for row in record["layers"]:
        layer = model.get_submodule(row["name"])
        assert isinstance(layer, Fp8Linear) == (row["name"] not in kept)
        assert isinstance(layer, nn.Linear) == (row["name"] in kept)
    reasons = dict(report.ignored)
    for row in ranked(record["layers"]):
        if row["name"] in kept:
            assert reasons[row["name"]].startswith(f"kept in bf16 by keep_bf16={KEEP!r}: sensitivity rank "
                                                   f"{row['rank']} of 14, score {row['score']:.3e}")
    assert f"keep_bf16={KEEP!r}: {len(kept)} layers kept in bf16" in report.format_table()
    assert report.to_dict()["keep_bf16"]["layers"] == kept
    plain, _ = load(tiny_dir, Fp8Config(scheme="channel", ignore=tuple(kept)), device="cpu")
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_an_explicit_ignore_wins(tiny_dir):
    record = sensitivity(tiny_dir, Fp8Config(scheme="block"), "cpu")
    top = ranked(record["layers"])[0]["name"]
    model, report = load(tiny_dir, Fp8Config(scheme="block", keep_bf16=KEEP, ignore=(top,)), device="cpu")
    assert dict(report.ignored)[top] == f"matches ignore pattern {top!r}"
    assert top not in report.keep_bf16["layers"] and report.keep_bf16["ignored_by_pattern"] == [top]
    assert isinstance(model.get_submodule(top), nn.Linear) and not isinstance(model.get_submodule(top), Fp8Linear)
    unscored = [{**row, "score": -1.0} if row["name"] == top else row for row in record["layers"]]
    assert report.keep_bf16["layers"] == select(unscored, 0.3).names


def test_experts_stored_per_expert_are_not_kept_and_the_report_says_so(tmp_path):
    from moe_tiny import save_moe

    folder = save_moe("qwen3_moe", tmp_path / "moe", spread=1.0)
    save_byte_tokenizer(folder)
    model, report = load(folder, Fp8Config(scheme="channel", keep_bf16="auto:0.9"), device="cpu")
    experts = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(isinstance(model.get_submodule(name), Fp8Experts) for name in experts)
    unkeepable = dict(report.keep_bf16["unkeepable"])
    assert unkeepable and set(unkeepable) <= set(experts)
    assert all("one tensor per expert" in why for why in unkeepable.values())
    assert report.keep_bf16["layers"] and not set(report.keep_bf16["layers"]) & set(experts)


def test_what_cannot_take_keep_bf16_says_so(tiny_dir, tmp_path):
    config = Fp8Config(scheme="channel", keep_bf16="auto:0.05")
    with pytest.raises(ValueError, match="quantize_: keep_bf16='auto:0.05' needs the checkpoint folder"):
        quantize_(load_bf16(tiny_dir, torch.device("cpu")), config)
    with pytest.raises(ValueError, match="keep_bf16='auto:0.05' with tp_plan: .* Fp8Config\\(ignore=...\\)"):
        load(tiny_dir, config, device="cpu", tp_plan="auto")
    model, _ = load(tiny_dir, Fp8Config(scheme="channel"), device="cpu", measure_error=False)
    fp8now.save(model, tmp_path / "fp8", format="compressed-tensors")
    with pytest.raises(ValueError, match="holds an FP8 checkpoint .* keep_bf16='auto:0.05' does not apply"):
        load(tmp_path / "fp8", config, device="cpu")


def test_an_exported_checkpoint_keeps_the_chosen_layers_in_bf16(tiny_dir, tmp_path):
    import json

    from safetensors import safe_open

    from fp8now.export import quantize

    out, report = quantize(tiny_dir, tmp_path / "fp8", Fp8Config(scheme="channel", keep_bf16=KEEP), device="cpu")
    kept = report.keep_bf16["layers"]
    record = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu")
    assert kept and kept == select(record["layers"], 0.3).names
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(kept) <= set(ignore)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for row in record["layers"]:
            weight = f.get_tensor(f"{row['name']}.weight")
            assert (weight.dtype == torch.bfloat16) == (row["name"] in kept)
            assert (f"{row['name']}.weight_scale" in f.keys()) == (row["name"] not in kept)
    model, _ = load(out, device="cpu")
    assert all(type(model.get_submodule(name)) is nn.Linear for name in kept)
