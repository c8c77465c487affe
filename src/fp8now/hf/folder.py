"""What fp8now opens in a checkpoint folder, checked before it opens it: regular files inside the folder (or the
Hugging Face cache's own links from a snapshot into its blobs), never a FIFO, device or socket (which could block
a read forever or never end), never a path that leaves the folder; and the safetensors index read strictly
(each tensor named once, every value a file name inside the folder)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The files of a folder that fp8now or transformers' config / tokenizer loaders open (checked when present).
OPENED = ("config.json", "generation_config.json", INDEX_NAME, SINGLE_NAME, "tokenizer.json",
          "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
OPENED_SUFFIXES = (".tiktoken",)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _roots(model_dir: Path) -> list[Path]:
    """Where a file of `model_dir` may really live: the folder, and for a hub cache snapshot its blobs."""
    real = model_dir.resolve()
    roots = [real]
    if model_dir.parent.name == "snapshots":   # <cache>/models--org--name/snapshots/<revision>
        roots.append((model_dir.parent.parent / "blobs").resolve())
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def check_file(model_dir: Path, name: str) -> Path:
    """`model_dir / name` after checking, without opening it, that it is a regular file inside the folder (a
    symlink only into the folder or, in the hub cache, its blobs). Missing: FileNotFoundError from os."""
    path = model_dir / name
    target = path.resolve()
    if not _inside(target, _roots(model_dir)):
        raise ValueError(f"{path} leads to {target}, outside the model folder; fp8now reads only files inside "
                         f"{model_dir} (or the Hugging Face cache's own links into its blobs): copy the file "
                         "into the folder")
    info = os.stat(path)
    kind = next((what for test, what in _KINDS if test(info.st_mode)), None)
    if kind is not None or not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is {kind or 'a special file'}, not a regular file; fp8now opens only "
                         "regular files (reading anything else could block or never end): replace it with the "
                         "real file")
    return path


def check_folder(model_dir: Path) -> None:
    """Every file of OPENED present in `model_dir` is a regular file inside it (see check_file)."""
    try:
        names = [e.name for e in os.scandir(model_dir)]
    except OSError:
        return   # a missing or unreadable folder: the config reader says so with its own error
    for name in names:
        if name in OPENED or name.endswith(OPENED_SUFFIXES):
            check_file(model_dir, name)


def _no_repeats(index: Path):
    """json object_pairs_hook: an object (the weight_map) that names a key twice is refused, naming it."""
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{index} lists {key!r} twice ({out[key]!r} and {value!r}); an index names each "
                                 "tensor once: regenerate it or re-download the checkpoint")
            out[key] = value
        return out
    return hook


def read_index(model_dir: Path) -> dict[str, str]:
    """The index's tensor -> file map, every field checked: JSON, a `weight_map` object of names -> file names,
    each file a relative path inside the folder and a regular file (check_file)."""
    index = check_file(model_dir, INDEX_NAME)
    try:
        raw = json.loads(index.read_text(), object_pairs_hook=_no_repeats(index))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); "
                         "re-download it") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        got = type(weight_map).__name__ if isinstance(raw, dict) and "weight_map" in raw else "missing"
        raise ValueError(f"{index} is not a valid safetensors index (its 'weight_map' must be an object of "
                         f"tensor name -> file name, got {got}); re-download it")
    files: set[str] = set()
    for key, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise ValueError(f"{index}: weight_map[{key!r}] must be a file name, got {fname!r}; re-download it")
        if fname not in files:
            pure = PurePosixPath(fname)
            if pure.is_absolute() or ".." in pure.parts or "\\" in fname:
                raise ValueError(f"{index}: weight_map[{key!r}] = {fname!r} leaves the model folder; an index "
                                 "names files inside its own folder: the index is corrupt or hostile, re-download it")
            files.add(fname)
    return weight_map
