"""The sensitivity pass on tiny real checkpoints: its measurements against models built separately (fp8now.load
and plain transformers), its text against plain greedy decoding, and its cache (hit, and a miss for another checkpoint,
scheme or setting)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file, save_file

from fp8now import Fp8Config, load, quantize_
from fp8now.hf.bf16 import load_bf16
from fp8now.hf.modules import set_submodule
from fp8now.sensitivity.score import sensitivity
from fp8now.sensitivity.text import PROMPTS
from fp8now.hf.tokenizer import load_tokenizer
from tiny import write_tiny_checkpoint

from test_evaluate import save_byte_tokenizer

FAST = dict(prompts=PROMPTS[:3], new_tokens=6)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8NOW_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sens") / "llama", "llama", vocab_size=256)
    save_byte_tokenizer(path)
    return path


def _answer_logprobs(model, ids, mask, new_tokens) -> torch.Tensor:
    """float64 log-probabilities of the positions that predict the generated tokens, from a full forward."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    return torch.log_softmax(logits[:, -new_tokens - 1:-1].double(), -1)


def _kl_tokens(ref: torch.Tensor, other: torch.Tensor) -> np.ndarray:
    return F.kl_div(other, ref, log_target=True, reduction="none").sum(-1).flatten().numpy()


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std() / math.sqrt(len(x) - 1))   # llama.cpp's SE (kl_stats)


class _Times8(nn.Module):
    """The test's own magnified layer: the bf16 output plus 8 times (FP8 output - bf16 output)."""

    def __init__(self, exact: nn.Module, fp8: nn.Module) -> None:
        super().__init__()
        self.exact, self.fp8 = exact, fp8

    def forward(self, *args):
        y = self.exact(*args).float()
        return (y + 8 * (self.fp8(*args).float() - y)).to(torch.bfloat16)


def test_the_measurements_equal_separately_built_models(tiny_dir):
    record = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu", **FAST)
    ids, mask = torch.tensor(record["sample"]["ids"]), torch.tensor(record["sample"]["mask"])
    n = FAST["new_tokens"]
    assert ids.shape[0] == 3 and record["tokens"] == 3 * n
    assert record["forwards"] == "each from the swapped layer's block on (earlier blocks replayed)"
    assert record["magnify"] == 8
    names = [row["name"] for row in record["layers"]]
    assert len(names) == 14 and all(row["kind"] == "linear" for row in record["layers"])
    ref = _answer_logprobs(load_bf16(tiny_dir, torch.device("cpu")), ids, mask, n)
    every, _ = load(tiny_dir, Fp8Config(scheme="channel"), device="cpu", measure_error=False)
    every_kl = _kl_tokens(ref, _answer_logprobs(every, ids, mask, n))
    assert (record["baseline"], record["baseline_se"]) == pytest.approx(_mean_se(every_kl), rel=2e-3)
    for row in record["layers"]:   # every layer: only it in FP8 (from fp8now.load), its error times 8
        alone = load_bf16(tiny_dir, torch.device("cpu"))
        set_submodule(alone, row["name"], _Times8(alone.get_submodule(row["name"]), every.get_submodule(row["name"])))
        alone_kl = _kl_tokens(ref, _answer_logprobs(alone, ids, mask, n)) / 64
        assert row["alone"] > 0
        assert (row["alone"], row["alone_se"]) == pytest.approx(_mean_se(alone_kl), rel=2e-3)
        assert row["bytes"] == 2 * alone.get_submodule(row["name"]).exact.weight.numel()
        assert row["score"] == pytest.approx(row["alone"] * 2**20 / row["bytes"])


