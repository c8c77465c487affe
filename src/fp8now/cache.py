"""The fp8now cache folder (the converted default model, the compiled CPU quantizers) and its file lock."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else `$FP8NOW_CACHE`, else `$XDG_CACHE_HOME/fp8now` (an absolute
    path, as the XDG spec requires), else `~/.cache/fp8now`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("FP8NOW_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return (xdg if xdg.is_absolute() else Path.home() / ".cache") / "fp8now"


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing, never deleted) for the block."""
    try:
        import fcntl
    except ImportError:
        raise RuntimeError(f"building the cache in {path.parent} needs file locking (the fcntl module), "
                           "which this platform lacks; pass a model folder or a Hugging Face repo id, or copy "
                           f"an already built cache folder into {path.parent}") from None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another converter holds it
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
