"""The whole-model benchmark on the CPU: benchmarks/bench_model.py and `fp8now bench` run for real as
subprocesses (a tiny Llama preset written with save_pretrained, a tiny Qwen3-MoE folder), their option errors
and the split run through main() in this process, plus in-process checks of the decode step against a full
forward, of the presets' shapes and of the ratio table."""

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang import HANG_S

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
FIELDS = {"model", "impl", "phase", "batch", "seq", "tokens_per_s", "seconds", "peak_gb"}
SMALL = ["--prefill", "1x16", "--decode", "1,3", "--context", "8", "--reps", "1", "--prompts", "2x8"]


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), *args], env=ENV,
                          capture_output=True, text=True, timeout=HANG_S)


def check_rows(rows: list[dict], impls: set[str], model: str) -> None:
    """Every row has the fields; accuracy, decode and load rows hold sane figures."""
    assert not [r for r in rows if "error" in r]
    assert all(FIELDS <= set(r) and r["model"] == model for r in rows)
    # each row names the transformers whose attention path it ran (the installed distribution's version)
    assert {r["transformers"] for r in rows} == {importlib.metadata.version("transformers")}
    assert {r["impl"] for r in rows} == impls
    for impl in impls:
        mine = {(r["phase"], r["batch"], r["seq"]): r for r in rows if r["impl"] == impl}
        want = {("load", None, None), ("prefill", 1, 16), ("decode", 1, 8), ("decode", 3, 8)}
        fp8 = {("accuracy", 2, 8), ("reload", None, None)} if impl != "bf16" else set()
        assert set(mine) == want | fp8
        for (phase, batch, seq), r in mine.items():
            assert r["seconds"] > 0 and r["peak_gb"] is None        # no device memory on the CPU
            if phase == "load":          # alone in a fresh process: its own host peak, above what it held before
                assert r["gb_per_s"] == pytest.approx(r["checkpoint_gb"] / r["seconds"]) and not r["cold"]
                assert r["host_peak_gb"] > r["host_before_gb"] > 0
            if phase == "reload":        # every checkpoint tensor again, against a copy of the same bytes
                assert r["ratio_to_copy"] == pytest.approx(r["seconds"] / r["copy_s"]) and r["copy_s"] > 0
                assert r["input_gb"] == pytest.approx(mine["load", None, None]["checkpoint_gb"], rel=0.01)
            if phase in ("prefill", "decode"):
                assert r["tokens_per_s"] == pytest.approx(batch * (seq if phase == "prefill" else 1) / r["seconds"])
            if phase == "decode":
                assert r["mode"] == "eager" and r["rel_to_eager"] == 0.0
            if phase == "accuracy":      # FP8 changes the logits: KL clearly above 0, most top-1 kept
                assert 1e-4 < r["kl"] < 1.0 and 0.5 <= r["top1"] <= 1.0 and r["tokens"] == 16


ALL = ["bf16", "fp8now-channel", "fp8now-block", "fp8now-channel-full", "fp8now-channel-noprod", "fp8now-channel-fast"]
GOOD = set(ALL) - {"fp8now-channel-fast"}


def bench_model_main(monkeypatch, *args: str) -> None:
    """benchmarks/bench_model.py's main() in this process (the script runs as a subprocess in the test below)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "bench_model.py"), *args])
    importlib.import_module("bench_model").main()


def test_script_on_the_tiny_preset_every_variant_and_a_split_run(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_model.py on the tiny preset as a subprocess, once for all of its rows' checks, each variant
    (--full, --producers, --fast-accum) adding its implementation to the same run: the file's meta; the bf16,
    channel, block, -full and -prod rows sane (check_rows); channel's resident bytes against bf16's; the ratio
    table; the preset written into --workdir; then check_variants and check_split_run on its output."""
    out, work = tmp_path / "model.json", tmp_path / "work"
    run = script("tiny", "--device", "cpu", "--schemes", "channel,block", "--full", "--producers", "--fast-accum",
                 "--impls", ",".join(ALL), "--workdir", str(work), "--out", str(out), *SMALL)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"meta", "rows"}
    assert set(data["meta"]) == {"date", "gpu", "torch", "triton", "commit", "command"}
    assert data["meta"]["gpu"] == "cpu" and "bench_model.py tiny" in data["meta"]["command"]
    rows = data["rows"]
    check_rows([r for r in rows if r["impl"] in GOOD], GOOD, "tiny-2l")
    load = {r["impl"]: round(r["resident_gb"] * 1e9) for r in rows if r["phase"] == "load" and "error" not in r}
    # tiny preset, 2 layers: q, o [256, 256], k, v [128, 256], gate, up [512, 256], down [256, 512]. Channel on
    # the CPU holds per weight one FP8 byte and the cpu backend's bf16 working copy (2 bytes) instead of
    # bf16's 2 bytes, and one float32 scale per output row.
    weights = 256 * 256 * 2 + 128 * 256 * 2 + 512 * 256 * 3
    out_rows = 256 + 128 + 128 + 256 + 512 + 512 + 256
    assert load["fp8now-channel"] - load["bf16"] == 2 * (weights + 4 * out_rows)
    table = run.stdout.splitlines()                      # the ratio table: speed-ups of every measured impl
    assert all(impl in table[0] for impl in ALL)
    prefill = next(line for line in table if " prefill " in line)
    assert len(re.findall(r"\d\.\d\dx", prefill)) == 4 and prefill.rstrip().endswith("-")   # fast: no prefill
    assert (work / "tiny-2l-seed0" / "config.json").is_file()
    check_variants(rows, load)
    check_split_run(data, out, work, monkeypatch, capsys)


