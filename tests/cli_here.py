"""The `fp8now` command in the test's own process: `main(ARGS)` with stdout and stderr captured (pytest's
capsys), returned as the `subprocess.CompletedProcess` a real `python -m fp8now ARGS` gives, so one set of
assertions reads either. Only for commands that another test also runs as a real subprocess: this process
has torch and transformers imported already, which a CLI subprocess pays for every time (seconds each)."""

from __future__ import annotations

import subprocess
import sys

from fp8now.cli.main import main


def fp8now_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`fp8now ARGS` through main(); a SystemExit (argparse's --help or a bad choice) gives the status and stderr
    the process would. Output printed before the call is dropped, not returned."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["fp8now", *args], code, out, err)
