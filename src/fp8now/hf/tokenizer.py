"""The checkpoint's tokenizer, loaded before any weight is read so a missing one fails at once."""

from __future__ import annotations

from pathlib import Path

# The file sets a transformers tokenizer is built from (any one of them is enough).
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"),
                   ("vocab.txt",), ("*.tiktoken",))


def _present(model_dir: Path, names: tuple[str, ...]) -> bool:
    return all(any(model_dir.glob(n)) if "*" in n else (model_dir / n).is_file() for n in names)


def has_tokenizer(model_dir: Path) -> bool:
    """Whether `model_dir` holds one of the TOKENIZER_FILES sets."""
    return any(_present(model_dir, names) for names in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path):
    """`AutoTokenizer` of `model_dir`; an error naming the folder and the files it lacks otherwise."""
    from .custom_code import CustomCodeError, load_tokenizer as load_builtin
    from .folder import check_folder

    check_folder(Path(model_dir))   # no FIFO, device or outside link is opened as a tokenizer file
    found = [" + ".join(names) for names in TOKENIZER_FILES if _present(model_dir, names)]
    if not found:
        wanted = ", ".join(" + ".join(names) for names in TOKENIZER_FILES)
        raise FileNotFoundError(f"{model_dir} has no tokenizer files (none of: {wanted}); copy the "
                                "tokenizer files of the original checkpoint into it (tokenizer.json and "
                                "tokenizer_config.json usually)")
    try:
        return load_builtin(model_dir)   # trust_remote_code=False: never the folder's own code
    except CustomCodeError:
        raise
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{model_dir}: its tokenizer ({', '.join(found)}) cannot be loaded: {first}; "
                         "re-copy the tokenizer files of the original checkpoint") from None


def check_token_ids(ids, model_dir: Path) -> None:
    """Every token id of `ids` (a tensor) is a row of the model's embedding (config.json's vocab_size); else one
    clear error instead of an index error deep inside the embedding."""
    from .custom_code import load_config

    if not ids.numel():
        return
    rows = load_config(model_dir).get_text_config().vocab_size
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        bad = high if high >= rows else low
        raise ValueError(f"{model_dir}: the tokenizer gives token id {bad}, but the model's embedding has {rows} "
                         f"rows (ids 0-{rows - 1}, vocab_size in config.json); the tokenizer does not belong to "
                         "this model: copy the tokenizer files of the original checkpoint")
