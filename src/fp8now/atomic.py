"""Files that readers never see half-written: written to a new sibling, then renamed into place."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, write) -> Path:
    """Call `write(binary file)` on a new sibling (mode 0666 less the umask, like any new file), then
    rename it to `path` (its parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
