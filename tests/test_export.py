"""fp8now.save / `fp8now quantize` (a real subprocess, and main() in this process for its refusal and the
default model): round trips through both formats, and transformers as an independent reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from cli_here import fp8now_here
from test_models import embedded_model_dir, needs_gguf
from tiny import write_tiny_checkpoint

import fp8now
from fp8now import Fp8Config, Fp8Linear, rel_diff
from fp8now.export import save
from hang import HANG_S

# Every (format, scheme name) pair a format can express; the scheme names fix the activations.
ROUND_TRIPS = [("compressed-tensors", s) for s in ("channel", "block", "tensor", "tensor-tensor")] + \
              [("fp8", "block")]
# Dims that are multiples of 128: transformers' CPU dequantizers of both formats reject partial block tiles.
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """qwen2: q/k/v biases and partial 128x128 tiles (hidden 192, intermediate 320)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "qwen2", "qwen2", seed=3)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    (folder / "generation_config.json").write_text('{"do_sample": false, "eos_token_id": 2}')
    return folder


@pytest.fixture(scope="module")
def aligned_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "aligned", "qwen2", seed=4, **ALIGNED)


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, read with safetensors only."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def fp8_layers(model) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("fmt,scheme", ROUND_TRIPS)
def test_round_trip_keeps_bytes_scales_and_logits(tiny_dir, tmp_path, fmt, scheme):
    model, _ = fp8now.load(tiny_dir, Fp8Config(scheme=scheme), device="cpu")
    out = save(model, tmp_path / "out", fmt, max_shard_bytes=120_000)
    files = file_tensors(out)
    scale_leaf = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv"}[fmt]
    for name, layer in fp8_layers(model).items():       # the files hold the model's exact bytes
        assert same_bytes(files[f"{name}.weight"], layer.weight)
        s = files[f"{name}.{scale_leaf}"]
        assert s.dtype == torch.float32
        assert torch.equal(s.reshape(layer.weight_scale.shape), layer.weight_scale)
        if layer.scheme.value == "tensor":
            assert tuple(s.shape) == (1,)
    again, report = fp8now.load(out, device="cpu")
    assert "pre-quantized" in report.source and len(report.layers) == len(fp8_layers(model))
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(same_bytes(a[k], b[k]) for k in a)
    assert {(m.scheme, m.act_kind) for m in fp8_layers(again).values()} == \
           {(m.scheme, m.act_kind) for m in fp8_layers(model).values()}
    assert torch.equal(logits(model), logits(again))


@pytest.mark.parametrize("scheme", ["channel", "block", "tensor", "tensor-tensor"])
def test_compressed_tensors_config_parses_in_its_own_schema(tiny_dir, tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    model, _ = fp8now.load(tiny_dir, Fp8Config(scheme=scheme), device="cpu")
    out = save(model, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(raw)
    (group,) = parsed.config_groups.values()
    weight, act = Fp8Config(scheme=scheme).scheme.value, Fp8Config(scheme=scheme).act_kind()
    assert group.weights.strategy == weight and group.weights.type == "float" and not group.weights.dynamic
    assert group.input_activations.strategy == act and group.input_activations.dynamic
    assert parsed.ignore == ["lm_head"]


def test_sharded_index_side_files_and_atomic_folder(tiny_dir, tmp_path):
    model, _ = fp8now.load(tiny_dir, device="cpu")
    limit = 100_000
    out = save(model, tmp_path / "out", max_shard_bytes=limit)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = file_tensors(out)
    assert set(index["weight_map"]) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in files.values())
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert not (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]      # no temporary sibling left


def test_a_scheme_the_format_cannot_state_raises_before_writing(tiny_dir, tmp_path):
    model, _ = fp8now.load(tiny_dir, Fp8Config(scheme="channel"), device="cpu")
    with pytest.raises(ValueError, match="format 'fp8' cannot express layer .*channel weights"):
        save(model, tmp_path / "out", "fp8")
    tensor_tensor, _ = fp8now.load(tiny_dir, Fp8Config(scheme="tensor-tensor"), device="cpu")
    with pytest.raises(ValueError, match="per-tensor activations"):
        save(tensor_tensor, tmp_path / "out", "fp8")
    tensor, _ = fp8now.load(tiny_dir, Fp8Config(scheme="tensor"), device="cpu")
    with pytest.raises(ValueError, match="per-tensor files are named differently"):
        save(tensor, tmp_path / "out", "fp8")
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        save(model, tmp_path / "out", "gguf")
    empty = Fp8Linear(192, 64, config=Fp8Config(), device="meta", name="model.layers.0.self_attn.k_proj")
    model.model.layers[0].self_attn.k_proj = empty
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj has no weight yet"):
        save(model, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken already exists"):
        save(model, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("fmt,scheme", ROUND_TRIPS)
def test_transformers_reads_the_export_and_agrees(aligned_dir, tmp_path, fmt, scheme):
    """transformers dequantizes on CPU (bf16 weights, float activations): its logits differ from fp8now's
    only by fp8now's activation quantization (rel_diff ~2e-3 measured); a misread scale gives ~1."""
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model, _ = fp8now.load(aligned_dir, Fp8Config(scheme=scheme), device="cpu")
    out = save(model, tmp_path / "out", fmt)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    ours = logits(model)
    diff = rel_diff(ours, logits(theirs))
    assert diff < 1e-2, diff
    bf16 = AutoModelForCausalLM.from_pretrained(str(aligned_dir), dtype=torch.bfloat16).eval()
    assert rel_diff(ours, logits(bf16)) < 2e-2        # and both stay near the bf16 model


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp8now", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=HANG_S)


def test_cli_quantize_writes_what_load_gives(tiny_dir, tmp_path):
    proc = run_cli("quantize", str(tiny_dir), "--scheme", "fp8_block", "--format", "fp8", "--out",
                   str(tmp_path / "out"), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "(block)" in proc.stdout
    reference, _ = fp8now.load(tiny_dir, Fp8Config(scheme="block"), device="cpu")
    files = file_tensors(tmp_path / "out")
    for name, layer in fp8_layers(reference).items():
        assert same_bytes(files[f"{name}.weight"], layer.weight)
        assert torch.equal(files[f"{name}.weight_scale_inv"], layer.weight_scale)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]


def test_cli_quantize_refuses_before_loading(tiny_dir, tmp_path, capsys):
    from test_cli import one_error_line

    line = one_error_line(fp8now_here(capsys, "quantize", str(tiny_dir), "--format", "fp8", "--out",
                                      str(tmp_path / "o")))
    assert "cannot express the requested scheme: channel" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_gguf
def test_cli_quantize_embedded_model(tmp_path, monkeypatch, capsys):
    """The default model (no MODEL): main() in this process, with the session's converted cache."""
    monkeypatch.setenv("FP8NOW_CACHE", str(embedded_model_dir()[0].parent))
    proc = fp8now_here(capsys, "quantize", "--out", str(tmp_path / "smol"), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "smol"
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    model, report = fp8now.load(out, device="cpu")
    assert len(report.layers) == 210 and all(row.scheme == "channel" for row in report.layers)
