"""The load's reader (loading/reader.py): positional reads by a pool of threads, a bounded number of bytes ahead of
the consumer, results in the order asked, every byte equal to safetensors' own reading of the file, and errors
that name the file without leaking a descriptor or a thread."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8now.loading.reader import Reader, items_of, read_tensors

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.float8_e4m3fn]


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def _checkpoint(tmp_path, name: str, seed: int, count: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(count):
        shape = [(), (0,), (7,), (3, 5), (17, 33), (2, 3, 41)][int(torch.randint(0, 6, (1,), generator=g))]
        tensors[f"{name}.t{i}"] = _random(shape, DTYPES[i % len(DTYPES)], g)
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    return tensors


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("threads,chunk,in_flight", [(1, 1 << 20, 1 << 20), (3, 64, 512), (4, 37, 100)])
def test_every_tensor_equals_safetensors_own_reading_in_the_order_asked(tmp_path, threads, chunk, in_flight):
    _checkpoint(tmp_path, "a", seed=threads)
    path = tmp_path / "a.safetensors"
    expected = load_file(str(path))
    keys = list(expected)
    order = [keys[i] for i in torch.randperm(len(keys), generator=torch.Generator().manual_seed(7)).tolist()]
    reader = Reader(torch.device("cpu"), threads=threads, in_flight=in_flight, chunk=chunk)
    got = list(reader.read(items_of(path, order)))
    assert [item.key for item, _ in got] == order
    for item, t in got:
        assert _same(t, expected[item.key]), item.key
    # fresh memory for each tensor: writing one changes no other, nor a second reading of the file
    first = got[0][1]
    if first.numel():
        first.reshape(-1).view(torch.uint8).fill_(0xAB)
        again = dict(read_tensors(path, order))
        assert _same(again[order[0]], expected[order[0]])


def test_items_of_two_files_interleaved_come_back_in_the_order_given(tmp_path):
    a, b = _checkpoint(tmp_path, "a", seed=1), _checkpoint(tmp_path, "b", seed=2)
    ia = items_of(tmp_path / "a.safetensors", list(a))
    ib = items_of(tmp_path / "b.safetensors", list(b))
    mixed = [x for pair in zip(ia, ib) for x in pair]
    got = list(Reader(torch.device("cpu"), threads=2, in_flight=256, chunk=48).read(mixed))
    assert [i.key for i, _ in got] == [i.key for i in mixed]
    both = {**a, **b}
    assert all(_same(t, both[i.key]) for i, t in got)


def test_bytes_held_ahead_of_the_consumer_stay_within_the_bound(tmp_path):
    g = torch.Generator().manual_seed(3)
    sizes = [300, 40, 900, 120, 64, 2000, 8, 500]   # bytes; 2000 alone exceeds the bound
    tensors = {f"w{i}": torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8) for i, n in enumerate(sizes)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    bound = 1000
    small = [k for k, n in zip(tensors, sizes) if n <= bound]
    for keys, peak_at_most in ((small, bound), (list(tensors), 2000)):
        reader = Reader(torch.device("cpu"), threads=3, in_flight=bound, chunk=64)
        seen = []
        for item, t in reader.read(items_of(tmp_path / "m.safetensors", keys)):
            seen.append(item.key)
            assert torch.equal(t, tensors[item.key])
        assert seen == keys
        assert reader.peak_in_flight <= peak_at_most
    assert reader.peak_in_flight == 2000   # the oversized tensor is read, alone


def test_a_truncated_file_fails_at_its_tensor_naming_the_file_and_leaks_nothing(tmp_path):
    tensors = {f"w{i}": torch.full((64,), float(i), dtype=torch.float32) for i in range(6)}
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path))
    os.truncate(path, os.path.getsize(path) - 100)   # the last tensor loses 100 of its 256 bytes
    fds, threads = _open_fds(), threading.active_count()
    got = []
    with pytest.raises(ValueError) as e:
        for key, t in read_tensors(path, list(tensors), reader=Reader(torch.device("cpu"), threads=2,
                                                                     in_flight=600, chunk=64)):
            got.append(key)
            assert torch.equal(t, tensors[key])
    assert "cut.safetensors" in str(e.value)
    assert "'w5'" in str(e.value)
    assert got == ["w0", "w1", "w2", "w3", "w4"]
    assert _open_fds() == fds
    assert threading.active_count() == threads


def test_a_consumer_that_stops_early_closes_the_files(tmp_path):
    tensors = _checkpoint(tmp_path, "a", seed=5)
    fds = _open_fds()
    it = read_tensors(tmp_path / "a.safetensors", list(tensors), reader=Reader(torch.device("cpu"), threads=2))
    next(it)
    assert _open_fds() > fds   # the file is open while reading
    it.close()
    assert _open_fds() == fds


def test_a_key_the_header_lacks_is_named_with_the_file(tmp_path):
    _checkpoint(tmp_path, "a", seed=6)
    with pytest.raises(ValueError, match=r"a\.safetensors"):
        items_of(tmp_path / "a.safetensors", ["a.t0", "no.such.tensor"])


def test_small_tensors_back_to_back_are_read_as_runs_and_yielded_as_their_own_copies(tmp_path):
    """In file order, consecutive small tensors are read as one run (bounded bytes, each at an offset its dtype
    can be viewed at: mixed dtypes cut a run where a float32 would start at an odd 2-byte offset); every tensor
    still equals safetensors' reading, holds its own storage (no run buffer kept alive by a small tensor), and
    writing one changes no other."""
    from fp8now.loading.reader import _runs

    g = torch.Generator().manual_seed(11)
    tensors = {}
    for i in range(60):
        dtype = [torch.bfloat16, torch.float32, torch.uint8, torch.float16][i % 4]
        tensors[f"e{i:02d}"] = _random((int(torch.randint(1, 40, (1,), generator=g)),), dtype, g)
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    expected = load_file(str(path))
    items = sorted(items_of(path, list(tensors)), key=lambda i: i.offset)   # file order: back to back
    for limit in (64, 300, 1 << 20):
        runs = _runs(items, limit)
        assert [i for run in runs for i in run] == items
        for run in runs:
            assert len(run) == 1 or sum(i.nbytes for i in run) <= limit
            for a, b in zip(run, run[1:]):
                assert b.offset == a.offset + a.nbytes and (b.offset - run[0].offset) % b.dtype.itemsize == 0
        if limit == 1 << 20:
            assert len(runs) < len(items) // 4   # most tensors share a read
    got = list(Reader(torch.device("cpu"), threads=2, run=1 << 20).read(items))
    assert [i.key for i, _ in got] == [i.key for i in items]
    for item, t in got:
        assert _same(t, expected[item.key]), item.key
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), item.key
    got[0][1].reshape(-1).view(torch.uint8).fill_(0xCD)
    assert all(_same(t, expected[i.key]) for i, t in got[1:])
