"""benchmarks/timing.py and benchmarks/record.py on the CPU: every implementation a GraphTimer times
gets the same number of separate weight copies (the L2 defect was bf16 timed on one shared weight),
and results files hold exactly {"meta", "rows"}."""

import json
import math
import os
import random
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import record  # noqa: E402
import timing  # noqa: E402
from fp8now import Fp8Config, Fp8Linear  # noqa: E402


def test_copies_for_overflows_the_l2_with_the_other_copies():
    rng = random.Random(3)
    for _ in range(200):
        nbytes = rng.randint(1, 2**31)
        least = rng.randint(2, 8)
        n = timing.copies_for(nbytes, least=least)
        assert n >= least
        assert (n - 1) * nbytes >= 2 * timing.L2_BYTES or n == least
        if n > least:   # one copy fewer would not overflow it twice
            assert (n - 2) * nbytes < 2 * timing.L2_BYTES
    # the bench_linear shapes: a 4096 x 4096 FP8 weight (16.8 MB) needs 8 copies, 57344 x 8192 the least
    assert timing.copies_for(4096 * 4096) == 1 + math.ceil(2 * 50 * 2**20 / (4096 * 4096)) == 8
    assert timing.copies_for(57344 * 8192) == 4
    with pytest.raises(ValueError, match="positive"):
        timing.copies_for(0)


def test_every_implementation_gets_the_same_number_of_separate_copies():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    timer = timing.GraphTimer(copies=5)
    bf16 = timing.separate_copies(lin, timer.copies)
    fp8 = [Fp8Linear.from_linear(c, Fp8Config(scheme="channel", backend="reference")) for c in bf16]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    calls = {"bf16": timer.calls(bf16, lambda c: torch.nn.functional.linear(x, c.weight)),
             "fp8": timer.calls(fp8, lambda c: c(x))}
    assert {len(c) for c in calls.values()} == {5}
    # each call reads its own weight: distinct storage, equal values
    ptrs = [c.weight.untyped_storage().data_ptr() for c in bf16]
    assert len(set(ptrs)) == 5 and lin.weight.untyped_storage().data_ptr() not in ptrs
    assert len({c.weight.untyped_storage().data_ptr() for c in fp8}) == 5
    for c in bf16:
        assert torch.equal(c.weight, lin.weight)
    # and the calls compute what the layers do, copy by copy
    for call, c in zip(calls["bf16"], bf16):
        assert torch.equal(call(), torch.nn.functional.linear(x, lin.weight))
    ys = [call() for call in calls["fp8"]]
    assert all(torch.equal(y, ys[0]) for y in ys)


def test_a_shared_weight_or_a_different_count_is_refused():
    lin = torch.nn.Linear(64, 32, bias=False)
    timer = timing.GraphTimer(copies=3)
    with pytest.raises(ValueError, match="share a tensor"):
        timer.calls([lin, lin, lin], lambda c: c.weight)      # the defect: one weight for every call
    a, b, c = timing.separate_copies(lin, 3)
    c.weight = a.weight                                       # one shared tensor among separate ones
    with pytest.raises(ValueError, match="copies 0 and 2 share a tensor"):
        timer.calls([a, b, c], lambda m: m.weight)
    with pytest.raises(ValueError, match="takes 3 copies"):
        timer.calls(timing.separate_copies(lin, 2), lambda c: c.weight)
    with pytest.raises(ValueError, match="at least 2"):
        timing.GraphTimer(copies=1)
    tensors = timing.separate_copies(torch.randn(8, 8), 3)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 3


def test_host_ms_is_the_median_of_the_timed_calls():
    seen = []
    def fn():
        seen.append(1)
    ms = timing.host_ms(fn, reps=5)
    assert len(seen) == 6 and 0 <= ms < 1000


def test_host_ms_drains_after_every_call_outside_the_timing():
    """The drain (a GPU sync in bench_model) runs after the warm-up and after each timed call, and its time is not
    the call's: a 60 ms drain beside a call of no work."""
    order = []
    ms = timing.host_ms(lambda: order.append("call"), reps=3, drain=lambda: (order.append("drain"), time.sleep(0.06)))
    assert order == ["call", "drain"] * 4
    assert 0 <= ms < 30


