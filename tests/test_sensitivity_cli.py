"""`fp8now sensitivity` and `--keep-bf16` on a tiny real checkpoint, with their own cache folder: sensitivity
--json as a real subprocess, the text runs and inspect --keep-bf16 through main() in this process (cli_here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_here import fp8now_here
from fp8now import Fp8Config
from fp8now.cli.output import SCHEMA_KEYS
from fp8now.sensitivity.score import sensitivity

from test_cli import one_error_line
from test_sensitivity import tiny_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow   # the CLI as a subprocess (the suite's convention; still run by default)


@pytest.fixture()
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def fp8now(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FP8NOW_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "fp8now", *args], capture_output=True, text=True, env=env,
                          timeout=900)


@pytest.fixture
def here(cache, monkeypatch, capsys):
    """`fp8now ARGS` in this process with `cache` as FP8NOW_CACHE."""
    monkeypatch.setenv("FP8NOW_CACHE", str(cache))
    return lambda *args: fp8now_here(capsys, *args)


def test_json_ranks_every_layer_plots_and_caches(tiny_dir, cache, tmp_path, monkeypatch):
    plot = tmp_path / "sens.png"
    proc = fp8now(cache, "sensitivity", str(tiny_dir), "--scheme", "ptpc", "--json", "--plot", str(plot),
                  "--keep-bf16", "auto:0.2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)                          # one object and nothing else on stdout
    assert tuple(res) == SCHEMA_KEYS and res["command"] == "sensitivity" and res["device"] == "cpu"
    assert list(res["schemes"]) == ["channel"] and res["args"]["keep_bf16"] == "auto:0.2"
    entry = res["schemes"]["channel"]
    assert entry["config"]["scheme"] == "channel" and len(entry["report"]["layers"]) == 14
    out = entry["results"]
    assert out["cached"] is False and Path(out["cache_file"]).is_file() and out["tokens"] == 6 * 40
    ranking = out["ranking"]
    assert [r["rank"] for r in ranking] == list(range(1, 15))
    assert all(a["score"] >= b["score"] for a, b in zip(ranking, ranking[1:]))
    kept = [r["name"] for r in ranking if r["keep_bf16"]]
    assert kept == out["keep"]["layers"] and out["keep"]["kept_bytes"] <= 0.2 * out["keep"]["total_bytes"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out["plot"] == str(plot)
    monkeypatch.setenv("FP8NOW_CACHE", str(cache))      # the same cache, read in this process
    record = sensitivity(tiny_dir, Fp8Config(scheme="channel"), "cpu")
    assert record["cached"] is True
    assert {r["name"]: r["score"] for r in record["layers"]} == {r["name"]: r["score"] for r in ranking}


def test_text_says_it_read_the_cache_and_bad_values_are_one_line(tiny_dir, here):
    first = here("sensitivity", str(tiny_dir), "--scheme", "block", "--top", "3")
    assert first.returncode == 0, first.stderr
    assert "scored in" in first.stdout and "cached in" in first.stdout
    second = here("sensitivity", str(tiny_dir), "--scheme", "block", "--top", "3")
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    assert "read from the cache" in lines[1] and lines[3].split()[:2] == ["rank", "layer"]
    assert [line.split()[0] for line in lines[5:8]] == ["1", "2", "3"] and lines[8] == "... 11 more (--top 0 shows all)"
    assert any(line.startswith("keep_bf16='auto:0.05' keeps ") for line in lines)
    error = one_error_line(here("sensitivity", str(tiny_dir), "--keep-bf16", "0.05"))
    assert "keep_bf16='0.05': expected 'auto:F' with 0 <= F < 1" in error


def test_inspect_with_keep_bf16_reports_what_it_kept(tiny_dir, here):
    proc = here("inspect", str(tiny_dir), "--keep-bf16", "auto:0.3", "--json")
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)["schemes"]["channel"]
    assert entry["config"]["keep_bf16"] == "auto:0.3"
    keep = entry["report"]["keep_bf16"]
    assert keep["layers"] and keep["kept_bytes"] <= 0.3 * keep["total_bytes"]
    reasons = dict(entry["report"]["ignored"])
    assert all(reasons[name].startswith("kept in bf16 by keep_bf16='auto:0.3'") for name in keep["layers"])
    assert len(entry["report"]["layers"]) == 14 - len(keep["layers"])
