"""Fp8Config(weight_numerics="llm-compressor"): fp8now.load, fp8now.save and `fp8now quantize` give the bytes
llm-compressor wrote (tests/fixtures/llmc, made by scripts/llmc_fixtures.py with llm-compressor itself) for
tiny Llama (bf16 and fp16), Qwen3, Qwen3-MoE and Mixtral checkpoints, the embedded SmolLM2, and (by hash)
tiny Qwen2-MoE, OLMoE, DeepSeek-V3 and GPT-OSS checkpoints (issue 40)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fp8now
import llmc_tiny
from fp8now.layers.linear import Fp8Linear
from fp8now.layers.moe import Fp8Experts
from fp8now.loading.expert_files import PARTS, expert_modules, expert_tensors
from test_models import embedded_model_dir, needs_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "llmc"
CASES = [f"{key}-{scheme}" for key in llmc_tiny.MODELS for scheme in ("channel", "block")]
MOE = {"qwen3_moe", "mixtral"}
# What llm-compressor quantizes and fp8now leaves alone: Qwen2-MoE's [1, H] shared-expert gate (a router)
LEFT_ALONE = {"qwen2_moe": {"model.layers.0.mlp.shared_expert_gate.weight"}}
# llm-compressor 0.14 writes Mixtral's experts as gate/up/down_proj; the family's checkpoints (and fp8now) w1/w3/w2
MIXTRAL_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def llmc_name(name: str) -> str:
    """llm-compressor's name of a checkpoint tensor name."""
    if ".block_sparse_moe.experts." in name:
        for ours, theirs in MIXTRAL_NAMES.items():
            name = name.replace(ours, theirs)
    return name


def differing_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoints llm-compressor quantized, rebuilt from their seed (and checked against it)."""
    root = tmp_path_factory.mktemp("llmc-inputs")
    return {key: llmc_tiny.write(key, root) for key in llmc_tiny.MODELS}


def load_case(inputs: dict[str, Path], case: str, numerics: str = "llm-compressor", device: str = "cpu"):
    key, scheme = case.rsplit("-", 1)
    dtype = llmc_tiny.MODELS[key][2]
    config = fp8now.Fp8Config(scheme=scheme, weight_numerics=numerics)
    return fp8now.load(inputs[key], config, device=device, dtype=dtype, measure_error=False)[0]


def fp8_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """llm-compressor's weight name -> (FP8 weight, float32 scale, on-disk scale dtype) of every FP8 layer."""
    out = {}
    for name, m in model.cpu().named_modules():
        if isinstance(m, Fp8Linear):
            out[f"{name}.weight"] = (m.weight, m.weight_scale, m.scale_dtype)
        elif isinstance(m, Fp8Experts):
            try:
                modules = expert_modules(model, name, m.num_experts)
            except ValueError:   # fused on disk (GPT-OSS): llm-compressor's linearized modules' names
                modules = {(e, p): f"{name}.{e}.{p}_proj" for e in range(m.num_experts) for p in PARTS}
            for e in range(m.num_experts):
                for part, (q, s) in expert_tensors(m, e).items():
                    out[llmc_name(f"{modules[e, part]}.weight")] = (q, s, m.scale_dtype)
    return out


def test_inputs_are_those_llm_compressor_quantized(inputs):
    recorded = json.loads((FIXTURES / "inputs.json").read_text())
    assert set(recorded) == set(llmc_tiny.MODELS)
    for key, folder in inputs.items():
        assert llmc_tiny.tensor_hashes(folder) == recorded[key], f"{key}: the seeded inputs changed"


def check_case(inputs, case: str, device: str = "cpu") -> None:
    """fp8now.load on `device` gives llm-compressor's bytes and scales of every FP8 layer of `case`."""
    ref = load_file(str(FIXTURES / case / "model.safetensors"))
    ours = fp8_tensors(load_case(inputs, case, device=device))
    assert set(ours) == {k.removesuffix("_scale") for k in ref if k.endswith(".weight_scale")}
    bad = 0
    for name, (q, s, scale_dtype) in ours.items():
        theirs = ref[f"{name}_scale"]
        assert scale_dtype == theirs.dtype, name
        bad += differing_bytes(q, ref[name], name)
        bad += differing_bytes(s.float(), theirs.float(), f"{name}_scale")   # float32 holds bf16/fp16 exactly
    assert bad == 0
    if case.split("-")[0] in MOE:
        assert any(".experts." in name for name in ours)


@pytest.mark.parametrize("case", CASES)
def test_load_gives_llm_compressor_bytes_and_scales(inputs, case):
    check_case(inputs, case)


