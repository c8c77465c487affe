"""Never run code from a checkpoint folder: transformers' config and tokenizer loaders with
`trust_remote_code=False` (no "run the custom code? [y/N]" prompt), and one clear error for a folder
whose config or tokenizer exists only as its own Python code (`auto_map`)."""

from __future__ import annotations

import json
from pathlib import Path

# transformers' refusal when a folder needs its own code and trust_remote_code=False.
_REFUSAL_MARKERS = ("custom code", "trust_remote_code")


class CustomCodeError(ValueError):
    """A checkpoint folder needs its own Python code, which fp8now never runs."""


def custom_code_error(model_dir: Path, what: str) -> CustomCodeError:
    """The one-line error for a folder whose `what` (config, tokenizer) needs the folder's own code."""
    files = [name for name in ("config.json", "tokenizer_config.json") if _has_auto_map(model_dir / name)]
    where = f" ({' and '.join(files)} name it under auto_map)" if files else ""
    return CustomCodeError(f"{model_dir}: its {what} needs custom Python code from the folder{where}; fp8now "
                      "never runs code from a checkpoint folder: use a checkpoint whose architecture and "
                      "tokenizer are built into transformers")


def _has_auto_map(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "auto_map" in data


def _refused(e: Exception) -> bool:
    return any(marker in str(e) for marker in _REFUSAL_MARKERS)


def load_tokenizer(model_dir: Path | str, **kwargs):
    """`AutoTokenizer.from_pretrained` that never runs the folder's code (kwargs: e.g. `gguf_file`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False, **kwargs)
    except ValueError as e:
        if _refused(e):
            raise custom_code_error(Path(model_dir), "tokenizer") from None
        raise


def load_config(model_dir: Path | str):
    """`AutoConfig.from_pretrained` that never runs the folder's code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except ValueError as e:
        if _refused(e):
            raise custom_code_error(Path(model_dir), "config") from None
        raise
