"""Fp8Config(head=True, embedding=True) through load, quantize_, reload_weights, export, the door and the CLI,
on tiny real transformers models (untied llama, tied llama), against fp8_oracle's independent loops."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_oracle import exact_product, quantize_loops
from safetensors.torch import load_file, save_file
from cli_here import fp8now_here
from test_export import file_tensors, logits, same_bytes
from tiny import tiny_model, unique_state_dict, write_tiny_checkpoint
from torch import nn

import fp8now
from fp8now import Fp8Config, Fp8Linear, rel_diff
from fp8now.layers.embedding import Fp8Embedding
from fp8now.export import save

V, H = 512, 192   # tiny.py's vocabulary and hidden size
FULL = dict(head=True, embedding=True)
ORACLE = {"channel": (1, -1, "row"), "tensor": (-1, -1, "tensor"), "block": (128, 128, "block")}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    return {tie: write_tiny_checkpoint(root / f"tie{tie}", "llama", seed=5, tie=tie) for tie in (False, True)}


def stored(folder, name: str) -> torch.Tensor:
    return load_file(folder / "model.safetensors")[name]


def assert_oracle_bytes(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, scheme: str) -> None:
    q_ref, s_ref = quantize_loops(w, *ORACLE[scheme])
    assert torch.equal(q.double(), q_ref) and torch.equal(s.reshape(s_ref.shape), s_ref)


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_untied_head_and_embedding_quantize_like_the_oracle(dirs, scheme):
    model, report = fp8now.load(dirs[False], Fp8Config(scheme=scheme, **FULL), device="cpu")
    head, emb = model.lm_head, model.model.embed_tokens
    assert isinstance(head, Fp8Linear) and head.scheme.value == scheme and isinstance(emb, Fp8Embedding)
    assert_oracle_bytes(head.weight, head.weight_scale, stored(dirs[False], "lm_head.weight"), scheme)
    assert_oracle_bytes(emb.weight, emb.weight_scale, stored(dirs[False], "model.embed_tokens.weight"), "channel")
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = {}
    head.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    with torch.no_grad():
        got = model(ids).logits.float()
        first = emb(ids)
    q_e, s_e = quantize_loops(stored(dirs[False], "model.embed_tokens.weight"), 1, -1, "row")
    assert torch.equal(first, (q_e * s_e.double())[ids].float().to(torch.bfloat16))   # the lookup: exact
    x = seen["x"].reshape(-1, H)                 # the head: the exact product of oracle-quantized operands
    act = {"channel": (1, -1, "row"), "block": (1, 128, "group")}[scheme]
    xq, xs = quantize_loops(x, *act)
    wq, ws = quantize_loops(stored(dirs[False], "lm_head.weight"), *ORACLE[scheme])
    ref = exact_product(xq, xs, wq, ws, act[:2], ORACLE[scheme][:2])
    assert rel_diff(seen["y"].reshape(-1, V), ref) < 1e-4
    bf16 = tiny_model("llama", seed=5, tie=False)
    with torch.no_grad():
        want = bf16(ids).logits.float()
    assert 0 < rel_diff(got, want) < 2e-2                 # and the whole model stays near bf16
    assert [r.name for r in report.layers][0] == "model.embed_tokens" and report.layers[-1].name == "lm_head"
    assert report.layers[0].backend == "lookup" and report.layers[0].sqnr_db > 25


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_tied_model_keeps_one_fp8_copy(dirs, scheme):
    model, report = fp8now.load(dirs[True], Fp8Config(scheme=scheme, **FULL), device="cpu")
    head, emb = model.lm_head, model.model.embed_tokens
    assert emb.weight is head.weight and emb.weight_scale is head.weight_scale and emb.scheme is head.scheme
    w = stored(dirs[True], "model.embed_tokens.weight")                        # the only copy on disk
    assert_oracle_bytes(head.weight, head.weight_scale, w, scheme)
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    gr, gc, rule = ORACLE[scheme]
    q, s = quantize_loops(w, gr, gc, rule)
    rows, cols = (V if gr == -1 else gr), (H if gc == -1 else gc)
    deq = q * s.double().repeat_interleave(rows, 0)[:V].repeat_interleave(cols, 1)[:, :H]
    with torch.no_grad():
        assert torch.equal(emb(ids), deq[ids].float().to(torch.bfloat16))
    assert "lm_head.weight" in model.state_dict() and "model.embed_tokens.weight" in model.state_dict()
    # transformers' model.dtype (its first float parameter; generate builds attention masks in it) stays bf16
    assert model.dtype == torch.bfloat16 and not any("anchor" in k for k in model.state_dict())
    rows_by = {r.name: r for r in report.layers}
    assert rows_by["model.embed_tokens"].backend == "lookup (tied)"
    assert rows_by["model.embed_tokens"].sqnr_db == rows_by["lm_head"].sqnr_db
    # resident bytes: the shared bf16 matrix (2 bytes an element) became one FP8 copy and its scales
    base = fp8now.load(dirs[True], Fp8Config(scheme=scheme), device="cpu")[1]
    scale_bytes = head.weight_scale.numel() * 4
    assert report.model_bytes == base.model_bytes - 2 * V * H + V * H + scale_bytes
    assert report.bf16_bytes - base.bf16_bytes == 2 * V * H                    # counted once, with the head
    assert report.fp8_bytes - base.fp8_bytes == V * H + scale_bytes


def test_untied_resident_bytes_and_quantize_matches_load(dirs):
    model, report = fp8now.load(dirs[False], Fp8Config(**FULL), device="cpu")
    base = fp8now.load(dirs[False], Fp8Config(), device="cpu")[1]
    # embedding and head: 2 bytes an element each -> 1 byte an element plus one float32 scale per row
    assert report.model_bytes == base.model_bytes - 2 * (2 * V * H) + 2 * (V * H + 4 * V)
    for tie in (False, True):
        mem = tiny_model("llama", seed=5, tie=tie)
        rep = fp8now.quantize_(mem, Fp8Config(scheme="block", **FULL))
        ref = fp8now.load(dirs[tie], Fp8Config(scheme="block", **FULL), device="cpu")[0]
        a, b = mem.state_dict(), ref.state_dict()
        assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
        assert torch.equal(logits(mem), logits(ref))
        assert {"lm_head", "model.embed_tokens"} <= set(rep.quantized)
        assert fp8now.quantize_(mem, Fp8Config(scheme="block", **FULL)).layers == []   # idempotent


def test_head_and_ignore(dirs):
    """head=True makes lm_head a target; a user ignore pattern matching it wins, and the report says so."""
    _, report = fp8now.load(dirs[False], Fp8Config(head=True, ignore=("re:lm_.*",)), device="cpu")
    assert "lm_head" not in report.quantized
    assert dict(report.ignored)["lm_head"] == "matches ignore pattern 're:lm_.*' (wins over head=True)"
    model, report = fp8now.load(dirs[False], Fp8Config(head=True), device="cpu")
    assert isinstance(model.lm_head, Fp8Linear) and type(model.model.embed_tokens) is nn.Embedding
    assert "lm_head" not in dict(report.ignored)


@pytest.mark.parametrize("options", [dict(head=True), dict(embedding=True),
                                     dict(head=True, embedding=True, ignore=("lm_head",))])
def test_one_option_on_a_tied_model_is_refused(dirs, options):
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight.*pass "
                                         r"head=True and embedding=True together"):
        fp8now.load(dirs[True], Fp8Config(**options), device="cpu")
    with pytest.raises(ValueError, match="tied"):
        fp8now.quantize_(tiny_model("llama", tie=True), Fp8Config(**options))


@pytest.mark.parametrize("tie", [False, True])
def test_reload_in_place(dirs, tmp_path, tie):
    model, _ = fp8now.load(dirs[tie], Fp8Config(scheme="block", **FULL), device="cpu")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    new = unique_state_dict(tiny_model("llama", seed=11, tie=tie))   # tied: only embed_tokens.weight
    assert ("lm_head.weight" in new) is not tie
    report = fp8now.reload_weights(model, new)
    assert report.complete and "lm_head" in report.updated_layers
    assert {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)} == ptrs
    fresh = fp8now.load(write_tiny_checkpoint(tmp_path / "new", "llama", seed=11, tie=tie),
                        Fp8Config(scheme="block", **FULL), device="cpu")[0]
    a, b = model.state_dict(), fresh.state_dict()
    assert all(same_bytes(a[k], b[k]) for k in a) and torch.equal(logits(model), logits(fresh))


def test_nan_in_the_embedding_names_the_file_and_tensor(dirs, tmp_path):
    tensors = load_file(dirs[False] / "model.safetensors")
    tensors["model.embed_tokens.weight"][3, 3] = float("nan")
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text((dirs[False] / "config.json").read_text())
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight'.*NaN or Inf"):
        fp8now.load(folder, Fp8Config(embedding=True), device="cpu")
    model, _ = fp8now.load(dirs[False], Fp8Config(embedding=True), device="cpu")
    with pytest.raises(ValueError, match="model.embed_tokens.weight.*NaN or Inf"):
        fp8now.reload_weights(model, {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]})


def test_export_takes_the_head_and_refuses_the_embedding(dirs, tmp_path):
    model, _ = fp8now.load(dirs[False], Fp8Config(head=True), device="cpu")
    out = save(model, tmp_path / "ct")
    files = file_tensors(out)
    assert same_bytes(files["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(files["lm_head.weight_scale"], model.lm_head.weight_scale)
    assert "lm_head" not in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    back, _ = fp8now.load(out, device="cpu")                     # read back as it is
    assert isinstance(back.lm_head, Fp8Linear) and torch.equal(logits(back), logits(model))
    full, _ = fp8now.load(dirs[False], Fp8Config(**FULL), device="cpu")
    with pytest.raises(ValueError, match="model.embed_tokens is an FP8 embedding.*embedding=False"):
        save(full, tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="embedding=False"):
        fp8now.export.quantize(dirs[False], tmp_path / "no2", Fp8Config(embedding=True))
    with pytest.raises(ValueError, match="FP8 checkpoint.*without them"):   # a pre-quantized checkpoint
        fp8now.load(out, Fp8Config(head=True), device="cpu")


def test_tensor_parallel_and_the_door_refuse_what_they_do_not_support(dirs):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="not supported with tp_plan"):
        fp8now.load(dirs[False], Fp8Config(head=True), device="cpu", tp_plan="auto")
    with pytest.raises(ValueError, match="embedding=True.*fp8now.load"):
        fp8now.TransformersConfig(embedding=True)
    theirs = AutoModelForCausalLM.from_pretrained(str(dirs[False]), dtype=torch.bfloat16,
                                                  quantization_config=fp8now.TransformersConfig(head=True))
    ours = fp8now.load(dirs[False], Fp8Config(head=True), device="cpu")[0]
    assert isinstance(theirs.lm_head, Fp8Linear) and same_bytes(theirs.lm_head.weight, ours.lm_head.weight)
    assert torch.equal(logits(theirs), logits(ours))
    with pytest.raises(ValueError, match="tied.*cannot store an FP8 embedding.*Fp8Config\\(head=True, embedding=True\\)"):
        AutoModelForCausalLM.from_pretrained(str(dirs[True]), dtype=torch.bfloat16,
                                             quantization_config=fp8now.TransformersConfig(head=True))


def test_config_flags_must_be_booleans():
    with pytest.raises(TypeError, match="Fp8Config.head must be True or False"):
        Fp8Config(head="yes")
    assert Fp8Config().ignore == () and not Fp8Config().head and not Fp8Config().embedding


@pytest.mark.slow
def test_cli_flags(dirs, tmp_path, capsys):
    """--fp8-head and --fp8-embedding through main() in this process (inspect and quantize run as real
    subprocesses in test_cli.py and test_export.py)."""
    proc = fp8now_here(capsys, "inspect", str(dirs[True]), "--device", "cpu", "--json", "--fp8-head", "--fp8-embedding")
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)["schemes"]["channel"]
    assert entry["config"]["head"] is True and entry["config"]["embedding"] is True
    names = [row["name"] for row in entry["report"]["layers"]]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    proc = fp8now_here(capsys, "inspect", str(dirs[True]), "--device", "cpu", "--fp8-head")
    assert proc.returncode == 1 and "tied" in proc.stderr and "Traceback" not in proc.stderr
    proc = fp8now_here(capsys, "quantize", str(dirs[False]), "--fp8-embedding", "--out", str(tmp_path / "o"))
    assert proc.returncode == 1 and "embedding=False" in proc.stderr and not (tmp_path / "o").exists()
    proc = fp8now_here(capsys, "quantize", str(dirs[False]), "--fp8-head", "--out", str(tmp_path / "h"))
    assert proc.returncode == 0, proc.stderr
    assert file_tensors(tmp_path / "h")["lm_head.weight"].dtype == torch.float8_e4m3fn