@pytest.mark.gpu
def test_gpu_load_gives_the_same_bytes(inputs):
    """On a GPU (where the SPEC's weight quantizer is a Triton kernel) the llm-compressor numerics run the
    same torch ops: the CPU fixtures' bytes, both schemes, dense and MoE; and the Triton variant its hashes."""
    recorded = json.loads((FIXTURES / "triton_path.json").read_text())
    for case in CASES:
        check_case(inputs, case, "cuda")
        ours = fp8_tensors(load_case(inputs, case, "llm-compressor-triton", "cuda"))
        assert {n: f"float8_e4m3fn {list(q.shape)} {sha(q)}" for n, (q, _, _) in ours.items()} == recorded[case]


@pytest.mark.parametrize("case", ["llama-channel", "qwen3_moe-block"])
def test_reload_keeps_the_numerics(inputs, case):
    """reload_weights (RL refit) re-quantizes with the layers' numerics: new weights, then the original ones
    again, give llm-compressor's bytes in the same storage."""
    model = load_case(inputs, case)
    key = case.rsplit("-", 1)[0]
    original = load_file(str(inputs[key] / "model.safetensors"))
    before = {n: q.data_ptr() for n, (q, _, _) in fp8_tensors(model).items()}
    fp8now.reload_weights(model, {k: (2 * v if v.dim() == 2 else v) for k, v in original.items()})
    fp8now.reload_weights(model, original)
    ref = load_file(str(FIXTURES / case / "model.safetensors"))
    ours = fp8_tensors(model)
    assert {n: q.data_ptr() for n, (q, _, _) in ours.items()} == before
    assert sum(differing_bytes(q, ref[n], n) + differing_bytes(s.float(), ref[f"{n}_scale"].float(), n)
               for n, (q, s, _) in ours.items()) == 0


@pytest.mark.parametrize("case", ["llama-block", "qwen3_moe-channel"])
def test_from_pretrained_door_gives_llm_compressor_bytes(inputs, case):
    """transformers' own loader with fp8now.TransformersConfig(weight_numerics=...): the same bytes."""
    from transformers import AutoModelForCausalLM

    key, scheme = case.rsplit("-", 1)
    door = fp8now.TransformersConfig(scheme=scheme, weight_numerics="llm-compressor")
    model = AutoModelForCausalLM.from_pretrained(str(inputs[key]), quantization_config=door, dtype=torch.bfloat16)
    ref = load_file(str(FIXTURES / case / "model.safetensors"))
    ours = fp8_tensors(model)
    assert set(ours) == {k.removesuffix("_scale") for k in ref if k.endswith(".weight_scale")}
    assert all(scale_dtype == torch.bfloat16 for _, _, scale_dtype in ours.values())
    assert sum(differing_bytes(q, ref[n], n) + differing_bytes(s.float(), ref[f"{n}_scale"].float(), n)
               for n, (q, s, _) in ours.items()) == 0


@pytest.mark.parametrize("key", list(llmc_tiny.HASHED))
def test_more_moe_families_give_llm_compressor_hashes(key, tmp_path):
    """Qwen2-MoE (shared expert), OLMoE, DeepSeek-V3 (shared experts), GPT-OSS (biases, interleaved gate/up)."""
    recorded = json.loads((FIXTURES / "moe_families.json").read_text())[key]
    folder = llmc_tiny.write(key, tmp_path)
    assert llmc_tiny.digest(llmc_tiny.tensor_hashes(folder)) == recorded["inputs_sha256"]
    for scheme in ("channel", "block"):
        config = fp8now.Fp8Config(scheme=scheme, weight_numerics="llm-compressor")
        ours = {}
        for name, (q, s, scale_dtype) in fp8_tensors(fp8now.load(folder, config, measure_error=False)[0]).items():
            scale = s.to(scale_dtype)
            ours[name] = f"float8_e4m3fn {list(q.shape)} {sha(q)}"
            ours[f"{name}_scale"] = f"bfloat16 {list(scale.shape)} {sha(scale)}"
        skipped = {n: h for n, h in recorded[scheme].items() if n.removesuffix("_scale") in LEFT_ALONE.get(key, ())}
        assert any(".experts." in n for n in ours)
        assert {**ours, **skipped} == recorded[scheme] and not set(ours) & set(skipped)


@pytest.mark.parametrize("case", ["llama-channel", "qwen3_moe-block"])
def test_default_numerics_differ_from_llm_compressor(inputs, case):
    """The switch matters: the SPEC's float32 rules give other scales and ~3% other FP8 bytes."""
    ref = load_file(str(FIXTURES / case / "model.safetensors"))
    ours = fp8_tensors(load_case(inputs, case, "spec"))
    weights = sum(differing_bytes(q, ref[name], name) for name, (q, _, _) in ours.items())
    total = sum(q.numel() for q, _, _ in ours.values())
    scales = sum(differing_bytes(s.float(), ref[f"{name}_scale"].float(), name) for name, (_, s, _) in ours.items())
    assert 0.005 * total < weights < 0.1 * total and scales > 0


