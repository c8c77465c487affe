"""benchmarks/bench_linear.py's --add on the CPU: a grid split over several device calls keeps the
other shapes' rows of the file only when they come from the same commit and GPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_linear  # noqa: E402
import record  # noqa: E402


def _info(commit, gpu="NVIDIA H200", command="python3 benchmarks/bench_linear.py --shapes 4096x4096"):
    return dict(date="2026-12-05", gpu=gpu, torch="2.11.0", triton="3.6.0", commit=commit, command=command)


def test_add_keeps_other_shapes_of_the_same_commit_and_gpu(tmp_path):
    path = str(tmp_path / "linear.json")
    rows = [dict(M=m, N=n, K=k, impl=i, ms=0.1 * m) for n, k in ((4096, 4096), (8192, 8192))
            for m in (1, 16) for i in ("bf16", "fp8now-channel")]
    record.write(path, _info("abc1234"), rows)
    now = _info("abc1234", command="python3 benchmarks/bench_linear.py --shapes 8192x8192,8192x28672 --add")
    info, kept = bench_linear.added_to(path, now, [(8192, 8192), (8192, 28672)])
    assert kept == [r for r in rows if r["N"] == 4096]          # the shape measured again is dropped
    assert info["command"] == ("python3 benchmarks/bench_linear.py --shapes 4096x4096 ; "
                               "python3 benchmarks/bench_linear.py --shapes 8192x8192,8192x28672 --add")
    assert {k: v for k, v in info.items() if k != "command"} == {k: v for k, v in now.items() if k != "command"}
    for other in (_info("def5678"), _info("abc1234", gpu="NVIDIA H100")):
        with pytest.raises(SystemExit, match="without --add"):
            bench_linear.added_to(path, other, [(8192, 8192)])
