"""The one format of `benchmarks/results/*.json`: {"meta": {date, gpu, torch, triton, commit, command},
"rows": [...]}, written whole through a temporary file so a run cut short leaves a readable file."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys

import torch

META_KEYS = ("date", "gpu", "torch", "triton", "commit", "command")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    """The checkout's short commit, "+dirty" when tracked files differ from it (the measured code is
    then not that commit's), or None outside a git checkout."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + "+dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


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