def test_the_text_is_the_bf16_models_greedy_answer(tiny_dir):
    record = sensitivity(tiny_dir, Fp8Config(scheme="tensor"), "cpu", **FAST)
    ids, mask = torch.tensor(record["sample"]["ids"]), torch.tensor(record["sample"]["mask"])
    model = load_bf16(tiny_dir, torch.device("cpu"))
    tokenizer = load_tokenizer(tiny_dir)
    n = FAST["new_tokens"]
    for row, row_mask, prompt in zip(ids, mask, FAST["prompts"]):
        real = row[row_mask.bool()]
        assert tokenizer.decode(real[:-n].tolist()) == prompt        # no chat template: the prompt as it is
        with torch.no_grad():
            logits = model(input_ids=real[None], use_cache=False).logits[0, -n - 1:-1].float()
        logits[:, model.config.eos_token_id] = -float("inf")        # the end of text waits for n tokens
        chosen = logits.gather(-1, real[-n:, None])[:, 0]
        assert torch.all(chosen >= logits.max(-1).values - 0.05)    # greedy (up to bf16 batch noise)


def test_the_cache_hits_for_the_same_files_and_misses_when_anything_changes(tiny_dir, tmp_path):
    first = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu", **FAST)
    assert first["cached"] is False and Path(first["cache_file"]).is_file()
    again = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu", **FAST)
    assert again["cached"] is True and again["cache_file"] == first["cache_file"]
    assert again["layers"] == first["layers"] and again["baseline"] == first["baseline"]
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "copy"))   # the same files elsewhere: the same hash
    assert sensitivity(copy, Fp8Config(scheme="ptpc"), "cpu", **FAST)["cached"] is True
    block = sensitivity(tiny_dir, Fp8Config(scheme="block"), "cpu", **FAST)
    assert block["cached"] is False and block["cache_file"] != first["cache_file"]
    longer = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu", prompts=FAST["prompts"], new_tokens=7)
    assert longer["cached"] is False and longer["tokens"] == 21
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 3
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    changed = sensitivity(copy, Fp8Config(scheme="channel"), "cpu", **FAST)
    assert changed["cached"] is False and changed["cache_file"] != first["cache_file"]
    down = {r["name"]: r for r in changed["layers"]}["model.layers.1.mlp.down_proj"]
    assert down["alone"] != {r["name"]: r for r in first["layers"]}["model.layers.1.mlp.down_proj"]["alone"]
    fresh = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu", refresh=True, **FAST)
    assert fresh["cached"] is False and fresh["layers"] == first["layers"]   # the pass is deterministic


def test_moe_experts_are_scored_as_one_layer_each(tmp_path):
    from moe_tiny import save_moe

    folder = save_moe("qwen3_moe", tmp_path / "moe", spread=1.0)
    save_byte_tokenizer(folder)
    record = sensitivity(folder, Fp8Config(scheme="channel"), "cpu", **FAST)
    experts = [row for row in record["layers"] if row["kind"] == "experts"]
    assert [row["name"] for row in experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(row["bytes"] == 2 * 8 * 3 * 128 * 128 and row["alone"] > 0 for row in experts)
    assert record["forwards"] == "each from the swapped layer's block on (earlier blocks replayed)"
    row = experts[1]   # stored one tensor per expert: fp8now.load cannot leave experts in bf16, so the FP8
    every = load_bf16(folder, torch.device("cpu"))    # experts come from quantizing the model in memory
    quantize_(every, Fp8Config(scheme="channel"))
    alone = load_bf16(folder, torch.device("cpu"))
    set_submodule(alone, row["name"], _Times8(alone.get_submodule(row["name"]), every.get_submodule(row["name"])))
    ids, mask = torch.tensor(record["sample"]["ids"]), torch.tensor(record["sample"]["mask"])
    ref = _answer_logprobs(load_bf16(folder, torch.device("cpu")), ids, mask, FAST["new_tokens"])
    alone_kl = _kl_tokens(ref, _answer_logprobs(alone, ids, mask, FAST["new_tokens"])) / 64
    assert (row["alone"], row["alone_se"]) == pytest.approx(_mean_se(alone_kl), rel=2e-3)
