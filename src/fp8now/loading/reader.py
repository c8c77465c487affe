"""Read tensors of a safetensors file with positional reads into memory the caller owns.

safetensors' own reader maps the file: every page a load reads stays resident (and counts in the
process's RSS) until the mapping is dropped, and a tensor that is a view of it keeps the file mapped
for the model's life. Reading each tensor's bytes straight into a fresh tensor needs neither. The
headers are checked beforehand with safetensors (`scan_headers`); this reads data only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from .files import ST_DTYPES, corrupt_error


def _layout(f) -> tuple[dict, int]:
    """(header dict, offset of the data section) of an open safetensors file."""
    (size,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(size)), 8 + size


def read_tensors(path: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) for `keys` in order; each tensor owns fresh CPU memory. Raises OSError or
    ValueError (truncated file, bad header) for the caller to name the file."""
    with open(path, "rb", buffering=0) as f:
        header, base = _layout(f)
        for key in keys:
            entry = header[key]
            start, end = entry["data_offsets"]
            dtype = ST_DTYPES[entry["dtype"]]
            out = torch.empty(end - start, dtype=torch.uint8)
            f.seek(base + start)
            view = memoryview(out.numpy())
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"tensor {key!r} ends after {done} of {end - start} bytes")
                done += n
            yield key, out.view(dtype).reshape(entry["shape"])


def read_slices(path: Path, names: dict[str, str], tp) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield (key, this tensor-parallel rank's slice) for the keys of `names` (key -> model name) in one file
    (`tp`: the rank's TpState: its slices, the experts it skips (None is yielded for those) and its byte count);
    get_slice reads only the slice's bytes, and each is copied out of the mapping, so nothing of the file stays
    mapped after the load."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key, name in names.items():
                if key in tp.skip:
                    yield key, None
                    continue
                sl = tp.slices.get(name)
                if sl is None:
                    t = f.get_tensor(key)
                else:
                    view = f.get_slice(key)
                    parts = [view[sl.index(a, b)] for a, b in sl.ranges]
                    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=sl.dim)
                tp.read_bytes += t.numel() * t.element_size()
                yield key, t.clone()
    except Exception as e:  # SafetensorError, OSError: the file cannot be used
        raise corrupt_error(path, e) from None