def test_results_file_holds_meta_and_rows(tmp_path):
    info = record.meta("cpu", argv=["benchmarks/bench_x.py", "--quick"])
    assert set(info) == set(record.META_KEYS)
    assert info["gpu"] == "cpu" and info["torch"] == torch.__version__
    assert info["command"] == "python3 benchmarks/bench_x.py --quick"
    assert len(info["date"]) == 10 and info["date"][4] == "-"
    rows = [dict(M=1, N=2, K=3, impl="bf16", ms=0.5)]
    path = str(tmp_path / "r" / "x.json")
    record.write(path, info, rows)
    assert json.loads(open(path).read()) == {"meta": info, "rows": rows}
    assert record.read(path) == (info, rows)
    with pytest.raises(ValueError, match="exactly"):
        record.write(path, dict(info, notes="x"), rows)
    (tmp_path / "old.json").write_text(json.dumps(rows))   # the old format: a bare list of rows
    with pytest.raises(ValueError, match="old.json: not a results file"):
        record.read(str(tmp_path / "old.json"))


def test_meta_names_the_checkout_commit(monkeypatch):
    import subprocess
    monkeypatch.delenv(record.CLAIM, raising=False)
    root = os.path.join(os.path.dirname(__file__), "..")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout (a copied tree): commit is None there")
    got = record.commit()
    assert got.split("+")[0] and head.stdout.strip().startswith(got.split("+")[0])
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    assert got.endswith("+dirty") == bool(status.strip())   # a changed, new or deleted file, not an ignored one


@pytest.mark.parametrize("name, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA H100 NVL", "h100"), ("NVIDIA A100-SXM4-80GB", "gpu")])
def test_gpu_tag_names_the_results_files_by_the_gpu(monkeypatch, name, tag):
    """record.gpu_tag (gpu_session.sh's file names, bench_moe's HBM rate): the device's name as torch reports it
    (that name stood in here: this machine has no GPU), "cpu" for --device cpu whatever the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert record.gpu_tag() == tag and record.gpu_tag("cuda") == tag
    assert record.gpu_tag("cpu") == "cpu"


def test_commit_names_the_files_not_a_stale_head(tmp_path, monkeypatch):
    """record.commit in a scratch repository: HEAD while the files are HEAD's; "+dirty" once a tracked file
    changes or an untracked one appears (ignored ones do not count); a checkout whose HEAD stayed behind (the
    device tool's copy) names the commit FP8NOW_COMMIT claims only where that commit's tree is the files'."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("out/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "--short", "HEAD")
    monkeypatch.delenv(record.CLAIM, raising=False)
    cwd = str(tmp_path)
    assert record.commit(cwd) == first and record.tree(cwd) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "r.json").write_text("{}")                       # ignored: still clean
    assert record.commit(cwd) == first
    (tmp_path / "b.py").write_text("y = 2\n")                            # untracked: not the commit's files
    assert record.commit(cwd) == first + "+dirty"
    (tmp_path / "a.py").write_text("x = 3\n")
    git("add", "-A")
    git("commit", "-qm", "second")                                       # the files of a later commit ...
    second, tree = git("rev-parse", "--short", "HEAD"), git("rev-parse", "HEAD^{tree}")
    git("reset", "-q", "--soft", first)                                  # ... in a checkout whose HEAD is behind
    assert record.commit(cwd) == first + "+dirty"
    monkeypatch.setenv(record.CLAIM, f"{second} {tree}")
    assert record.commit(cwd) == second
    monkeypatch.setenv(record.CLAIM, f"{second} {git('rev-parse', first + '^{tree}')}")   # a claim that is wrong
    assert record.commit(cwd) == first + "+dirty"


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def _light() -> int:
    return 1


def test_host_hotspots_rank_the_functions_that_take_the_hosts_time():
    rng = random.Random(11)
    heavy = rng.randint(200_000, 300_000)
    calls = {"n": 0}

    def call():
        calls["n"] += 1
        _spin(heavy)
        for _ in range(rng.randint(3, 9)):
            _light()

    top = timing.host_hotspots(call, top=5)
    assert calls["n"] == 2                      # one warm-up call, one profiled
    assert len(top) == 5
    assert top[0]["fn"].endswith("(_spin)") and top[0]["calls"] == 1
    assert top[0]["ms"] > 0 and top[0]["ms"] == max(t["ms"] for t in top)
    light = [t for t in top if t["fn"].endswith("(_light)")]
    assert not light or light[0]["ms"] < top[0]["ms"]
