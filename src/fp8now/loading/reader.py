"""Read safetensors tensors with positional reads into memory the load owns: several reads at once (a pool of
threads, each `os.preadv` into its own part of a tensor), a bounded number of bytes in flight, results in order.

safetensors' own reader maps the file: every page a load reads stays resident (and counts in the process's RSS)
until the mapping is dropped, and a tensor that is a view of it keeps the file mapped for the model's life. A
positional read into a fresh tensor needs neither. For a GPU the reads land in pinned host buffers that are
copied to the device asynchronously and reused once their copy is done, so the disk, the page cache and the copy
engine all stay busy while the device quantizes. The headers are checked beforehand (files.scan_headers); this
reads data only. A tensor-parallel rank reads its slices with `read_slices` (safetensors' get_slice).
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import ST_DTYPES, corrupt_error

# One read (and one host-to-device copy) at most, per device type.
CHUNK = {"cpu": 32 << 20, "cuda": 8 << 20}
# Bytes read ahead of the consumer (at least one tensor, whatever its size): a CPU load holds them in host memory
# beside the layer it quantizes, a GPU load on the device (its pinned staging is as large, IN_FLIGHT / CHUNK
# reads at once).
IN_FLIGHT = {"cpu": 16 << 20, "cuda": 64 << 20}
# At most this many bytes of small tensors lying back to back in a file are read as one run (each then
# yielded as its own copy): per-expert tensors of MoE checkpoints come by the ten thousand.
RUN = {"cpu": 4 << 20, "cuda": 16 << 20}


@dataclass(frozen=True)
class Item:
    """One tensor's bytes in a file."""

    path: Path
    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _layout(f) -> tuple[dict, int]:
    """(header dict, offset of the data section) of an open safetensors file."""
    (size,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(size)), 8 + size


def items_of(path: Path, keys: list[str]) -> list[Item]:
    """Where each of `keys` lies in `path`, in the order given. Raises a ValueError naming the file for a
    header that cannot be parsed or a key it lacks."""
    try:
        with open(path, "rb", buffering=0) as f:
            header, base = _layout(f)
        out = []
        for key in keys:
            entry = header[key]
            start, end = entry["data_offsets"]
            out.append(Item(path, key, base + start, end - start, ST_DTYPES[entry["dtype"]], tuple(entry["shape"])))
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise corrupt_error(path, e) from None


