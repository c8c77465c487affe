"""Host memory of this process: resident set now and its peak so far, wherever they can be read.

Linux: /proc/self/status (VmRSS, VmHWM). Elsewhere the peak comes from `resource.getrusage`, a
module that some platforms (Windows) lack, so it is imported only when needed; None when unknown.
"""

from __future__ import annotations

import sys


def _status_kib(field: str) -> int | None:
    """A `kB` field of /proc/self/status, or None where that file does not exist."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss_bytes() -> int | None:
    """Resident set size now (Linux only; None elsewhere)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process since it started (None where it cannot be read)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere


def mib(n: int | None) -> str:
    """`123.4 MiB`, or `n/a` for an unknown size."""
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"
