"""`fp8now run`, `eval` and `inspect` on a tiny Mixtral checkpoint folder (save_pretrained with a byte
tokenizer) through main() in this process (cli_here): the experts are quantized, listed and used; and the
README's MoE snippet and commands (inspect and run on a tiny Qwen3-MoE) as written, as real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_here import fp8now_here
from moe_tiny import save_moe

from fp8now.cli.output import SCHEMA_KEYS
from test_evaluate import save_byte_tokenizer
from test_models import embedded_model_dir, needs_gguf
from hang import HANG_S

pytestmark = pytest.mark.slow
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = save_moe("mixtral", tmp_path_factory.mktemp("moe_cli"), seed=2, spread=1)
    save_byte_tokenizer(path)
    return path


@pytest.fixture
def fp8now(capsys):
    """`fp8now ARGS --device cpu` in this process; it must succeed."""
    def call(*args: str) -> subprocess.CompletedProcess:
        proc = fp8now_here(capsys, *args, "--device", "cpu")
        assert proc.returncode == 0, proc.stderr
        return proc
    return call


def test_inspect_lists_the_experts_modules(mixtral, fp8now):
    out = fp8now("inspect", str(mixtral), "--scheme", "block").stdout
    row = next(line.split() for line in out.splitlines() if line.startswith("experts "))
    assert row[1] == "2" and row[-1] in EXPERTS
    for name in EXPERTS:
        assert f"experts: {name} E=4 H=128 I=192 block act=group cpu bias=no" in out
    assert "quantized 8 layers (block) and 2 experts modules (8 experts, block)" in out
    data = json.loads(fp8now("inspect", str(mixtral), "--scheme", "channel", "--json").stdout)
    assert tuple(data) == SCHEMA_KEYS and data["command"] == "inspect"
    entry = data["schemes"]["channel"]
    experts = entry["report"]["experts"]
    assert [r["name"] for r in experts] == EXPERTS
    assert all((r["num_experts"], r["hidden"], r["intermediate"], r["scheme"]) == (4, 128, 192, "channel")
               for r in experts)
    summary = {r["type"]: r for r in entry["results"]["summary"]}
    worst = min(experts, key=lambda r: r["min_sqnr_db"])
    assert summary["experts"]["count"] == 2 and summary["experts"]["sqnr_min_db"] == worst["min_sqnr_db"]
    assert summary["experts"]["worst_layer"] == worst["name"] and 25 < worst["min_sqnr_db"]


def test_run_generates_with_fp8_experts(mixtral, fp8now):
    data = json.loads(fp8now("run", str(mixtral), "--max-new-tokens", "4", "--mode", "both", "--json").stdout)
    entry = data["schemes"]["channel"]
    assert [r["name"] for r in entry["report"]["experts"]] == EXPERTS
    assert [g["new_tokens"] for g in entry["results"]["generations"]] == [4, 4]
    text = fp8now("run", str(mixtral), "--max-new-tokens", "3").stdout
    assert "backends: cpu x8, cpu (experts) x2" in text and "2 experts modules" in text


def test_eval_compares_the_fp8_experts_with_bf16(mixtral, fp8now, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Mixture-of-experts layers route each token to two of four experts. " * 6)
    data = json.loads(fp8now("eval", str(mixtral), "--scheme", "all", "--text", str(text), "--seq-len", "64",
                             "--json").stdout)
    assert list(data["schemes"]) == ["channel", "block", "tensor", "tensor-tensor"]
    for key, entry in data["schemes"].items():
        r = entry["results"]
        assert 0 < r["kl"] < 0.1 and 0.5 < r["top1"] <= 1, (key, r["kl"], r["top1"])
        assert [e["name"] for e in entry["report"]["experts"]] == EXPERTS, key
    # tensor-tensor: per-tensor activations in the dense layers, per-token ones in the experts
    assert {e["act"] for e in data["schemes"]["tensor-tensor"]["report"]["experts"]} == {"token"}
    assert data["schemes"]["tensor-tensor"]["config"]["activation"] == "tensor"


@needs_gguf
def test_the_readme_moe_snippet_and_commands_run_as_written(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Mixture-of-experts models")[1].split("\n## ")[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (commands,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    path, _ = embedded_model_dir()
    env = {**os.environ, "FP8NOW_CACHE": str(path.parent)}
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    outs = []
    for line in commands.strip().splitlines():
        args = line.split("#")[0].split()
        assert args[:3] == ["python3", "-m", "fp8now"]
        proc = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=HANG_S)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert "experts: model.layers.1.mlp.experts E=8 H=256 I=256 block" in outs[0]
    assert "backends: cpu x8, cpu (experts) x2" in outs[1] and "--- greedy: 8 tokens" in outs[1]
