"""Where sensitivity results live: `<cache>/sensitivity/<checkpoint digest>/<scheme>-<settings digest>.json`.

The checkpoint digest is a sha256 over the names and contents of its safetensors files and its small
description files (config.json, generation and tokenizer files: they decide the text the pass generates).
Hashing a large checkpoint takes a while, so each file's sha256 is remembered in `digests.json` beside the
results, under its path, size and modification time: a file rewritten in place gets a new time and is hashed
again. Results are written atomically (fp8now.atomic), so readers never see half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..atomic import write_atomically
from ..cache import cache_root
from ..loading.files import checkpoint_files

SUBDIR = "sensitivity"
VERSION = 4   # bump when the scores change meaning: older results are then computed again
# Small files of a checkpoint folder that change what the pass generates or scores.
DESCRIPTION_GLOBS = ("*.json", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt", "*.tiktoken")
_CHUNK = 1 << 24


def folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """`<cache>/sensitivity` (the fp8now cache folder of models.cache_root)."""
    return cache_root(cache_dir) / SUBDIR


def checkpoint_digest(model_dir: Path, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 (hex) of the checkpoint's safetensors and description files, by name and content."""
    files = {p.resolve() for p in checkpoint_files(model_dir)}
    files |= {p.resolve() for pattern in DESCRIPTION_GLOBS for p in model_dir.glob(pattern) if p.is_file()}
    memo_path = folder(cache_dir) / "digests.json"
    memo = _read_json(memo_path) or {}
    h = hashlib.sha256()
    changed = False
    for path in sorted(files, key=lambda p: p.name):
        st = path.stat()
        stamp = f"{path}:{st.st_size}:{st.st_mtime_ns}"
        if stamp not in memo:
            memo[stamp] = file_sha256(path)
            changed = True
        h.update(f"{path.name}\0{memo[stamp]}\n".encode())
    if changed:
        write_json(memo_path, memo)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 (hex) of one file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def result_path(model_dir: Path, scheme: str, settings: dict,
                cache_dir: str | os.PathLike | None = None) -> Path:
    """The results file of this checkpoint, scheme key and pass settings (any JSON-able dict)."""
    text = json.dumps({"version": VERSION, "scheme": scheme, **settings}, sort_keys=True)
    settings_digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return folder(cache_dir) / checkpoint_digest(model_dir, cache_dir)[:32] / f"{scheme}-{settings_digest}.json"


def read(path: Path) -> dict | None:
    """A stored result of this VERSION, or None (absent, unreadable, older)."""
    record = _read_json(path)
    return record if isinstance(record, dict) and record.get("version") == VERSION else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj) -> Path:
    """`obj` as indented JSON at `path`, written atomically (parents created)."""
    text = json.dumps(obj, indent=1).encode()
    return write_atomically(path, lambda f: f.write(text))
