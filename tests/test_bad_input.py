"""Every bad checkpoint gives a clear error naming the file / tensor / layer, and nothing half-written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8now import Fp8Config, quantize_weight
from fp8now.loading.load import load
from tiny import save_checkpoint, write_tiny_checkpoint

LAYER = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict]:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("good") / "llama", "llama")
    return folder, load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def _load(folder: Path):
    return load(folder, Fp8Config(scheme="channel"), device="cpu")


def _fingerprint(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_missing_folder_and_config(tmp_path, good):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        _load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/config\.json not found"):
        _load(tmp_path / "empty")
    folder = tmp_path / "badjson"
    shutil.copytree(good[0], folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"badjson/config\.json cannot be read as JSON"):
        _load(folder)


@pytest.mark.parametrize("model_type,message", [
    ("llamaXYZ", r"config\.json: model_type 'llamaXYZ' is not known"),
    ("vit", r"config\.json: model_type 'vit' .* has no causal-LM class"),
])
def test_unknown_architecture(tmp_path, good, model_type, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(good[0], folder)
    config = {**good[2], "model_type": model_type, "architectures": ["Nope"]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_no_safetensors(tmp_path, good):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(good[0] / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors .*pytorch_model\.bin: convert"):
        _load(folder)


def test_shard_named_in_index_is_missing(tmp_path, good):
    folder = save_checkpoint(good[1], good[2], tmp_path / "ckpt", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names shard\(s\) model-00002-of-00002\.safetensors, missing"):
        _load(folder)


def test_garbage_index(tmp_path, good):
    folder = save_checkpoint(good[1], good[2], tmp_path / "ckpt", shards=2)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not a valid safetensors index"):
        _load(folder)


@pytest.mark.parametrize("shards,victim,keep", [
    (1, "model.safetensors", -100), (3, "model-00003-of-00003.safetensors", -7), (1, "model.safetensors", 5)])
def test_truncated_or_corrupt_file(tmp_path, good, shards, victim, keep):
    folder = save_checkpoint(good[1], good[2], tmp_path / "ckpt", shards=shards)
    path = folder / victim
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match=re.escape(victim) + r".*the file is truncated or corrupt; re-download"):
        _load(folder)


def test_missing_tensor(tmp_path, good):
    tensors = {k: v for k, v in good[1].items() if k != f"{LAYER}.weight"}
    folder = save_checkpoint(tensors, good[2], tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"ckpt: 1 tensor\(s\) missing .*{re.escape(LAYER)}\.weight"):
        _load(folder)


def test_unexpected_tensor(tmp_path, good):
    tensors = {**good[1], f"{LAYER}.weight_scale_inv": torch.ones(3, 2)}
    folder = save_checkpoint(tensors, good[2], tmp_path / "ckpt", shards=2)
    with pytest.raises(ValueError, match=rf"'{re.escape(LAYER)}\.weight_scale_inv' in model-0000\d-of-00002"):
        _load(folder)


def test_wrong_shape(tmp_path, good):
    tensors = {**good[1], f"{LAYER}.weight": good[1][f"{LAYER}.weight"][:, :100].contiguous()}
    folder = save_checkpoint(tensors, good[2], tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{re.escape(LAYER)}\.weight' has shape "
                                         r"\(320, 100\), the model expects \(320, 192\)"):
        _load(folder)
    tensors = {**good[1], "model.norm.weight": torch.ones(7, dtype=torch.bfloat16)}
    folder = save_checkpoint(tensors, good[2], tmp_path / "ckpt2")
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(7,\), the model expects \(192,\)"):
        _load(folder)


@pytest.mark.parametrize("dtype, what", [
    (torch.float8_e4m3fn, r"is already quantized \(torch\.float8_e4m3fn, FP8\).*pre-quantized checkpoint is a different path"),
    (torch.int8, r"has dtype torch\.int8: integers \(packed weights of an integer-quantized checkpoint"),
    (torch.int32, r"has dtype torch\.int32: integers .*use the original unquantized checkpoint"),
])
def test_prequantized_or_integer_weight(tmp_path, good, dtype, what):
    w = good[1][f"{LAYER}.weight"]
    tensors = {**good[1], f"{LAYER}.weight": w.clamp(-100, 100).to(dtype)}
    folder = save_checkpoint(tensors, good[2], tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"model\.safetensors: {re.escape(LAYER)}\.weight {what}"):
        _load(folder)


def test_float64_checkpoint_is_accepted_as_its_messages_say(tmp_path, good):
    tensors = {k: v.double() for k, v in good[1].items()}
    folder = save_checkpoint(tensors, good[2], tmp_path / "f64")
    model, report = _load(folder)
    layer = model.get_submodule(LAYER)
    q, s = quantize_weight(tensors[f"{LAYER}.weight"], "channel")  # from the float64 values themselves
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
    assert model.model.norm.weight.dtype == torch.bfloat16 and len(report.layers) == 14


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weight(tmp_path, good, bad):
    w = good[1][f"{LAYER}.weight"].clone()
    w[7, 9] = bad
    folder = save_checkpoint({**good[1], f"{LAYER}.weight": w}, good[2], tmp_path / "ckpt", shards=2)
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(LAYER)}\.weight'.*layer '{re.escape(LAYER)}'"
                                         r".*NaN or Inf"):
        _load(folder)


def test_tensor_stored_twice(tmp_path, good):
    folder = save_checkpoint(good[1], good[2], tmp_path / "ckpt", shards=2)
    extra = save_checkpoint({"model.norm.weight": good[1]["model.norm.weight"]}, good[2], tmp_path / "x")
    shutil.move(extra / "model.safetensors", folder / "model-00003-of-00002.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["zzz"] = "model-00003-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' appears twice: in .*model-0000\d-of-00002"
                                         r"\.safetensors and in .*model-00003-of-00002\.safetensors"):
        _load(folder)


def test_index_disagrees_with_shards(tmp_path, good):
    folder = save_checkpoint(good[1], good[2], tmp_path / "ckpt", shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, fname = next(iter(index["weight_map"].items()))
    other = next(f for f in set(index["weight_map"].values()) if f != fname)
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"lists '{re.escape(name)}' in {re.escape(other)}, which does not"):
        _load(folder)


def test_bad_dtype_argument(good):
    with pytest.raises(ValueError, match="dtype must be"):
        load(good[0], Fp8Config(), device="cpu", dtype=torch.int8)


def test_failures_write_nothing(tmp_path, good):
    """A failed load leaves the checkpoint as it was; a failed save leaves neither target nor temp dir."""
    w = good[1][f"{LAYER}.weight"].clone()
    w[0, 0] = float("nan")
    folder = save_checkpoint({**good[1], f"{LAYER}.weight": w}, good[2], tmp_path / "ckpt")
    before = _fingerprint(folder)
    with pytest.raises(ValueError):
        _load(folder)
    assert _fingerprint(folder) == before
    shared = torch.zeros(10)
    with pytest.raises(RuntimeError):  # safetensors refuses tensors sharing memory
        save_checkpoint({"a": shared, "b": shared[:5]}, good[2], tmp_path / "never")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileExistsError, match="not an empty folder"):
        save_checkpoint(good[1], good[2], folder)
    assert _fingerprint(folder) == before