def check_variants(rows: list[dict], load: dict) -> None:
    """--full adds fp8now-<scheme>-full (Fp8Config(head=True, embedding=True)). On the tiny preset (vocabulary
    512, hidden 256, untied) it holds, beside fp8now-channel: the embedding at 1 byte an element instead of 2, the
    head at 1 byte plus the cpu backend's 2-byte working copy instead of 2, and one float32 scale per vocabulary
    row for each: 8 bytes per row in all. --producers adds fp8now-<scheme>-noprod (every FP8 linear planned with the
    RMSNorm and SiLU*up producer kernels off); on the CPU those kernels do not run: channel's bytes and logits.
    --fast-accum adds fp8now-<scheme>-fast for tensor and channel only (block has no fast mode); on the CPU their
    load fails (alone, then in the run) as a row naming fast_accum (no backend has it), the others run."""
    assert load["fp8now-channel-full"] - load["fp8now-channel"] == 8 * 512
    assert load["fp8now-channel-noprod"] == load["fp8now-channel"]
    acc = {r["impl"]: (r["kl"], r["top1"]) for r in rows if r["phase"] == "accuracy"}
    assert acc["fp8now-channel-full"][0] != acc["fp8now-channel"][0]
    assert acc["fp8now-channel-noprod"] == acc["fp8now-channel"]
    fast = [x for x in rows if x["impl"] == "fp8now-channel-fast"]
    assert fast and all(x["phase"] == "load" and "fast_accum" in x.get("error", "") for x in fast), fast
    assert any(x["impl"] == "bf16" and "error" not in x for x in rows)


def check_split_run(data: dict, first_out: Path, work: Path, monkeypatch, capsys) -> None:
    """A second call (main() in this process) measures block's accuracy, prefill and decode again and adds to a
    copy of the file: the bf16 logits and the preset come from --workdir; block's load and reload rows stay."""
    out = first_out.with_name("split.json")
    out.write_text(first_out.read_text())
    first_block = [r for r in data["rows"] if r["impl"] == "fp8now-block"]
    capsys.readouterr()
    bench_model_main(monkeypatch, "tiny", "--device", "cpu", "--schemes", "channel,block", "--impls", "fp8now-block",
                     "--add", "--phases", "accuracy,prefill,decode", "--workdir", str(work), "--out", str(out),
                     *SMALL)
    err = capsys.readouterr().err
    assert "writing preset" not in err and "bf16 reference" not in err
    data2 = json.loads(out.read_text())
    assert " ; " in data2["meta"]["command"]
    check_rows([r for r in data2["rows"] if r["impl"] in GOOD], GOOD, "tiny-2l")
    block = [r for r in data2["rows"] if r["impl"] == "fp8now-block"]
    assert len({(r["phase"], r["batch"], r["seq"]) for r in block}) == len(block) == 6   # one row per case
    again = [r for r in block if r["phase"] not in ("load", "reload")]
    assert len(again) == 4 and all(r not in first_block for r in again)                 # measured again: new
    assert [r for r in block if r not in again] == [r for r in first_block if r["phase"] in ("load", "reload")]
    assert next(r["kl"] for r in again if r["phase"] == "accuracy") == pytest.approx(
        next(r["kl"] for r in first_block if r["phase"] == "accuracy"))
    assert [r for r in data2["rows"] if r["impl"] != "fp8now-block"] == \
           [r for r in data["rows"] if r["impl"] != "fp8now-block"]                         # the others kept


