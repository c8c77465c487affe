"""MoE experts through fp8now.save and back through fp8now.load: per-expert files under the family's
checkpoint names, bytes and scales kept, transformers as an independent reader, bad files named."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fp8_oracle import quantize_loops
from moe_tiny import save_moe
from test_export import file_tensors, same_bytes

import fp8now
from fp8now import Fp8Config, Fp8Experts, rel_diff
from fp8now.export import save

# (family, format, scheme, moe_scheme): every pair a format can state for experts, dense and experts apart,
# Mixtral's names and its partial 128-row tiles (I = 192).
ROUND_TRIPS = [("qwen3_moe", "compressed-tensors", "channel", None), ("qwen3_moe", "compressed-tensors", "block", None),
               ("qwen3_moe", "fp8", "block", None), ("qwen3_moe", "compressed-tensors", "channel", "tensor"),
               ("mixtral", "compressed-tensors", "tensor", None), ("mixtral", "fp8", "block", None)]
# The checkpoint names of (gate, up, down) per family, as the families' own bf16 files spell them.
EXPERT_NAMES = {"qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
                "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                            "block_sparse_moe.experts.{e}.w2")}
ROUTER = {"qwen3_moe": "mlp.gate", "mixtral": "block_sparse_moe.gate"}
SCALE_LEAF = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv"}
# Oracle rules (fp8_oracle) and group shapes per scheme, from SPEC §4.
ORACLE = {"channel": ("row", 1, -1), "block": ("block", 128, 128), "tensor": ("tensor", -1, -1)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_src")
    return {family: save_moe(family, root, seed=11) for family in EXPERT_NAMES}


def logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def experts_of(model) -> dict[str, Fp8Experts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Experts)}


def load(folder, scheme: str, moe_scheme: str | None = None):
    return fp8now.load(folder, Fp8Config(scheme=scheme, moe_scheme=moe_scheme), device="cpu")[0]


@pytest.mark.parametrize("family,fmt,scheme,moe_scheme", ROUND_TRIPS)
def test_moe_round_trip_keeps_bytes_scales_and_logits(sources, tmp_path, family, fmt, scheme, moe_scheme):
    model = load(sources[family], scheme, moe_scheme)
    out = save(model, tmp_path / "out", fmt, max_shard_bytes=150_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    again, report = fp8now.load(out, device="cpu")
    assert "pre-quantized" in report.source
    assert [row.name for row in report.experts] == sorted(experts_of(model))
    assert {row.scheme for row in report.experts} == {moe_scheme or scheme}
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(same_bytes(a[k], b[k]) for k in a)
    for name, layer in experts_of(again).items():
        assert (layer.scheme, layer.act_kind) == (experts_of(model)[name].scheme, experts_of(model)[name].act_kind)
    assert torch.equal(logits(model), logits(again))


@pytest.mark.parametrize("family", sorted(EXPERT_NAMES))
@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
                                        ("fp8", "block")])
def test_expert_files_have_the_family_names_and_the_oracle_bytes(sources, tmp_path, family, fmt, scheme):
    """Names as the bf16 checkpoint spells them; each expert's bytes and scale as the oracle quantizes the
    bf16 tensors of that checkpoint (tensor: one scale over gate and up, as the fused w13 has)."""
    model = load(sources[family], scheme)
    out = save(model, tmp_path / "out", fmt)
    files, bf16 = file_tensors(out), file_tensors(sources[family])
    assert {k for k in files if ".weight_scale" not in k} == set(bf16)    # save_pretrained's own names
    config = model.config
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = [f"model.layers.{n}.{ROUTER[family]}" for n in range(config.num_hidden_layers)]
    assert all(f"{r}.weight" in bf16 for r in routers)
    assert qc["ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"] == ["lm_head", *routers]
    num = config.num_experts if family == "qwen3_moe" else config.num_local_experts
    rule, gr, gc = ORACLE[scheme]
    for layer in range(config.num_hidden_layers):
        for e in range(num):
            gate, up, down = (f"model.layers.{layer}.{p.format(e=e)}" for p in EXPERT_NAMES[family])
            w = {m: bf16[f"{m}.weight"] for m in (gate, up, down)}
            if scheme == "tensor":
                q13, s13 = quantize_loops(torch.cat([w[gate], w[up]]), gr, gc, rule)
                want = {gate: (q13[:len(w[gate])], s13), up: (q13[len(w[gate]):], s13)}
            else:
                want = {m: quantize_loops(w[m], gr, gc, rule) for m in (gate, up)}
            want[down] = quantize_loops(w[down], gr, gc, rule)
            for m, (q, s) in want.items():
                rows, cols = w[m].shape
                scale = files[f"{m}.{SCALE_LEAF[fmt]}"]
                shape = {"channel": (rows, 1), "block": (math.ceil(rows / 128), math.ceil(cols / 128)),
                         "tensor": (1,)}[scheme]
                assert scale.dtype == torch.float32 and tuple(scale.shape) == shape, m
                assert torch.equal(scale.reshape(-1), s.reshape(-1)), m
                assert files[f"{m}.weight"].dtype == torch.float8_e4m3fn
                assert torch.equal(files[f"{m}.weight"].double(), q), m


@pytest.mark.parametrize("family", sorted(EXPERT_NAMES))
@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
                                        ("fp8", "block")])
def test_transformers_reads_the_moe_export_and_agrees(tmp_path, family, fmt, scheme):
    """transformers dequantizes the experts on CPU; its logits differ from fp8now's only by fp8now's
    activation quantization (rel_diff ~5e-4 measured), a misread expert scale gives ~1. Expert dims are
    multiples of 128: transformers' CPU block dequantizer rejects partial tiles."""
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    size = {"moe_intermediate_size": 256} if family == "qwen3_moe" else {"intermediate_size": 256}
    src = save_moe(family, tmp_path, seed=12, spread=1.0, **size)
    model = load(src, scheme)
    out = save(model, tmp_path / "out", fmt)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    ours = logits(model)
    assert rel_diff(ours, logits(theirs)) < 1e-2
    bf16 = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    assert rel_diff(ours, logits(bf16)) < 2e-2