def compare_checkpoints(ours: Path, case: str) -> None:
    """`ours` holds llm-compressor's tensors (names, dtypes, bytes) and an equal quantization_config."""
    ref_dir = FIXTURES / case
    ref = load_file(str(ref_dir / "model.safetensors"))
    got = {llmc_name(k): v for k, v in load_file(str(ours / "model.safetensors")).items()}
    assert sorted(got) == sorted(ref)
    assert sum(differing_bytes(got[k], ref[k], k) for k in ref) == 0
    ours_q = json.loads((ours / "config.json").read_text())["quantization_config"]
    ref_q = json.loads((ref_dir / "config.json").read_text())["quantization_config"]
    ref_q.pop("version")   # the compressed-tensors release that wrote it
    ref_q["ignore"], ours_q["ignore"] = sorted(ref_q["ignore"]), sorted(ours_q["ignore"])
    assert ours_q == ref_q
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(ours_q)   # compressed-tensors reads it as its own
    assert parsed.config_groups["group_0"].weights.observer == "memoryless_minmax"


@pytest.mark.parametrize("case", CASES)
def test_save_writes_what_llm_compressor_writes(inputs, case, tmp_path):
    model = load_case(inputs, case)
    key = case.rsplit("-", 1)[0]
    compare_checkpoints(fp8now.save(model, tmp_path / "out", source=inputs[key]), case)


def test_triton_variant_gives_the_bytes_of_float32_division(inputs):
    """weight_numerics="llm-compressor-triton": llm-compressor's scales, and the FP8 bytes of
    compressed-tensors' own quantize on float32 copies (its Triton kernel's arithmetic, triton_path.json)."""
    recorded = json.loads((FIXTURES / "triton_path.json").read_text())
    assert set(recorded) == set(CASES)
    moved = 0
    for case in CASES:
        ref = load_file(str(FIXTURES / case / "model.safetensors"))
        ours = fp8_tensors(load_case(inputs, case, "llm-compressor-triton"))
        assert {n: f"float8_e4m3fn {list(q.shape)} {sha(q)}" for n, (q, _, _) in ours.items()} == recorded[case]
        assert sum(differing_bytes(s.float(), ref[f"{n}_scale"].float(), n) for n, (_, s, _) in ours.items()) == 0
        moved += sum(differing_bytes(q, ref[n], n) for n, (q, _, _) in ours.items())
    assert moved > 0   # the two llm-compressor paths do differ


def test_quantize_cli_writes_llm_compressor_checkpoint(inputs, tmp_path, capsys):
    """`fp8now quantize --weight-numerics llm-compressor` through main() in this process (cli_here; quantize
    runs as a real subprocess in test_export.py)."""
    from cli_here import fp8now_here

    out = tmp_path / "llama-block"
    proc = fp8now_here(capsys, "quantize", str(inputs["llama"]), "--scheme", "fp8_block", "--weight-numerics",
                       "llm-compressor", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}")
    compare_checkpoints(out, "llama-block")


def test_cli_refuses_an_unknown_or_unfit_numerics(inputs, tmp_path):
    from fp8now.cli.main import main

    with pytest.raises(SystemExit):
        main(["inspect", str(inputs["llama"]), "--weight-numerics", "llmc"])
    assert main(["quantize", str(inputs["llama"]), "--scheme", "tensor", "--weight-numerics", "llm-compressor",
                 "--out", str(tmp_path / "x")]) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@needs_gguf
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_embedded_smollm2_gives_llm_compressor_hashes(scheme):
    recorded = json.loads((FIXTURES / "smollm2.json").read_text())
    path, _ = embedded_model_dir()
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == recorded["input_sha256"], \
        "the embedded model's bf16 conversion changed: rerun scripts/llmc_fixtures.py"
    config = fp8now.Fp8Config(scheme=scheme, weight_numerics="llm-compressor")
    model, report = fp8now.load(path, config, device="cpu", measure_error=False)
    ours = {}
    for name, (q, s, scale_dtype) in fp8_tensors(model).items():
        ours[name] = f"float8_e4m3fn {list(q.shape)} {sha(q)}"
        scale = s.to(scale_dtype)
        ours[f"{name}_scale"] = f"bfloat16 {list(scale.shape)} {sha(scale)}"
    assert len(ours) == 420 and ours == recorded[scheme]
    assert "llm-compressor numerics" in "\n".join(report.summary_lines())
