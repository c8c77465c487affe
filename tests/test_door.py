"""The from_pretrained door: transformers' own loader with fp8now.TransformersConfig gives fp8now's layers
with the bytes fp8now.load gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_export import fp8_layers, logits, same_bytes
from tiny import write_tiny_checkpoint

import fp8now
from fp8now import Fp8Config


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("door")
    return {family: write_tiny_checkpoint(root / family, family, seed=7) for family in ("qwen2", "gemma")}


@pytest.mark.parametrize("family,scheme", [("qwen2", "channel"), ("qwen2", "block"), ("qwen2", "tensor-tensor"),
                                           ("gemma", "ptpc")])
def test_from_pretrained_gives_the_bytes_of_fp8now_load(tiny_dirs, family, scheme):
    from transformers import AutoModelForCausalLM

    folder = tiny_dirs[family]
    theirs = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16, quantization_config=fp8now.TransformersConfig(scheme=scheme))
    ours, report = fp8now.load(folder, Fp8Config(scheme=scheme), device="cpu")
    assert sorted(fp8_layers(theirs)) == sorted(fp8_layers(ours)) == sorted(report.quantized)
    for name, layer in fp8_layers(theirs).items():
        assert layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
        assert (layer.scheme, layer.act_kind, layer.backend) == \
               (fp8_layers(ours)[name].scheme, fp8_layers(ours)[name].act_kind, fp8_layers(ours)[name].backend)
    a, b = theirs.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    assert all(same_bytes(a[k], b[k]) for k in a)
    assert torch.equal(logits(theirs), logits(ours))


def test_bad_scheme_fails_when_the_config_is_made():
    with pytest.raises(ValueError, match="unknown FP8 scheme 'fp9'"):
        fp8now.TransformersConfig(scheme="fp9")


def test_import_fp8now_stays_light():
    """Registration happens on first use of fp8now.TransformersConfig, not at `import fp8now`."""
    code = ("import sys, fp8now; assert 'transformers' not in sys.modules; "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; assert 'fp8now' not in m; "
            "fp8now.TransformersConfig; assert 'fp8now' in m; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_door_model_saves_with_fp8now_save(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(
        str(tiny_dirs["qwen2"]), dtype=torch.bfloat16, quantization_config=fp8now.TransformersConfig(scheme="block"))
    out = fp8now.save(theirs, tmp_path / "out", "fp8")
    again, _ = fp8now.load(out, device="cpu")
    a, b = theirs.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
