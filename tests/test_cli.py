"""The `fp8now` command on the embedded model and on a tiny one: `inspect --json` as a real subprocess, the rest
through main() in this process (cli_here; run and eval run as real subprocesses in test_first_run.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cli_here import fp8now_here
from fp8now.cli.main import main
from fp8now.cli.output import SCHEMA_KEYS
from tiny import write_tiny_checkpoint

from test_evaluate import save_byte_tokenizer
from test_models import embedded_model_dir, needs_gguf
from hang import HANG_S


@pytest.fixture
def embedded(monkeypatch, capsys):
    """`fp8now ARGS` in this process (cli_here) with the session's converted cache as FP8NOW_CACHE."""
    path, _ = embedded_model_dir()
    monkeypatch.setenv("FP8NOW_CACHE", str(path.parent))
    return lambda *args: fp8now_here(capsys, *args)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8now: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


@pytest.mark.slow
@needs_gguf
def test_run_generates_greedy_and_sampled_and_reports_memory(embedded):
    proc = embedded("run", "--scheme", "ptpc", "--prompt", "What is a licence?", "--max-new-tokens", "4",
                    "--seed", "1", "--mode", "both")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "scheme: channel" in out and "--- greedy: " in out and "--- sampled (temperature 0.7, seed 1)" in out
    assert out.count("tokens/s") == 2
    assert "bf16 ->" in out and "fp8 incl. scales" in out and "process peak RSS" in out
    assert "backends: cpu x210" in out


@pytest.mark.slow
@needs_gguf
def test_run_json_is_the_shared_shape(embedded):
    proc = embedded("run", "--json", "--mode", "both", "--max-new-tokens", "3", "--seed", "2")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)  # nothing but the JSON object on stdout
    assert tuple(res) == SCHEMA_KEYS and res["command"] == "run" and res["args"]["seed"] == 2
    entry = res["schemes"]["channel"]
    assert entry["config"] == {"scheme": "channel", "activation": "token", "backend": "auto", "fast_accum": False,
                               "head": False, "embedding": False, "weight_numerics": "spec", "keep_bf16": None}
    assert len(entry["report"]["layers"]) == 210
    gens = entry["results"]["generations"]
    assert [g["mode"] for g in gens] == ["greedy", "sampled"] and gens[1]["seed"] == 2
    assert all(g["new_tokens"] == 3 and g["tokens_per_s"] > 0 and g["text"] for g in gens)


