"""The `fp8now` command: real subprocesses on the embedded model, plus fast in-process checks on a tiny one."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8now.cli import main
from fp8now.tiny import write_tiny_checkpoint

from test_evaluate import save_byte_tokenizer
from test_models import embedded_model_dir, needs_gguf


def fp8now(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m fp8now.cli ARGS` with the session's converted cache."""
    path, _ = embedded_model_dir()
    env = {**os.environ, "FP8NOW_CACHE": str(path.parent)}
    return subprocess.run([sys.executable, "-m", "fp8now.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8now: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


@pytest.mark.slow
@needs_gguf
def test_run_generates_greedy_and_sampled_and_reports_memory():
    proc = fp8now("run", "--scheme", "ptpc", "--prompt", "What is a licence?", "--max-new-tokens", "4",
                  "--seed", "1", "--mode", "both")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "scheme: channel" in out and "--- greedy: " in out and "--- sampled (temperature 0.7, seed 1)" in out
    assert out.count("tokens/s") == 2
    assert "bf16 ->" in out and "fp8 incl. scales" in out and "process peak RSS" in out
    assert "backends: cpu x210" in out


@pytest.mark.slow
@needs_gguf
def test_eval_json_is_one_object_with_every_scheme(tmp_path):
    plot = tmp_path / "sqnr.png"
    proc = fp8now("eval", "--scheme", "all", "--max-tokens", "256", "--seq-len", "128", "--json",
                  "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else
    assert res["text"]["name"] == "licenses.txt" and res["text"]["tokens"] == 256
    assert list(res["schemes"]) == ["channel", "block", "tensor", "tensor-pt"]
    for key, r in res["schemes"].items():
        assert 0 < r["kl"] < 1 and 0.5 < r["top1"] <= 1, key
        assert math.isfinite(r["ppl_bf16"]) and math.isfinite(r["ppl_fp8"]) and r["ppl_bf16"] < 100, key
        assert len(r["layers"]) == 210 and all(row["sqnr_db"] > 25 for row in r["layers"]), key
    assert plot.read_bytes()[:4] == b"\x89PNG" and res["plot"] == str(plot)


@pytest.mark.slow
@needs_gguf
def test_inspect_prints_the_load_report():
    proc = fp8now("inspect", "--scheme", "fp8_block")
    assert proc.returncode == 0, proc.stderr
    assert "model.layers.29.mlp.down_proj" in proc.stdout and "SQNR dB" in proc.stdout
    assert "quantized 210 layers (block)" in proc.stdout and "left alone: lm_head" in proc.stdout


@pytest.mark.slow
@needs_gguf
def test_bad_scheme_lists_the_valid_names():
    line = one_error_line(fp8now("run", "--scheme", "int4"))
    assert "'int4'" in line and "ptpc" in line and "tensor-pt" in line


@pytest.mark.slow
@needs_gguf
def test_missing_model_folder_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    line = one_error_line(fp8now("inspect", str(missing)))
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
    assert main(["eval", str(tiny_dir), "--scheme", "block", "--text", str(text), "--seq-len", "100",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "t.txt: 360 tokens in 4 windows" in out
    assert "ppl bf16" in out and "KL(bf16||fp8)" in out and "\nblock " in out
    assert "model.layers.1.mlp.down_proj" in out


def test_errors_are_one_line_and_debug_shows_the_traceback(tiny_dir, capsys):
    assert main(["eval", str(tiny_dir), "--text", "/no/such/file.txt"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read --text /no/such/file.txt" in err
    assert main(["inspect", str(tiny_dir), "--device", "tpu:x"]) == 1
    assert "unknown device" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        main(["inspect", "/no/such/model", "--debug"])