def test_cli_bench_json_on_a_moe_folder(tmp_path):
    from moe_tiny import save_moe

    folder = save_moe("qwen3_moe", tmp_path, spread=1.0)
    run = subprocess.run([sys.executable, "-m", "fp8now", "bench", str(folder), "--device", "cpu", "--scheme",
                          "channel", "--json", *SMALL], env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(run.stdout)
    assert data["command"] == "bench" and data["model"] == str(folder) and data["device"] == "cpu"
    entry = data["schemes"]["channel"]
    assert entry["config"]["scheme"] == "channel" and entry["report"]["experts"]   # the experts were FP8
    check_rows(data["results"]["rows"] + entry["results"]["rows"], {"bf16", "fp8now-channel"}, "qwen3_moe")


def test_cli_bench_rejects_layers_for_a_folder(tmp_path, capsys):
    from fp8now.cli.main import main

    assert main(["bench", str(tmp_path), "--layers", "2"]) == 1
    assert "--layers applies to the presets" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_decode_step_matches_a_full_forward(family):
    """The cached step's logits equal the last position's logits of one forward over context + token;
    calling it again rewrites the same slot and gives the same logits."""
    from fp8now.cli.bench_decode import decode_step, random_ids
    from moe_tiny import moe_model
    from tiny import tiny_model

    model = tiny_model("llama") if family == "llama" else moe_model("qwen3_moe", spread=1.0)
    vocab, cpu = model.config.vocab_size, torch.device("cpu")
    for batch, context in ((1, 5), (3, 12)):
        step = decode_step(model, batch, context, vocab, seed=3, device=cpu)
        first, second = step().clone(), step().clone()
        ids = torch.cat([random_ids((batch, context), vocab, 3, cpu), random_ids((batch, 1), vocab, 10, cpu)], 1)
        with torch.inference_mode():
            full = model(input_ids=ids, use_cache=False).logits[:, -1:].float()
        assert first.shape == (batch, 1, vocab) and torch.equal(first, second)
        assert (first.float() - full).norm() <= 1e-2 * full.norm()


def test_presets_have_the_published_parameter_counts():
    from transformers import AutoModelForCausalLM

    from fp8now.cli.bench_presets import preset_config

    def count(name: str, layers: int) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(preset_config(name, layers))
        return sum(p.numel() for p in model.parameters())

    assert count("llama3.1-8b", 32) == 8_030_261_248          # Llama-3.1-8B's model card
    assert count("qwen3-30b-a3b", 48) == pytest.approx(30.5e9, rel=0.005)   # Qwen3-30B-A3B: 30.5B


def test_ratio_table_and_bad_options():
    import argparse

    from fp8now.cli.bench import ratio_table
    from fp8now.cli.bench_args import add_arguments, options

    base = dict(model="m", batch=8, seq=2048, peak_gb=1.0)
    rows = [dict(base, impl="bf16", phase="prefill", tokens_per_s=1000.0, seconds=16.4),
            dict(base, impl="fp8", phase="prefill", tokens_per_s=1500.0, seconds=10.9),
            dict(base, impl="fp8", phase="decode", batch=1, seq=512, error="RuntimeError: capture"),
            dict(base, impl="bf16", phase="decode", batch=1, seq=512, mode="eager", tokens_per_s=40.0, seconds=0.025),
            dict(base, impl="fp8", phase="decode", batch=1, seq=512, mode="eager", tokens_per_s=30.0, seconds=0.033)]
    lines = ratio_table(rows).splitlines()
    assert "1,000 tok/s" in lines[2] and lines[2].endswith("1.50x")
    assert lines[3].endswith("failed") and lines[-1].startswith("failed: m fp8 decode B=1: RuntimeError")
    assert "decode (eager)" in lines[4] and "40 tok/s" in lines[4] and lines[4].endswith("0.75x")
    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad, match in ((["--prefill", "8-2048"], "BxT"), (["--phases", "load,speed"], "--phases"),
                       (["--decode", "0"], "at least 1")):
        with pytest.raises(ValueError, match=match):
            options(p.parse_args(bad))


def test_random_checkpoint_round_trips_and_presets_are_reused(tmp_path):
    """write_random's folder (sharded) loads in transformers with exactly the seeded weights, and in
    fp8now; a preset folder is written once and then reused."""
    from transformers import AutoModelForCausalLM

    from fp8now import load
    from fp8now.cli.bench_load import read_through
    from fp8now.cli.bench_presets import fill_random_, preset_dir, write_random
    from moe_tiny import moe_config

    config = moe_config("qwen3_moe")
    folder = write_random(config, tmp_path / "moe", "cpu", seed=5)
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fill_random_(fresh, "cpu", seed=5)
    got, want = dict(loaded.named_parameters()), dict(fresh.named_parameters())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert len({float(want[k].detach().float().std()) for k in want}) > len(want) // 2   # varied, not constant
    rows = want["model.layers.0.self_attn.q_proj.weight"].detach().float().norm(dim=1)
    assert rows.max() > 2 * rows.min()                                          # rows of varied magnitude
    assert not list(tmp_path.glob(".tmp*"))
    assert read_through(folder, chunk=1000) == sum(f.stat().st_size for f in folder.glob("*.safetensors")) > 0
    model, report = load(folder, device="cpu", measure_error=False)
    assert report.experts and len(report.layers) == 2 * 4                        # q, k, v, o per layer

    first = preset_dir("tiny", tmp_path / "work", 1, "cpu")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert preset_dir("tiny", tmp_path / "work", 1, "cpu") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "config.json").read_text())["num_hidden_layers"] == 1


