"""MODEL as a Hugging Face repo id (`org/name`), resolved by huggingface_hub to a snapshot folder.

huggingface_hub does the work, so its conventions hold: the cache in `HF_HUB_CACHE` / `HF_HOME`,
`HF_HUB_OFFLINE=1` (cache only, the Hub is never asked), `HF_TOKEN` for gated repos. Only the files
a safetensors checkpoint and its tokenizer need are fetched (no .bin / .gguf / .pth duplicates).
"""

from __future__ import annotations

import re
from pathlib import Path

# owner/name as the Hub spells them (letters, digits, - _ .), or a bare canonical name like "gpt2"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt"]


def looks_like_repo_id(arg: str) -> bool:
    """True for `org/name` or `name` that could be a repo id (not a path like ./x, /x, ~/x or a/b/c)."""
    return _REPO_ID.fullmatch(arg) is not None and ".." not in arg and not arg.endswith(".")


def snapshot(repo_id: str) -> Path:
    """The local snapshot folder of `repo_id` (downloaded unless cached or offline); a clear error if
    it is neither cached nor reachable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES))
    except GatedRepoError:
        raise PermissionError(f"{repo_id!r} is a gated Hugging Face repo: accept its terms on the Hub and "
                              "log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r} is neither a folder nor a Hugging Face repo (or it is private: "
                                "log in with `hf auth login` or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set, so the Hub was not asked" if constants.HF_HUB_OFFLINE
               else "the Hub could not be reached")
        raise FileNotFoundError(f"{repo_id!r} is neither a folder nor in the Hugging Face cache "
                                f"{constants.HF_HUB_CACHE} ({why}); download it where the Hub is reachable "
                                f"(`hf download {repo_id}`) or pass a checkpoint folder") from None