def _read_into(fd: int, offset: int, view: memoryview, key: str) -> None:
    """Fill `view` from `fd` at `offset` (short reads resumed); a file that ends early raises."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise ValueError(f"tensor {key!r} ends after {done} of {len(view)} bytes")
        done += n


class Reader:
    """Reads `Item`s onto `device` with `threads` readers; `read` yields (item, tensor) in the items' order.

    At most `in_flight` bytes of tensors are held ahead of the consumer (and at least one tensor whatever its
    size): on a CPU in host memory, on a GPU on the device, each tensor allocated there when it is scheduled and
    filled through pinned staging chunks (as many bytes as `in_flight`)."""

    def __init__(self, device: torch.device, threads: int | None = None, in_flight: int | None = None,
                 chunk: int | None = None, run: int | None = None) -> None:
        self.device = torch.device(device)
        self.threads = threads or (min(8, os.cpu_count() or 2) if self.device.type == "cuda" else 1)
        kind = self.device.type if self.device.type in IN_FLIGHT else "cpu"
        in_flight = IN_FLIGHT[kind] if in_flight is None else in_flight
        chunk = CHUNK[kind] if chunk is None else chunk
        self.in_flight, self.chunk = max(in_flight, chunk), chunk
        # small tensors lying back to back are read as one (fewer reads, copies and thread hops per tensor)
        self.run_bytes = min(RUN[kind] if run is None else run, self.in_flight)
        self.cuda = self.device.type == "cuda"
        self.peak_in_flight = 0   # the most host bytes held at once (what the bound is tested against)

    def read(self, items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        fds: dict[Path, int] = {}
        staging = _Staging(self.in_flight, self.chunk) if self.cuda else None
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fp8now-read")
        queue: deque[tuple[list[Item], torch.Tensor, list[Future]]] = deque()
        runs = _runs(items, self.run_bytes)
        held, nxt = 0, 0
        try:
            while nxt < len(runs) or queue:
                while nxt < len(runs) and (not queue or held + _cost(runs[nxt]) <= self.in_flight):
                    run = runs[nxt]
                    nxt += 1
                    path = run[0].path
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    out, futures = self._schedule(pool, fds[path], run, staging)
                    queue.append((run, out, futures))
                    held += _cost(run)
                    self.peak_in_flight = max(self.peak_in_flight, held)
                run, out, futures = queue.popleft()
                try:
                    for fut in futures:
                        fut.result()
                except (OSError, ValueError) as e:
                    if len(run) == 1:
                        raise corrupt_error(run[0].path, e) from None
                    # a run that failed: its tensors one at a time, so those before the bad one still arrive
                    for item in run:
                        yield item, self._read_one(fds[item.path], item)
                    raise corrupt_error(run[0].path, e) from None   # not reached: a tensor above raised
                held -= _cost(run)
                start = run[0].offset
                for item in run:   # several small tensors read as one: each yielded as its own copy
                    t = out[item.offset - start:item.offset - start + item.nbytes]
                    t = t.view(item.dtype).reshape(item.shape)
                    yield item, t.clone() if len(run) > 1 else t
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for fd in fds.values():
                os.close(fd)
            if staging is not None:
                staging.close()

    def _read_one(self, fd: int, item: Item) -> torch.Tensor:
        """One tensor, read now on this thread (a failed run's tensors, one by one)."""
        host = torch.empty(item.nbytes, dtype=torch.uint8)
        try:
            _read_into(fd, item.offset, memoryview(host.numpy()), item.key)
        except (OSError, ValueError) as e:
            raise corrupt_error(item.path, e) from None
        return host.to(self.device).view(item.dtype).reshape(item.shape)

    def _schedule(self, pool: ThreadPoolExecutor, fd: int, run: list[Item], staging
                  ) -> tuple[torch.Tensor, list[Future]]:
        nbytes, offset = _cost(run), run[0].offset
        key = run[0].key if len(run) == 1 else f"{run[0].key} (read with {len(run) - 1} tensors after it)"
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        spans = [(a, min(a + self.chunk, nbytes)) for a in range(0, nbytes, self.chunk)] or [(0, 0)]
        if staging is None:
            view = memoryview(out.numpy())
            return out, [pool.submit(_read_into, fd, offset + a, view[a:b], key) for a, b in spans]
        return out, [pool.submit(staging.copy, fd, offset + a, out[a:b], key) for a, b in spans]


def _cost(run: list[Item]) -> int:
    """Bytes a run holds while in flight: its tensors (in host memory, or on the GPU)."""
    return sum(item.nbytes for item in run)


def _runs(items: list[Item], limit: int) -> list[list[Item]]:
    """`items` in order, cut into runs read as one: consecutive tensors of one file lying back to back, each
    at an offset within the run that its dtype allows viewing, together at most `limit` bytes (a tensor of
    `limit` or more is a run of its own)."""
    runs: list[list[Item]] = []
    size = 0   # bytes of the last run
    for item in items:
        run = runs[-1] if runs else None
        if (run is not None and item.path == run[-1].path and item.offset == run[-1].offset + run[-1].nbytes
                and (item.offset - run[0].offset) % item.dtype.itemsize == 0 and size + item.nbytes <= limit):
            run.append(item)
            size += item.nbytes
        else:
            runs.append([item])
            size = item.nbytes
    return runs


class _Staging:
    """Pinned host buffers a GPU read goes through: a worker takes one, reads into it, copies it to the device
    without waiting, and gives it back with the copy's event; the next taker waits for that event only."""

    def __init__(self, in_flight: int, chunk: int) -> None:
        import queue

        self.free: queue.Queue = queue.Queue()
        for _ in range(max(1, in_flight // chunk)):
            self.free.put((torch.empty(chunk, dtype=torch.uint8).pin_memory(), None))

    def copy(self, fd: int, offset: int, dest: torch.Tensor, key: str) -> None:
        buf, event = self.free.get()
        try:
            torch.cuda.set_device(dest.device)   # this thread's copies and events on the tensor's device
            if event is not None:
                event.synchronize()   # its previous copy to the device has finished
            n = dest.numel()
            _read_into(fd, offset, memoryview(buf.numpy())[:n], key)
            dest.copy_(buf[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        finally:
            self.free.put((buf, event))

    def close(self) -> None:
        torch.cuda.synchronize()


def read_tensors(path: Path, keys: list[str], device: torch.device | str = "cpu",
                 reader: Reader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) for `keys` of one file, in order, each in fresh memory on `device` (no mapping).
    Raises a ValueError naming the file for a truncated or corrupt one."""
    reader = reader or Reader(torch.device(device))
    for item, t in reader.read(items_of(path, keys)):
        yield item.key, t


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
