"""The one format of `benchmarks/results/*.json`: {"meta": {date, gpu, torch, triton, commit, command},
"rows": [...]}, written whole through a temporary file so a run cut short leaves a readable file."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile

import torch

META_KEYS = ("date", "gpu", "torch", "triton", "commit", "command")


HERE = os.path.dirname(os.path.abspath(__file__))
CLAIM = "FP8NOW_COMMIT"   # "<commit> <tree>": the commit the caller says this checkout's files are


def _git(*args: str, cwd: str = HERE, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, cwd=cwd, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tree(cwd: str = HERE) -> str | None:
    """The git tree hash of the checkout's files as they are (tracked and untracked, less the ignored ones),
    through a scratch index: the `<commit>^{tree}` of the commit whose code this is, whatever HEAD says."""
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
        top = _git("rev-parse", "--show-toplevel", cwd=cwd)
        if not top or _git("add", "-A", ".", cwd=top, env=env) is None:
            return None
        return _git("write-tree", cwd=top, env=env)


def commit(cwd: str = HERE) -> str | None:
    """The short commit whose files the checkout holds: HEAD where they are HEAD's; else the commit named by
    FP8NOW_COMMIT="<commit> <tree>" where its tree is the files' (the device tool copies a working tree into a
    checkout whose HEAD stays at its first call's commit: `FP8NOW_COMMIT="$(git log -1 --format='%h %T')"`,
    expanded on the machine that has the history); else HEAD + "+dirty" (the measured code is no commit's).
    None outside a git checkout."""
    head = _git("rev-parse", "--short", "HEAD", cwd=cwd)
    if not head:
        return None
    now = tree(cwd)
    if now is not None and now == _git("rev-parse", "HEAD^{tree}", cwd=cwd):
        return head
    claimed = os.environ.get(CLAIM, "").split()
    if now is not None and len(claimed) == 2 and claimed[1] == now:
        return claimed[0]
    return head + "+dirty"


GPU_TAGS = ("h200", "h100")   # the part of a device's name that names its results files (model_h200.json)


def gpu_tag(device: str = "cuda") -> str:
    """The results files' name for `device`'s GPU: "h200" or "h100" by its name, "gpu" for any other, "cpu"
    where no GPU is used (`gpu_session.sh` names its files by it too)."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((tag for tag in GPU_TAGS if tag in name), "gpu")


def meta(device: str = "cuda", argv: list[str] | None = None) -> dict:
    """Where and how a result was measured: UTC date, device name, library versions, commit, command."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else "cpu"
    argv = sys.argv if argv is None else argv
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), gpu=gpu,
                torch=torch.__version__, triton=triton_version, commit=commit(),
                command=" ".join(shlex.quote(a) for a in ["python3", *argv]))


def write(path: str, info: dict, rows: list[dict]) -> None:
    """Replace `path` with {"meta": info, "rows": rows}; `info` must hold exactly META_KEYS."""
    if tuple(sorted(info)) != tuple(sorted(META_KEYS)):
        raise ValueError(f"meta needs exactly {META_KEYS}, got {sorted(info)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"meta": info, "rows": rows}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def read(path: str) -> tuple[dict, list[dict]]:
    """(meta, rows) of a results file; a clear error names the file if it is not in this format."""
    with open(path) as f:
        data = json.load(f)
    if not (isinstance(data, dict) and isinstance(data.get("meta"), dict) and isinstance(data.get("rows"), list)):
        raise ValueError(f"{path}: not a results file ({{'meta': {{...}}, 'rows': [...]}}); "
                         "rerun its benchmark to write one")
    return data["meta"], data["rows"]


def continued(path: str, info: dict, keep) -> tuple[dict, list[dict]]:
    """(meta, rows) to continue a run split over several calls: the rows of `path` for which `keep(row)`
    holds, which must come from the same commit and GPU as `info` (ratios are taken between its rows);
    the command becomes both calls' commands."""
    old, rows = read(path)
    if (old["commit"], old["gpu"]) != (info["commit"], info["gpu"]):
        raise SystemExit(f"{path} was measured at {old['commit']} on {old['gpu']}, this run is {info['commit']} "
                         f"on {info['gpu']}: run it all again without --add")
    return dict(info, command=f"{old['command']} ; {info['command']}"), [r for r in rows if keep(r)]
