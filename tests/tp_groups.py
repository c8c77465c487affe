"""The two process groups the tensor-parallel tests share (test_tp.py, test_tp_moe.py): one of 2 ranks and
one of 4, started once per test run, running every scenario those tests check in turn.

A spawned rank imports torch, transformers and fp8now before any work (about 5 CPU-seconds), so the tests
no longer start a group each: each group's ranks run the scenarios one after the other (tp_worker.run)
and write their results to files, which each test reads and checks against its own TP=1 reference. And
the ranks are not spawned: one fresh launcher process imports what they import, then forks the 2 ranks,
and after them the 4 (a fresh process has one thread, so forking it is safe; a pytest worker has more).
The checkpoints and results live in the run's shared folder (conftest's FP8NOW_TEST_SHARED): the first
pytest worker to ask builds them under a lock, the others wait for it and read them.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import importlib
import multiprocessing
import os
import shutil
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from moe_tiny import moe_model, save_moe
from tiny import tiny_model
from tp_worker import run

# Sizes where every shard at TP=2 and TP=4 falls on 128: 8 heads of 64, 8 key/value heads.
ALIGNED = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
FAMILIES = ("phi3", "gemma", "qwen3")
FAMILY_RUNS = (*FAMILIES, "phi3+packed")
# MoE runs, "mode:scheme:tp_invariant[:sibling folder][@backend]" (tp_worker._moe)
QWEN3_RUNS = [*(f"{m}:{s}:1" for m in ("ep", "tp") for s in ("tensor", "channel", "block")),
              "ep:channel:0", "tp:channel:0", "plan:block:0", "tp:block:1@reference"]
QWEN3_NAN_RUNS = ["ep:channel:0:nan", "tp:channel:0:nan"]
GPT_OSS_RUNS = ["ep:tensor:1", "tp:tensor:1", "tp:channel:1", "tp:channel:0"]
LLAMA4_RUNS = ["ep:tensor:1", "tp:tensor:1", "tp:channel:0"]
MIXTRAL_RUNS = ["ep:tensor:1", "tp:channel:1", "tp:tensor:0", "ep:channel:0"]
MIXTRAL_REFUSED = "plan:block:1"
QWEN3_MOE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, vocab_size=512,
                 moe_intermediate_size=256)
# What the ranks import, imported once by the launcher before it forks them.
PRELOAD = ["fp8now.loading.load", "fp8now.loading.reload", "fp8now.parallel.plan", "safetensors.torch", "transformers",
           *(f"transformers.models.{family}.modeling_{family}" for family in (
               "llama", "qwen2", "qwen3", "gemma", "phi3", "qwen3_moe", "mixtral", "gpt_oss", "llama4"))]


def save_dense(directory: Path, family: str, seed: int = 0, **sizes) -> Path:
    tiny_model(family, seed=seed, tie=False, **sizes).save_pretrained(directory)
    return directory


def moe_checkpoint(folder: Path, family: str, hidden: int, inter: int) -> Path:
    """save_moe(family) into folder/family with `hidden` (heads of 64 from 256 on) and expert size `inter`."""
    inter_key = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
    heads = hidden // 64 if hidden >= 256 else 4
    return save_moe(family, folder, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                    head_dim=hidden // heads, vocab_size=512, **{inter_key: inter})


def _dense_nan(folder: Path) -> None:
    """The Llama of save_dense with NaN in rank 1's half of a row-parallel weight (column 200 of 320)."""
    model = tiny_model("llama", tie=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 200] = float("nan")
    model.save_pretrained(folder)


def _moe_nan(folder: Path) -> None:
    """The Qwen3-MoE of moe_checkpoint(256, 256) with one NaN in expert 5's down_proj, last intermediate column."""
    model = moe_model("qwen3_moe", **QWEN3_MOE)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[5, 7, 255] = float("nan")
    model.save_pretrained(folder)


