"""Where the tensors of a load come from: a checkpoint's safetensors files (float, or FP8 as stored) or tensors in
memory (`reload_weights`, `quantize_`). Each tensor's header (key, shape, dtype) is known before its data, so
every route is checked before anything is written; files are read with positional reads into memory the
load owns (no mapping kept), a tensor-parallel rank reading only its slices."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import ST_DTYPES, checkpoint_files, index_map, scan_headers
from .reader import Reader, items_of, read_slices

_ST_NAME = {dtype: name for name, dtype in ST_DTYPES.items()}


@dataclass(frozen=True)
class Header:
    """One tensor of a source, before its data: `key` as the source names it, the safetensors dtype name
    (BF16, F8_E4M3, ...), and `where` it comes from (its file, or the call), for messages."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    where: str
    model_key: str = ""   # the key under the model's own names, where a checkpoint renames it ("": key)

    @property
    def name(self) -> str:
        return self.model_key or self.key


def header_of(key: str, t: torch.Tensor, where: str) -> Header:
    """The header of an in-memory tensor; a non-tensor value is refused naming its key."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {key!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{where}: {key!r} is on the meta device (a shape without values); pass tensors that "
                         "hold the new weights")
    return Header(key, tuple(t.shape), _ST_NAME.get(t.dtype, str(t.dtype)), where)


class FileSource:
    """The safetensors files of a checkpoint folder (one file, or the shards of its index)."""

    def __init__(self, model_dir: Path, rename=None) -> None:
        """`rename`: checkpoint key -> the model's key (pre-quantized files), or None."""
        self.model_dir = model_dir
        self.files = checkpoint_files(model_dir)
        self.rename = rename
        self._headers: list[Header] | None = None
        self.reader: Reader | None = None   # the last read's reader (its peak bytes in flight)
        self.notices: list[str] = []        # what check_index found odd but harmless (the load report's)

    def headers(self) -> list[Header]:
        """Every tensor of every file, in file order (headers only: no data is read)."""
        if self._headers is None:
            self._headers = [Header(key, shape, st, str(path), self.rename(key) if self.rename else "")
                             for path in self.files for key, shape, st in scan_headers(path)]
        return self._headers

    def check_index(self) -> None:
        """Every tensor the index lists is in the file it names; a tensor of its shards that it does not list is
        loaded all the same (as transformers and vLLM do) and noted in `self.notices`."""
        in_file: dict[str, set[str]] = {}
        for h in self.headers():
            in_file.setdefault(Path(h.where).name, set()).add(h.key)
        listed = index_map(self.model_dir) or {}
        for key, fname in listed.items():
            if key not in in_file.get(fname, ()):
                raise ValueError(f"{self.model_dir / 'model.safetensors.index.json'} lists {key!r} in {fname}, "
                                 "which does not contain it; re-download the checkpoint")
        omitted = [f"{key!r} in {fname}" for fname, keys in in_file.items() for key in sorted(keys)
                   if listed and key not in listed]
        if omitted:
            self.notices.append(f"{self.model_dir / 'model.safetensors.index.json'} does not list {len(omitted)} "
                                f"tensor(s) its shards hold, e.g. {', '.join(omitted[:3])}; they were loaded (as "
                                "transformers and vLLM load every tensor of a shard): regenerate the index")

    def read(self, wanted: dict[str, dict[str, str]], device: torch.device, tp=None
             ) -> Iterator[tuple[str, torch.Tensor | None, str]]:
        """Yield (key, tensor on `device`, file) for `wanted` {file: {key: model name}}, file by file, each file
        in the order of its bytes; under tensor parallelism (`tp`) this rank's slices on the host (None for
        another rank's experts)."""
        if tp is not None:
            for where, names in wanted.items():
                for key, t in read_slices(Path(where), names, tp):
                    yield key, t, where
            return
        items = [item for where, names in wanted.items() if names
                 for item in sorted(items_of(Path(where), list(names)), key=lambda i: i.offset)]
        self.reader = Reader(device)
        for item, t in self.reader.read(items):
            yield item.key, t, str(item.path)


class TensorSource:
    """Tensors in memory, by name: a dict or a list is known whole before the first write (`known`); any other
    iterable streams, one tensor at a time."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                 where: str) -> None:
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
        self.known = isinstance(items, (list, tuple))
        self.items = items
        self.where = where

    def headers(self) -> list[Header]:
        """The headers of a known source (raises TypeError for a value that is not a tensor)."""
        return [header_of(key, t, self.where) for key, t in self.items]

    def tensors(self) -> dict[str, torch.Tensor]:
        """{key: tensor} of a known source."""
        return dict(self.items)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.items)