def test_agreement_against_a_direct_computation():
    """KL(ref || got) and top-1 of bench.agreement against the definition, per position, in Python floats."""
    from fp8now.cli.bench import agreement

    g = torch.Generator().manual_seed(11)
    ref = [torch.randn(t, 50, generator=g) * 3 for t in (3, 5)]
    got = [r + 2.0 * torch.randn(r.shape, generator=g) for r in ref]
    kls, same = [], 0
    for r, q in zip(ref, got):
        for a, b in zip(r.tolist(), q.tolist()):
            za, zb = math.log(sum(map(math.exp, a))), math.log(sum(map(math.exp, b)))
            kls.append(sum(math.exp(x - za) * ((x - za) - (y - zb)) for x, y in zip(a, b)))
            same += a.index(max(a)) == b.index(max(b))
    out = agreement(ref, got, torch.device("cpu"))
    assert out["tokens"] == 8 and out["kl"] == pytest.approx(sum(kls) / 8, rel=1e-9)
    assert out["top1"] == same / 8 and 0 < out["kl"] and same < 8


def test_unknown_impls_list_the_runs_names_before_anything_loads(tmp_path, monkeypatch):
    """--torchao's peers: per-row with fast (its default) and float32 accumulation, each eager and compiled
    (`-compiled`, or each decoder layer alone: `-regional`; --torchao-compile picks); --fast-accum's: tensor and
    channel only (no fp8now-block-fast), compiled too under --fp8now-compile. An unknown --impls lists the run's
    names before anything loads or is written."""
    work = str(tmp_path / "w")
    names = "bf16, fp8now-channel, torchao-row, torchao-row-f32acc, torchao-row-compiled, torchao-row-f32acc-compiled"
    for args, listed in ((("channel", "--torchao", "--impls", "x"), f"({names}; torchao's need --torchao)"),
                         (("channel", "--torchao", "--torchao-compile", "compiled", "--torchao-accum", "fast",
                           "--impls", "x"), "(bf16, fp8now-channel, torchao-row-compiled; "),
                         (("channel", "--torchao", "--torchao-compile", "regional", "--torchao-accum", "fast",
                           "--impls", "x"), "(bf16, fp8now-channel, torchao-row-regional; "),
                         (("channel", "--fp8now-compile", "both", "--impls", "x"),
                          "(bf16, fp8now-channel, fp8now-channel-compiled, fp8now-channel-regional; "),
                         (("channel,block", "--fp8now-compile", "regional", "--fast-accum", "--impls", "x"),
                          "(bf16, fp8now-channel, fp8now-block, fp8now-channel-fast, fp8now-channel-regional, "
                          "fp8now-block-regional, fp8now-channel-fast-regional; "),
                         (("channel,block", "--fast-accum", "--impls", "fp8now-block-fast"),
                          "(bf16, fp8now-channel, fp8now-block, fp8now-channel-fast; ")):
        with pytest.raises(SystemExit) as e:
            bench_model_main(monkeypatch, "tiny", "--device", "cpu", "--workdir", work, "--schemes", *args)
        assert listed in str(e.value)
    assert not (tmp_path / "w").exists()   # nothing was written: the names were checked first