def _two_ranks(root: Path) -> list:
    """Checkpoints of the 2-rank scenarios; the tasks, the failure (which breaks the group) last."""
    for family in FAMILIES:
        tiny_model(family).save_pretrained(root / "families" / family)
    save_dense(root / "qwen2", "qwen2", **ALIGNED)
    save_dense(root / "qwen2-new", "qwen2", seed=1, **ALIGNED)
    save_dense(root / "llama", "llama")
    _dense_nan(root / "nan")
    qwen3 = moe_checkpoint(root / "moe", "qwen3_moe", hidden=256, inter=256)
    _moe_nan(root / "moe" / "nan")   # the sibling folder "nan" of QWEN3_NAN_RUNS
    other = save_moe("qwen3_moe", root / "moe-other", seed=5, **QWEN3_MOE)
    gpt_oss, llama4 = (save_moe(f, root / "moe", vocab_size=512) for f in ("gpt_oss", "llama4_text"))
    return [("schemes", "schemes", root / "qwen2", root / "qwen2-new"),
            ("families", "families", root / "families", ",".join(FAMILY_RUNS)),
            ("gpt_oss", "moe", gpt_oss, ",".join(GPT_OSS_RUNS)),
            ("llama4", "moe", llama4, ",".join(LLAMA4_RUNS)),
            ("moe_reload", "moe_reload", qwen3, other),
            ("qwen3_moe", "moe", qwen3, ",".join([*QWEN3_RUNS, *QWEN3_NAN_RUNS])),
            ("unaligned", "unaligned", root / "llama", ""),
            ("failure", "failure", root / "nan", root / "llama")]


def _four_ranks(root: Path) -> list:
    save_dense(root / "llama", "llama", **ALIGNED)
    save_dense(root / "llama-new", "llama", seed=1, **ALIGNED)
    mixtral = moe_checkpoint(root / "moe", "mixtral", hidden=128, inter=128)
    return [("schemes", "schemes", root / "llama", root / "llama-new"),
            ("mixtral", "moe", mixtral, ",".join([*MIXTRAL_RUNS, MIXTRAL_REFUSED]))]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(groups: list) -> None:
    """The launcher (a fresh process): the ranks' imports, then each (size, tasks, results folder) group's
    ranks forked from here, one group after the other."""
    for module in PRELOAD:
        importlib.import_module(module)
    for size, tasks, out in groups:
        mp.start_processes(run, args=(size, _port(), tasks, out), nprocs=size, start_method="fork")


def _start(root: Path) -> None:
    groups = []
    for size, build in ((2, _two_ranks), (4, _four_ranks)):
        (root / f"tp{size}").mkdir()
        (root / f"tp{size}" / "out").mkdir()
        tasks = [tuple(map(str, task)) for task in build(root / f"tp{size}")]
        groups.append((size, tasks, str(root / f"tp{size}" / "out")))
    launcher = multiprocessing.get_context("spawn").Process(target=_launch, args=(groups,))
    launcher.start()
    launcher.join()
    if launcher.exitcode != 0:
        raise RuntimeError(f"the ranks' launcher failed (exit status {launcher.exitcode}; its traceback is in "
                           "this test's captured stderr)")


@functools.lru_cache(maxsize=None)
def _base() -> Path:
    shared = os.environ.get("FP8NOW_TEST_SHARED")
    if shared:
        return Path(shared)
    base = Path(tempfile.mkdtemp(prefix="fp8now-test-tp-"))
    atexit.register(shutil.rmtree, base, True)
    return base


@functools.lru_cache(maxsize=None)
def _groups() -> Path:
    """The folder holding tp2/ and tp4/ (checkpoints, out/<rank>.pt), the groups run by the first caller of
    this test run; a failed run is reported again to later callers."""
    root = _base() / "tp"
    with open(_base() / "tp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        if (root / "failed").exists():
            raise RuntimeError(f"the TP groups failed in another test:\n{(root / 'failed').read_text()}")
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            try:
                _start(root)
            except BaseException:
                (root / "failed").write_text(traceback.format_exc())
                raise
            (root / "done").write_text("")
    return root


@functools.lru_cache(maxsize=None)
def group(size: int) -> tuple[Path, list[dict]]:
    """(folder of the checkpoints, each rank's {task name: result}) of the `size`-rank group (2 or 4)."""
    root = _groups() / f"tp{size}"
    return root, [torch.load(root / "out" / f"{r}.pt", weights_only=False) for r in range(size)]