@pytest.mark.slow
@needs_gguf
def test_eval_json_is_one_object_with_every_scheme(embedded, tmp_path):
    plot = tmp_path / "sqnr.png"
    proc = embedded("eval", "--scheme", "all", "--max-tokens", "256", "--seq-len", "128", "--json",
                    "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else
    assert tuple(res) == SCHEMA_KEYS and res["command"] == "eval"
    assert res["results"]["text"]["name"] == "licenses.txt" and res["results"]["text"]["tokens"] == 256
    assert list(res["schemes"]) == ["channel", "block", "tensor", "tensor-tensor"]
    for key, entry in res["schemes"].items():
        r = entry["results"]
        assert 0 < r["kl"] < 1 and 0.5 < r["top1"] <= 1, key
        assert 0 < r["kl_se"] < r["kl"] < r["kl_p99"] < r["kl_p999"] <= r["kl_max"], key
        assert math.isfinite(r["ppl_bf16"]) and math.isfinite(r["ppl_fp8"]) and r["ppl_bf16"] < 100, key
        layers = entry["report"]["layers"]
        assert len(layers) == 210 and all(row["sqnr_db"] > 25 for row in layers), key
    assert plot.read_bytes()[:4] == b"\x89PNG" and res["results"]["plot"] == str(plot)


@pytest.mark.slow
@needs_gguf
def test_inspect_prints_the_load_report(embedded):
    proc = embedded("inspect", "--scheme", "fp8_block", "--layers")
    assert proc.returncode == 0, proc.stderr
    assert "model.layers.29.mlp.down_proj" in proc.stdout and "SQNR dB" in proc.stdout
    assert "quantized 210 layers (block)" in proc.stdout and "left alone: lm_head" in proc.stdout


@pytest.mark.slow
@needs_gguf
def test_bad_scheme_lists_the_valid_names(embedded):
    line = one_error_line(embedded("run", "--scheme", "int4"))
    assert "'int4'" in line and "ptpc" in line and "tensor-tensor" in line


@pytest.mark.slow
@needs_gguf
def test_missing_model_folder_is_one_line(embedded, tmp_path):
    missing = tmp_path / "no-such-model"
    line = one_error_line(embedded("inspect", str(missing)))
    assert str(missing) in line and "does not exist" in line


# --- in process, on a tiny model (fast) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "llama", "llama")
    save_byte_tokenizer(path)
    return path


def test_eval_tables(tiny_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    args = ["eval", str(tiny_dir), "--scheme", "block", "--text", str(text), "--seq-len", "100", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "t.txt: 360 tokens in 4 windows" in out
    assert "PPL ratio" in out and "KL p99.9" in out and "\nblock " in out and " ± " in out
    assert "model.layers.1.mlp.down_proj" not in out
    assert main(args + ["--layers"]) == 0
    assert "model.layers.1.mlp.down_proj" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    r = res["schemes"]["block"]["results"]
    assert tuple(res) == SCHEMA_KEYS and res["args"]["seq_len"] == 100 and r["predicted"] == 356
    assert out.splitlines()[4].split()[3] == f"{r['ppl_ratio']:.5f}"  # the table shows the JSON's numbers


def test_inspect_summary_layers_and_json(tiny_dir, capsys):
    assert main(["inspect", str(tiny_dir), "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert tuple(res) == SCHEMA_KEYS and res["command"] == "inspect"
    layers = res["schemes"]["channel"]["report"]["layers"]
    summary = {row["type"]: row for row in res["schemes"]["channel"]["results"]["summary"]}
    assert list(summary) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for kind, row in summary.items():
        rows = [r for r in layers if r["name"].endswith("." + kind)]
        db = sorted(r["sqnr_db"] for r in rows)
        assert row["count"] == len(rows) == 2 and row["sqnr_min_db"] == db[0]
        assert row["sqnr_median_db"] == pytest.approx((db[0] + db[1]) / 2)
        assert row["worst_layer"] == min(rows, key=lambda r: r["sqnr_db"])["name"]
    assert main(["inspect", str(tiny_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "worst layer" in out and "down_proj" in out and "model.layers.0.mlp.down_proj" not in out.split(
        "worst layer")[0] and "left alone: lm_head" in out
    assert main(["inspect", str(tiny_dir), "--device", "cpu", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj" in out and "model.layers.1.mlp.down_proj" in out


def test_errors_are_one_line_and_debug_shows_the_traceback(tiny_dir, capsys):
    assert main(["eval", str(tiny_dir), "--text", "/no/such/file.txt"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read --text /no/such/file.txt" in err
    assert main(["inspect", str(tiny_dir), "--device", "tpu:x"]) == 1
    assert "unknown device" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        main(["inspect", "/no/such/model", "--debug"])


def test_another_tools_scheme_name_works_end_to_end(tiny_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    proc = fp8now_here(capsys, "eval", str(tiny_dir), "--scheme", "FP8_PER_TENSOR", "--text", str(text),
                       "--seq-len", "90", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert list(res["schemes"]) == ["tensor-tensor"]  # vLLM's fp8_per_tensor: per-tensor weights and activations
    config = res["schemes"]["tensor-tensor"]["config"]
    assert (config["scheme"], config["activation"]) == ("tensor", "tensor")


def test_bare_fp8_is_one_line_listing_each_tools_meaning(tiny_dir, capsys):
    assert main(["inspect", str(tiny_dir), "--scheme", "Fp8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FP8 scheme 'Fp8': bare fp8" in err
    assert "vLLM" in err and "FineGrainedFP8Config" in err and "llm-compressor" in err


def test_inspect_names_each_layers_kernel_path(tiny_dir, capsys):
    """`inspect --json` (a real subprocess: stdout holds the JSON object alone) holds the report's `to_dict()`
    (strict JSON), whose layer rows map 1, 16 and 4096 tokens per call to the path that layer's calls run (on
    CPU: the cpu backend's quantizer and bf16 GEMM); the text output (main() here) lists the same paths."""
    proc = subprocess.run([sys.executable, "-m", "fp8now", "inspect", str(tiny_dir), "--device", "cpu", "--scheme",
                           "block", "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["schemes"]["block"]["report"]
    assert report["scheme"] == "block" and report["layers"]
    for row in report["layers"]:
        assert row["backend"] == "cpu"
        assert row["plan"] == {m: "cpu-group + bf16-matmul" for m in ("1", "16", "4096")}, row
    text = fp8now_here(capsys, "inspect", str(tiny_dir), "--device", "cpu", "--scheme", "channel")
    assert text.returncode == 0, text.stderr
    assert "kernel plans (tokens per call: path)" in text.stdout
    assert "    4096: cpu-token + bf16-matmul" in text.stdout
