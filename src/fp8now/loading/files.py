"""The Hugging Face checkpoint layout: which safetensors files, which tensors (headers only), and
the errors for a missing, truncated or corrupt file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..hf.folder import INDEX_NAME, SINGLE_NAME, check_file, read_index

# safetensors dtype names -> torch dtypes (for the float checks before any data is read).
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of the index, or `model.safetensors`; each one checked
    to be a regular file inside the folder before anything opens it (hf.folder)."""
    index = model_dir / INDEX_NAME
    if os.path.lexists(index):
        if os.path.lexists(model_dir / SINGLE_NAME):
            raise ValueError(f"{model_dir} holds both {SINGLE_NAME} and {INDEX_NAME}: fp8now would read the "
                             f"index's shards, transformers reads {SINGLE_NAME}, and they may hold different "
                             "weights; remove the one that is stale")
        names = list(dict.fromkeys(read_index(model_dir).values()))
        missing = [n for n in names if not os.path.lexists(model_dir / n)]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) {', '.join(missing)}, missing from {model_dir}; "
                                    "re-download the checkpoint")
        return [check_file(model_dir, n) for n in names]
    if os.path.lexists(model_dir / SINGLE_NAME):
        return [check_file(model_dir, SINGLE_NAME)]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return [check_file(model_dir, p.name) for p in others]
    bins = sorted(p.name for p in model_dir.glob("*.bin"))
    hint = f" (found {', '.join(bins[:3])}: convert them to safetensors first)" if bins else ""
    raise FileNotFoundError(f"{model_dir} holds no {SINGLE_NAME} or {INDEX_NAME}{hint}")


def index_map(model_dir: Path) -> dict[str, str] | None:
    """The index's tensor -> file-name map (checked: hf.folder.read_index), or None for an unsharded checkpoint."""
    return read_index(model_dir) if os.path.lexists(model_dir / INDEX_NAME) else None


def corrupt_error(path: Path, e: Exception) -> ValueError:
    """The error for a safetensors file that cannot be parsed or read."""
    return ValueError(f"{path}: cannot read it as safetensors ({e}); the file is truncated or corrupt; "
                      "re-download it")


def scan_headers(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, safetensors dtype) of every tensor in `path`, in file order; reads no data."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = []
            for key in f.keys():
                sl = f.get_slice(key)
                out.append((key, tuple(sl.get_shape()), sl.get_dtype()))
            return out
    except Exception as e:  # SafetensorError, OSError, ...: all mean the file cannot be used
        raise corrupt_error(path, e) from None
