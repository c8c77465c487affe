"""The CLI as a user meets it (issue 42), on tiny checkpoints: with --json a failure still prints one JSON object
(command, error type, message) and keeps its exit status; quantize --json prints JSON and its text names the
experts it wrote and what transformers cannot read; a tokenizer whose ids the model's vocabulary lacks fails at
once, by name, in run and eval. eval's JSON error comes from a real subprocess (`cli`); the other calls go
through main() in this process (`here`, cli_here; quantize runs as a real subprocess in test_export.py),
reading the same stdout, stderr and status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_here import fp8now_here
from moe_tiny import save_moe
from test_evaluate import save_byte_tokenizer
from tiny import write_tiny_checkpoint

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "fp8now", *args, "--device", "cpu"], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture
def here(capsys):
    return lambda *args: fp8now_here(capsys, *args, "--device", "cpu")


def json_error(proc: subprocess.CompletedProcess, command: str, kind: str) -> str:
    """The one JSON error object on stdout (and the one line on stderr); returns its message."""
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = json.loads(proc.stdout)   # the whole of stdout is one JSON object
    assert set(out) == {"command", "model", "error"} and out["command"] == command
    assert out["error"]["type"] == kind and out["error"]["message"]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("fp8now: error: ")]
    assert lines == [f"fp8now: error: {out['error']['message']}"]
    return out["error"]["message"]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A model of 128 token rows next to a byte tokenizer whose ids reach 255."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("vocab") / "llama", "llama", vocab_size=128)
    save_byte_tokenizer(folder)
    return folder


def test_json_errors_of_every_command_are_one_object_on_stdout(tmp_path, here):
    missing = str(tmp_path / "nowhere")
    for command in ("inspect", "run", "quantize"):
        extra = ("--out", str(tmp_path / "out")) if command == "quantize" else ()
        message = json_error(here(command, missing, "--json", *extra), command, "FileNotFoundError")
        assert "nowhere" in message
    text = tmp_path / "t.txt"
    text.write_text("a few words " * 20)
    json_error(cli("eval", missing, "--json", "--text", str(text)), "eval", "FileNotFoundError")   # a real process


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_tokenizer_beyond_the_models_vocabulary_fails_by_name(tmp_path, small_vocab, command, here):
    text = tmp_path / "t.txt"
    text.write_text("Zebras quietly yodel over xylophones; " * 4)
    extra = ("--prompt", text.read_text()) if command == "run" else ("--text", str(text), "--seq-len", "16")
    message = json_error(here(command, str(small_vocab), "--json", *extra), command, "ValueError")
    assert "the tokenizer gives token id" in message and "embedding has 128 rows" in message
    ids = [i for i in range(128, 256)]   # the byte tokenizer's ids beyond the model's 128 rows
    assert any(f"token id {i}," in message for i in ids)


def test_quantize_json_and_text_name_the_experts_and_what_transformers_cannot_read(tmp_path, here):
    folder = save_moe("qwen3_moe", tmp_path, seed=4, moe_intermediate_size=256)
    proc = here("quantize", str(folder), "--scheme", "block", "--out", str(tmp_path / "text"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, *warning = proc.stdout.strip().splitlines()
    experts = json.loads((folder / "config.json").read_text())
    count = experts.get("num_experts") or experts["num_local_experts"]
    assert f"2 experts modules ({2 * count} experts) in FP8" in first
    assert len(warning) == 1 and warning[0].startswith("WARNING: block-scaled MoE experts")
    proc = here("quantize", str(folder), "--scheme", "channel", "--out", str(tmp_path / "json"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["command"] == "quantize" and out["results"] == {}
    entry = out["schemes"]["channel"]
    assert entry["results"] == {"out": str(tmp_path / "json"), "format": "compressed-tensors"}
    assert len(entry["report"]["experts"]) == 2 and entry["report"]["warnings"] == []
    assert (tmp_path / "json" / "config.json").is_file()
    json_error(here("quantize", str(folder), "--out", str(tmp_path / "json"), "--json"), "quantize",
               "FileExistsError")