def test_experts_that_no_format_lays_out_are_refused_before_writing(tmp_path):
    """GPT-OSS keeps its experts fused (and biased) on disk: refused before any file is written; kept in
    bf16 they are written as the model holds them and load back."""
    src = save_moe("gpt_oss", tmp_path, seed=13)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(gpt_oss\): transformers stores these "
                                         r"experts fused on disk"):
        save(load(src, "channel"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt_oss"]
    kept = fp8now.load(src, Fp8Config(ignore=["lm_head", "re:.*experts"]), device="cpu")[0]
    again, report = fp8now.load(save(kept, tmp_path / "out"), device="cpu")
    assert not experts_of(again) and ("model.layers.0.mlp.experts", "left in high precision by the "
                                      "compressed-tensors checkpoint") in report.ignored
    a, b = kept.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)


def test_moe_scheme_the_format_cannot_state_and_unloaded_experts(sources, tmp_path):
    model = load(sources["qwen3_moe"], "block", "channel")
    with pytest.raises(ValueError, match="format 'fp8' cannot express layer model.layers.0.mlp.experts.0."
                                         "down_proj: channel weights"):
        save(model, tmp_path / "out", "fp8")
    layer = experts_of(model)["model.layers.1.mlp.experts"]
    model.model.layers[1].mlp.experts = Fp8Experts(layer.num_experts, layer.hidden_size, layer.intermediate_size,
                                                   act_fn=layer.act_fn, name="model.layers.1.mlp.experts")
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts has no weight yet"):
        save(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_writes_a_moe_checkpoint(sources, tmp_path):
    from test_export import run_cli

    proc = run_cli("quantize", str(sources["mixtral"]), "--scheme", "fp8_block", "--format", "fp8", "--out",
                   str(tmp_path / "out"), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    written, _ = fp8now.load(tmp_path / "out", device="cpu")
    a, b = load(sources["mixtral"], "block").state_dict(), written.state_dict()
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale_inv" in file_tensors(tmp_path / "out")
