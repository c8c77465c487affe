"""The reload/forward contract (issue 42): reload_weights is atomic for the model's forwards, two reloads run one
after the other, a forward never computes with a mix of two weight sets, and a reload that fails half-way makes
forwards refuse the mix loudly. Real threads on a real tiny Llama; the references are separate sequential loads."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from safetensors.torch import load_file

import fp8now
from fp8now import Fp8Config
from fp8now.layers.guard import ReloadInProgress, TornWeights
from tiny import write_tiny_checkpoint

CONFIG = Fp8Config(scheme="channel")
ROUNDS = 6


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Two weight sets A and B: their tensors, and the logits and bytes of a fresh load of each."""
    root = tmp_path_factory.mktemp("guard")
    x = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(5))
    out = {"x": x}
    for name, seed in (("a", 0), ("b", 1)):
        folder = write_tiny_checkpoint(root / name, "llama", seed=seed)
        model, _ = fp8now.load(folder, CONFIG, device="cpu")
        out[name] = {"folder": folder, "tensors": load_file(folder / "model.safetensors"),
                     "logits": _logits(model, x), "bytes": _bytes(model)}
    assert not torch.equal(out["a"]["logits"], out["b"]["logits"])
    return out


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def _bytes(model) -> dict[str, bytes]:
    return {n: bytes(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, p in model.named_parameters()}


def _which(sets, logits: torch.Tensor) -> str:
    """'a' or 'b' when `logits` equal a fresh load's bit for bit, else 'mixed'."""
    return next((k for k in ("a", "b") if torch.equal(logits, sets[k]["logits"])), "mixed")


def _thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run fn(*args) in a started daemon thread; the list receives its result or its exception."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except BaseException as e:   # handed to the test through `box`
            box.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _blocked_stream(tensors: dict, started: threading.Event, release: threading.Event, cut: int):
    """The items of `tensors`, pausing after `cut` of them until `release` (a reload held open mid-way)."""
    for i, item in enumerate(tensors.items()):
        if i == cut:
            started.set()
            assert release.wait(120), "the test never released the stream"
        yield item


def test_two_threads_reloading_one_model_end_on_one_whole_set(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    for round_ in range(ROUNDS):   # both reloads start at once, every round
        barrier = threading.Barrier(2)

        def reload(tensors):
            barrier.wait(60)
            return fp8now.reload_weights(model, tensors)
        threads = [_thread(reload, sets[k]["tensors"]) for k in ("a", "b")]
        for t, box in threads:
            t.join(300)
            assert not t.is_alive() and not isinstance(box[0], BaseException), box
        final = _which(sets, _logits(model, sets["x"]))
        assert final in ("a", "b"), f"round {round_}: the model matches neither update"
        assert _bytes(model) == sets[final]["bytes"], f"round {round_}: the bytes match another set than the output"


def test_a_forward_during_reloads_sees_one_weight_set_or_the_other(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    stop = threading.Event()

    def reloader():
        i = 0
        while not stop.is_set() or i < 2:
            fp8now.reload_weights(model, sets[("b", "a")[i % 2]]["tensors"])
            i += 1
    t, box = _thread(reloader)
    seen = [_which(sets, _logits(model, sets["x"])) for _ in range(3 * ROUNDS)]
    stop.set()
    t.join(300)
    assert not box or not isinstance(box[0], BaseException), box
    assert "mixed" not in seen, f"{seen.count('mixed')} of {len(seen)} forwards mixed the two weight sets"


def test_a_forward_waits_for_a_running_reload_or_is_refused_when_asked(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    started, release = threading.Event(), threading.Event()
    tensors = sets["b"]["tensors"]
    reload, box = _thread(fp8now.reload_weights, model, _blocked_stream(tensors, started, release, len(tensors) // 2))
    assert started.wait(120)
    guard = fp8now.guard(model)
    guard.forward_waits = False
    with pytest.raises(ReloadInProgress, match="reload_weights is writing this model's weights"):
        _logits(model, sets["x"])
    guard.forward_waits = True
    forward, out = _thread(_logits, model, sets["x"])
    forward.join(0.5)
    assert forward.is_alive(), "a forward ran while half of the new weights were written"
    release.set()
    for t in (reload, forward):
        t.join(300)
    assert box[0].complete and _which(sets, out[0]) == "b"


def test_a_reload_waits_for_running_forwards_and_times_out_cleanly(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    holding, done = threading.Event(), threading.Event()

    def long_forward():   # a forward (or a whole generate) that holds the weights
        with fp8now.guard(model).reading():
            holding.set()
            done.wait(120)
            return _logits(model, sets["x"])
    reader, out = _thread(long_forward)
    assert holding.wait(120)
    with pytest.raises(TimeoutError, match="nothing of this call was applied"):
        fp8now.reload_weights(model, sets["b"]["tensors"], timeout=0.3)
    assert _bytes(model) == sets["a"]["bytes"]
    reload, box = _thread(fp8now.reload_weights, model, sets["b"]["tensors"])
    reload.join(0.5)
    assert reload.is_alive(), "the reload wrote while a forward held the weights"
    done.set()
    for t in (reader, reload):
        t.join(300)
    assert _which(sets, out[0]) == "a" and box[0].complete and _bytes(model) == sets["b"]["bytes"]


def _dying_stream(tensors: dict, after: int, error: BaseException):
    for i, item in enumerate(tensors.items()):
        if i == after:
            raise error
        yield item


def test_a_stream_that_dies_part_way_says_what_it_applied_and_forwards_refuse_the_mix(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    tensors = sets["b"]["tensors"]
    with pytest.raises(OSError, match="disk died") as info:
        fp8now.reload_weights(model, _dying_stream(tensors, len(tensors) // 2, OSError("disk died")))
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "already applied by this call: FP8 layers" in note and "forwards of the model now raise" in note
    now = _bytes(model)
    new = {n.removesuffix(".weight") for n in now
           if now[n] == sets["b"]["bytes"][n] != sets["a"]["bytes"][n] and n.endswith("proj.weight")}
    assert new and all(name in note for name in new)
    with pytest.raises(TornWeights, match="OSError: disk died") as refused:
        _logits(model, sets["x"])
    assert all(name in str(refused.value) for name in new)
    fp8now.reload_weights(model, tensors)   # a complete reload repairs it
    assert fp8now.guard(model).torn is None and _which(sets, _logits(model, sets["x"])) == "b"


def test_a_mix_can_be_accepted_and_a_stream_dying_before_any_write_leaves_no_mark(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    tensors = sets["b"]["tensors"]
    with pytest.raises(ValueError, match="already applied by this call"):
        fp8now.reload_weights(model, _dying_stream(tensors, len(tensors) // 2, ValueError("bad refit")))
    with pytest.raises(TornWeights, match="ValueError: bad refit"):
        _logits(model, sets["x"])
    fp8now.guard(model).clear_torn()
    assert _which(sets, _logits(model, sets["x"])) == "mixed"   # accepted: the mix, as it is
    fresh, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    with pytest.raises(OSError) as info:
        fp8now.reload_weights(fresh, _dying_stream(tensors, 0, OSError("gone")))
    assert "nothing of this call was applied" in " ".join(info.value.__notes__)
    assert fp8now.guard(fresh).torn is None and _which(sets, _logits(fresh, sets["x"])) == "a"


def test_a_reload_from_inside_a_forward_of_the_same_thread_is_refused_not_deadlocked(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    with fp8now.guard(model).reading():
        assert _which(sets, _logits(model, sets["x"])) == "a"   # forwards nest inside reading()
        with pytest.raises(RuntimeError, match="would wait for itself"):
            fp8now.reload_weights(model, sets["b"]["tensors"])
    with pytest.raises(Exception):   # a forward that fails must release the weights it held
        model(sets["x"].float())
    fp8now.reload_weights(model, sets["b"]["tensors"], timeout=60)
    assert _bytes(model) == sets["b"]["bytes"]


def test_a_copied_guard_is_free_and_submodules_share_the_models(sets):
    model, _ = fp8now.load(sets["a"]["folder"], CONFIG, device="cpu")
    guard = fp8now.guard(model)
    guard.forward_waits = False
    with guard.reading():   # held here: a copy (of a copied or unpickled model) must not inherit the hold
        for twin in (copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))):
            assert twin is not guard and twin.forward_waits is False and twin.torn is None
            with twin.writing(model, timeout=1):
                pass
    assert fp8now.guard(model.model) is guard and fp8now.guard(model.model.layers[0].mlp) is guard
    holding, done = threading.Event(), threading.Event()

    def hold():
        with guard.reading():
            holding.set()
            done.wait(120)
    t, _ = _thread(hold)
    assert holding.wait(120)
    norm = sets["b"]["tensors"]["model.norm.weight"]
    with pytest.raises(TimeoutError):   # the base model's reload waits for the whole model's forwards
        fp8now.reload_weights(model.model, {"norm.weight": norm}, timeout=0.3)
    done.set()
    t.join(60)
    fp8now.reload_weights(model.model, {"norm.weight": norm}, timeout=60)
    assert torch.equal(model.model.norm.weight, norm)