@pytest.fixture
def compile_model(monkeypatch):
    """bench_model.compile_model, with dynamo's recompile limit (which it raises) put back afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    from bench_model import compile_model
    return compile_model


def test_compile_model_compiles_each_layer_and_keeps_fp8nows_accuracy(compile_model):
    """bench_model's compile_model (--fp8now-compile, --torchao-compile): "regional" compiles every decoder layer
    of an fp8now channel model (dynamo counts the graphs it built), and the compiled model's logits on fresh token
    ids are as far from the bf16 model's as the eager fp8now model's are (within 0.5-1.25x: still quantized, no
    less accurate; not bit for bit, since inductor's fused bf16 elementwise ops round differently and a changed
    input can round to another FP8 value); a bad `how` is an error."""
    import fp8now
    from fp8now import Fp8Config
    from tiny import tiny_model
    from torch._dynamo.utils import counters

    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(23))
    model = tiny_model("llama", seed=11)
    with torch.no_grad():
        bf16 = model(ids).logits.float()
        fp8now.quantize_(model, Fp8Config(scheme="channel"), measure_error=False)
        eager = model(ids).logits.float()
        torch._dynamo.reset()
        counters.clear()
        assert compile_model(model, "regional") is model
        compiled = model(ids).logits.float()
    assert counters["stats"]["unique_graphs"] >= 1 and all(layer._compiled_call_impl is not None
                                                            for layer in model.model.layers)
    off_eager, off_compiled = (torch.linalg.vector_norm(x - bf16) for x in (eager, compiled))
    assert 0.5 * off_eager < off_compiled < 1.25 * off_eager
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="how must be"):
        compile_model(model, "layers")


def test_a_compiled_impls_load_row_runs_alone_in_its_child(tmp_path):
    """A load row runs in a fresh child process (`--alone`), which must know the run's compiled impls: on the tiny
    preset `fp8now-channel-regional`'s load row holds the same resident bytes as `fp8now-channel`'s (compiling
    wraps the layers, it adds no tensors) and carries no error."""
    out = tmp_path / "model.json"
    run = script("tiny", "--device", "cpu", "--schemes", "channel", "--fp8now-compile", "regional", "--phases", "load",
                 "--impls", "fp8now-channel,fp8now-channel-regional", "--workdir", str(tmp_path / "w"),
                 "--out", str(out), *SMALL)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"] if r["phase"] == "load"}
    assert set(rows) == {"fp8now-channel", "fp8now-channel-regional"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["fp8now-channel-regional"]["resident_gb"] == rows["fp8now-channel"]["resident_gb"] > 0


def test_regional_compile_traces_the_triton_backends_prefill_path_whole(compile_model):
    """`--fp8now-compile regional` on the GPU runs the triton backend's prefill path under torch.compile: the torch
    ops quantizer (`Table.compiled_quant`, which inductor fuses) and `_scaled_mm` rowwise. The same path traced
    here on CPU tensors: no graph break in any decoder layer (a break would split each compiled layer in pieces
    and hand the host back its launches), and the logits as far from bf16's as the cpu backend's exact bytes
    are (within 0.5-1.25x; the interpreter's own eager kernels are no yardstick: their fp32 -> fp8 cast rounds
    otherwise, SPEC §2)."""
    import fp8now
    from fp8now import Fp8Config
    from tiny import tiny_model
    from torch._dynamo.utils import counters

    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(31))   # 80 rows: above the
    with torch.no_grad():                                                             # split-K GEMMs' 64
        bf16 = tiny_model("llama", seed=13)(ids).logits.float()
        exact = tiny_model("llama", seed=13)
        fp8now.quantize_(exact, Fp8Config(scheme="channel", backend="cpu"), measure_error=False)
        reference = exact(ids).logits.float()
        model = tiny_model("llama", seed=13)
        fp8now.quantize_(model, Fp8Config(scheme="channel", backend="triton"), measure_error=False)
        q_proj = model.model.layers[0].self_attn.q_proj
        path = q_proj.path(80, compiling=True, from_producer=False)
        assert q_proj.backend == "triton" and (path.quant, path.gemm) == ("torch", "cublas-rowwise")
        torch._dynamo.reset()
        counters.clear()
        compile_model(model, "regional")
        compiled = model(ids).logits.float()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    off_reference, off_compiled = (torch.linalg.vector_norm(x - bf16) for x in (reference, compiled))
    assert 0.5 * off_reference < off_compiled < 1.25 * off_reference
    torch._dynamo.reset()
