"""Smaller items of issue 30 (item 7): legacy RoPE tables skipped and listed, cache errors that say what
to do, dtype messages that say what the tensor is."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8now import Fp8Config, Fp8Linear

from fp8now.hf import models
from fp8now.loading.load import load
from fp8now.loading.reload import reload_weights
from tiny import save_checkpoint, write_tiny_checkpoint

from test_models import needs_gguf


def _bytes(model) -> dict[str, bytes]:
    return {n: bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_legacy_rotary_inv_freq_tensors_are_skipped_and_listed(tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", "llama")
    tensors = load_file(plain / "model.safetensors")
    legacy = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(16) for i in range(2)}
    folder = save_checkpoint({**tensors, **legacy}, json.loads((plain / "config.json").read_text()),
                             tmp_path / "old")
    model, report = load(folder, Fp8Config(), device="cpu")
    reference, _ = load(plain, Fp8Config(), device="cpu")
    assert _bytes(model) == _bytes(reference)  # the model's own RoPE table, not the stored one
    skipped = dict(report.skipped_tensors)
    assert set(legacy) <= set(skipped) and all("inv_freq" in skipped[k] for k in legacy)
    assert "skipped checkpoint tensor: model.layers.0.self_attn.rotary_emb.inv_freq" in report.format_table()
    result = reload_weights(model, {**tensors, **legacy})
    assert set(legacy) <= set(result.skipped) and result.complete
    assert _bytes(model) == _bytes(reference)


def test_an_unknown_tensor_that_only_looks_legacy_is_still_refused(tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", "llama")
    tensors = load_file(plain / "model.safetensors")
    folder = save_checkpoint({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq_scale": torch.rand(4)},
                             json.loads((plain / "config.json").read_text()), tmp_path / "odd")
    with pytest.raises(ValueError, match="inv_freq_scale.*does not define|does not define.*inv_freq_scale"):
        load(folder, device="cpu")


@needs_gguf
def test_a_cache_folder_that_cannot_be_written_names_fp8now_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FP8NOW_CACHE", str(blocker / "cache"))
    with pytest.raises(OSError) as info:
        models.default_model_dir(progress=False)
    message = str(info.value)
    assert str(blocker / "cache") in message and "FP8NOW_CACHE" in message and "writable folder" in message
    assert not message.startswith("[Errno")


@pytest.mark.parametrize("dtype, says", [
    (torch.int32, "torch.int32: integers"), (torch.int8, "torch.int8: integers"),
    (torch.uint8, "torch.uint8: integers"), (torch.bool, "torch.bool: booleans"),
    (torch.float8_e5m2, "already quantized (torch.float8_e5m2, FP8)"),
])
def test_dtype_messages_say_what_the_tensor_is(dtype, says):
    layer = Fp8Linear(64, 32, False, Fp8Config(), device="meta", name="model.layers.0.q_proj")
    with pytest.raises(ValueError) as info:
        layer.load_(torch.ones(32, 64).to(dtype))
    assert says in str(info.value) and "model.layers.0.q_proj" in str(info.value)
    if dtype != torch.float8_e5m2:
        assert "already quantized" not in str(info.value)


def test_float64_weights_are_accepted_as_the_messages_say():
    w = torch.randn(32, 64, dtype=torch.float64)
    layer = Fp8Linear(64, 32, False, Fp8Config(scheme="tensor"), device="meta", name="l")
    layer.load_(w)
    expected_scale = w.abs().max().float() / 448  # SPEC: tensor scale = amax / 448
    assert torch.allclose(layer.weight_scale, expected_scale, rtol=1e-6)
