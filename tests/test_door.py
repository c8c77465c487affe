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
from hang import HANG_S


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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_door_model_saves_with_fp8now_save(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(
        str(tiny_dirs["qwen2"]), dtype=torch.bfloat16, quantization_config=fp8now.TransformersConfig(scheme="block"))
    out = fp8now.save(theirs, tmp_path / "out", "fp8")
    again, _ = fp8now.load(out, device="cpu")
    a, b = theirs.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family,scheme", [("qwen3_moe", "channel"), ("mixtral", "block"), ("gpt_oss", "tensor"),
                                           ("llama4_text", "block")])
def test_from_pretrained_quantizes_moe_experts_as_fp8now_load(tmp_path, family, scheme):
    """Every layout of experts (per-expert files merged by transformers, fused, transposed, interleaved with
    biases) arrives through transformers' loader and is quantized into Fp8Experts with fp8now.load's bytes.
    transformers keeps GPT-OSS's norms in bf16 where fp8now.load keeps them float32: values compared."""
    from moe_tiny import save_moe
    from transformers import AutoModelForCausalLM

    from fp8now import Fp8Experts

    folder = save_moe(family, tmp_path, seed=8)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16, quantization_config=fp8now.TransformersConfig(scheme=scheme))
    ours, report = fp8now.load(folder, Fp8Config(scheme=scheme), device="cpu")
    experts = {n: m for n, m in theirs.named_modules() if isinstance(m, Fp8Experts)}
    assert sorted(experts) == [row.name for row in report.experts] and len(experts) == 2
    assert all(m.is_loaded and not hasattr(m, "gate_up_proj") for m in experts.values())
    a, b = theirs.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype == torch.float8_e4m3fn or a[key].dtype == b[key].dtype:
            assert same_bytes(a[key], b[key]), key
        else:
            assert torch.equal(a[key].float(), b[key].float()), key
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


def test_a_door_moe_model_saves_with_fp8now_save(tmp_path):
    from moe_tiny import save_moe
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(save_moe("mixtral", tmp_path, seed=9)), dtype=torch.bfloat16,
                                                  quantization_config=fp8now.TransformersConfig(scheme="block"))
    again, _ = fp8now.load(fp8now.save(theirs, tmp_path / "out", "fp8"), device="cpu")
    a, b = theirs.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
