"""What the loader opens (issue 42): only regular files inside the model folder (or the hub cache's own links into
its blobs), never a FIFO or a path that leaves the folder, all refused before anything is opened; a folder or index
that says two things (both model.safetensors and an index, a tensor listed twice) refused, naming both; a shard
tensor the index omits loaded and warned about. Real folders edited in place; FIFOs that would block any reader."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fp8now
from fp8now.hf.tokenizer import load_tokenizer
from test_evaluate import save_byte_tokenizer
from tiny import save_checkpoint, write_tiny_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(folder, tensors, config, parameter bytes of its load)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("folder") / "llama", "llama", seed=4)
    model, _ = fp8now.load(folder, device="cpu")
    return folder, load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text()), \
        _bytes(model)


def _bytes(model) -> dict[str, bytes]:
    return {n: bytes(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, p in model.named_parameters()}


def _returns(fn, *args, seconds: float = 120):
    """fn(*args) in a daemon thread: its result or exception, asserting that it did not block on a file."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except BaseException as e:   # handed back to the test
            box.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} blocked (a FIFO opened?)"
    return box[0]


def _load(folder):
    return fp8now.load(folder, device="cpu")


def _sharded(good, path: Path) -> Path:
    folder, tensors, config, _ = good
    return save_checkpoint(tensors, config, path, shards=2)


def _edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    edit(index)
    (folder / INDEX).write_text(json.dumps(index))


def test_both_a_single_file_and_an_index_are_refused_naming_both(tmp_path, good):
    folder = _sharded(good, tmp_path / "both")
    shutil.copy(good[0] / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json.*"
                                         r"transformers reads model\.safetensors"):
        _load(folder)


def test_an_index_listing_a_tensor_twice_is_refused_naming_it(tmp_path, good):
    folder = _sharded(good, tmp_path / "twice")
    text = (folder / INDEX).read_text()
    key, fname = next(iter(json.loads(text)["weight_map"].items()))
    other = "model-00002-of-00002.safetensors" if fname.startswith("model-00001") else "model-00001-of-00002.safetensors"
    (folder / INDEX).write_text(text.replace('"weight_map": {', f'"weight_map": {{"{key}": "{other}", ', 1))
    assert json.loads((folder / INDEX).read_text())["weight_map"][key] == fname   # json keeps the last silently
    with pytest.raises(ValueError, match=rf"lists '{key}' twice"):
        _load(folder)


def test_a_shard_tensor_the_index_omits_is_loaded_and_warned_about(tmp_path, good):
    folder = _sharded(good, tmp_path / "omits")
    _edit_index(folder, lambda index: index["weight_map"].pop("model.norm.weight"))
    model, report = _load(folder)
    assert _bytes(model) == good[3]
    notes = [w for w in report.warnings() if "does not list 1 tensor(s)" in w]
    assert len(notes) == 1 and "'model.norm.weight'" in notes[0] and len(report.warnings()) == 1


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_entry_leaving_the_folder_is_refused_before_it_is_opened(tmp_path, good, where):
    folder = _sharded(good, tmp_path / "leaves")
    outside = tmp_path / "outside.safetensors"
    os.mkfifo(outside)   # opening it would block until a writer comes
    target = "../outside.safetensors" if where == "relative" else str(outside)
    _edit_index(folder, lambda index: index["weight_map"].update({"model.norm.weight": target}))
    error = _returns(_load, folder)
    assert isinstance(error, ValueError) and "leaves the model folder" in str(error) and target in str(error)


@pytest.mark.parametrize("bad, what", [
    (3, "must be a file name, got 3"), (None, "must be a file name, got None"), ("", "must be a file name"),
    ("sub\\x.safetensors", "leaves the model folder")])
def test_malformed_index_values_are_named(tmp_path, good, bad, what):
    folder = _sharded(good, tmp_path / "values")
    _edit_index(folder, lambda index: index["weight_map"].update({"model.norm.weight": bad}))
    with pytest.raises(ValueError, match=rf"weight_map\['model\.norm\.weight'\].*{what}"):
        _load(folder)
    _edit_index(folder, lambda index: index.update({"weight_map": ["model-00001-of-00002.safetensors"]}))
    with pytest.raises(ValueError, match=r"'weight_map' must be an object .* got list"):
        _load(folder)


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "shard"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path, good, victim):
    folder = _sharded(good, tmp_path / "fifo") if victim == "shard" else shutil.copytree(good[0], tmp_path / "f")
    name = "model-00002-of-00002.safetensors" if victim == "shard" else victim
    (folder / name).unlink()
    os.mkfifo(folder / name)
    error = _returns(_load, folder)
    assert isinstance(error, ValueError) and f"{name} is a FIFO (named pipe), not a regular file" in str(error)


def test_a_fifo_tokenizer_file_is_refused_without_blocking(tmp_path, good):
    folder = shutil.copytree(good[0], tmp_path / "tok")
    save_byte_tokenizer(folder)
    assert load_tokenizer(folder) is not None
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    error = _returns(load_tokenizer, folder)
    assert isinstance(error, ValueError) and "tokenizer.json is a FIFO" in str(error)


@pytest.mark.parametrize("target", ["other folder", "/dev/zero"])
def test_a_link_out_of_the_folder_is_refused(tmp_path, good, target):
    folder = tmp_path / "linked"
    folder.mkdir()
    shutil.copy(good[0] / "config.json", folder)
    os.symlink(good[0] / "model.safetensors" if target == "other folder" else target, folder / "model.safetensors")
    error = _returns(_load, folder)
    assert isinstance(error, ValueError) and "outside the model folder" in str(error)


def test_links_inside_the_folder_and_the_hub_caches_own_links_load(tmp_path, good):
    inside = tmp_path / "inside"
    inside.mkdir()
    shutil.copy(good[0] / "config.json", inside)
    shutil.copy(good[0] / "model.safetensors", inside / "weights.bin.safetensors")
    os.symlink("weights.bin.safetensors", inside / "model.safetensors")
    assert _bytes(_load(inside)[0]) == good[3]
    repo = tmp_path / "hub" / "models--org--tiny"   # the hub cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        shutil.copy(good[0] / name, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    assert _bytes(_load(snapshot)[0]) == good[3]
