"""What each spawned rank of test_tp.py and test_tp_moe.py runs (tp_groups.py starts them): real gloo
collectives, real checkpoints, results to files.

Reads are recorded by wrapping safetensors' own `safe_open` (the real file is read; the wrapper only
notes which key and which index each read asked for), so the test checks the bytes a rank read
independently of fp8now's own counter.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

# phi3 with its fused gate_up split in its two halves (transformers' packed_colwise) instead of gathered.
PACKED_PHI3 = {"model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
               "model.layers.*.self_attn.o_proj": "rowwise_split_input",
               "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise",
               "lm_head": "colwise_gather_output"}
# TP inside the experts only, in transformers 5.17's own vocabulary (attention and the rest stay whole).
EXPERTS_ONLY = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                "model.layers.*.mlp.experts.down_proj": "rowwise", "model.layers.*.mlp.experts": "moe_tp_experts"}
IDS = torch.tensor([[1, 17, 250, 3, 499, 42, 77, 128, 300, 5, 64, 411, 9, 2, 388, 120]])


class _SliceLog:
    def __init__(self, view, key: str, log: list):
        self.view, self.key, self.log = view, key, log

    def __getitem__(self, index):
        t = self.view[index]
        self.log.append((self.key, index if isinstance(index, tuple) else (index,), t.numel() * t.element_size()))
        return t

    def __getattr__(self, name):
        return getattr(self.view, name)


class _FileLog:
    def __init__(self, handle, log: list):
        self.handle, self.log = handle, log
        self.inner = handle   # also used without `with` (transformers' from_pretrained)

    def __enter__(self):
        self.inner = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, key):
        t = self.inner.get_tensor(key)
        self.log.append((key, "full", t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        return _SliceLog(self.inner.get_slice(key), key, self.log)

    def keys(self):
        return self.inner.keys()

    def __getattr__(self, name):   # the rest of safe_open's methods, unlogged (get_tensors: test inputs)
        return getattr(self.inner, name)


def record_reads(log: list) -> None:
    """Make every later `safetensors.safe_open` note its data reads in `log`."""
    import safetensors

    real = safetensors.safe_open

    def opened(*args, **kwargs):
        return _FileLog(real(*args, **kwargs), log)

    safetensors.safe_open = opened


def layer_bytes(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from fp8now.layers.linear import Fp8Linear
    return {n: (m.weight.view(torch.uint8).clone(), m.weight_scale.clone())
            for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def experts_bytes(model) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each FP8 experts layer's (w13 bytes, w13_scale, w2 bytes, w2_scale)."""
    from fp8now.layers.moe import Fp8Experts
    return {n: (m.w13.view(torch.uint8).clone(), m.w13_scale.clone(), m.w2.view(torch.uint8).clone(),
                m.w2_scale.clone()) for n, m in model.named_modules() if isinstance(m, Fp8Experts)}


def _moe(rank: int, ckpt: str, extra: str, log: list) -> dict:
    """Every (mode, scheme, tp_invariant) of `extra` ("ep:tensor:0,tp:block:1,..."): bytes, logits, reads.
    Mode "plan": the EXPERTS_ONLY plan dict, whose styles choose TP inside the experts. A fourth field
    names a sibling checkpoint folder to load instead; a tail "@name" forces Fp8Config(backend=name)."""
    import fp8now
    from fp8now import Fp8Config

    result: dict = {}
    for run in extra.split(","):
        fields, _, backend = run.partition("@")
        mode, scheme, inv, *other = fields.split(":")
        log.clear()
        folder = Path(ckpt).parent / other[0] if other else ckpt
        config = Fp8Config(scheme=scheme, tp_invariant=inv == "1", backend=backend or "auto")
        try:
            model, _ = fp8now.load(folder, config, device="cpu",
                                   measure_error=False, tp_plan=EXPERTS_ONLY if mode == "plan" else "auto",
                                   moe_parallel=None if mode == "plan" else mode)
        except (ValueError, RuntimeError) as e:
            result[run] = (f"{type(e).__name__}: {e}", list(log))
            continue
        with torch.no_grad():
            logits = model(IDS).logits.float()
        tp = model._fp8now_tp
        result[run] = (layer_bytes(model), experts_bytes(model), logits, list(log), tp.read_bytes,
                       {n: s for n, s in tp.moe.splits.items()},
                       {n: model.get_submodule(n).backend for n in tp.moe.splits})
    return result


def _moe_reload(rank: int, ckpt: str, other: str, log: list) -> dict:
    """reload_weights on a split MoE model, per (mode, scheme): the per-expert tensors of checkpoint
    `other`, then the fused state_dict of `ckpt`'s transformers model as a stream; after each, this
    rank's bytes and logits next to a fresh split load of that checkpoint, and whether storage stayed."""
    import fp8now
    from fp8now import Fp8Config
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fused = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    per_expert = load_file(str(Path(other) / "model.safetensors"))
    result: dict = {"fused_keys": [k for k in fused if "experts.gate_up_proj" in k],
                    "per_expert_keys": [k for k in per_expert if ".experts.0." in k]}

    def state(model) -> tuple:
        with torch.no_grad():
            return layer_bytes(model), experts_bytes(model), model(IDS).logits.float()

    for run in ("ep:channel", "tp:tensor", "tp:block"):
        mode, scheme = run.split(":")

        def load(folder):
            return fp8now.load(folder, Fp8Config(scheme=scheme), device="cpu", measure_error=False,
                               tp_plan="auto", moe_parallel=mode)[0]

        model = load(ckpt)
        ptrs = [p.data_ptr() for p in model.parameters()]
        got = {}
        report = fp8now.reload_weights(model, per_expert)
        got["other"] = (state(model), state(load(other)), report.partial)
        report = fp8now.reload_weights(model, iter(fused.items()))
        got["fused"] = (state(model), state(load(ckpt)), report.partial)
        got["in_place"] = ptrs == [p.data_ptr() for p in model.parameters()]
        result[run] = got
    target = Path(other).parent / f"saved-by-{dist.get_rank()}"
    result["save"] = (_error(lambda: fp8now.save(model, target, source=ckpt)), target.exists())
    return result


def _init(rank: int, size: int, port: int) -> None:
    torch.set_num_threads(1)  # several ranks share few cores: oversubscribed OpenMP threads crawl
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=20))


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _schemes(rank: int, ckpt: str, extra: str, log: list) -> dict:
    """Every scheme with and without tp_invariant: bytes, logits, reads; then reload_weights from `extra`."""
    import fp8now
    from fp8now import Fp8Config
    from safetensors.torch import load_file

    new = load_file(str(Path(extra) / "model.safetensors"))
    result: dict = {}
    for scheme in ("tensor", "channel", "block"):
        for inv in (False, True):
            log.clear()
            model, _ = fp8now.load(ckpt, Fp8Config(scheme=scheme, tp_invariant=inv), device="cpu",
                                   measure_error=False, tp_plan="auto")
            with torch.no_grad():
                logits = model(IDS).logits.float()
            result[scheme, inv] = (layer_bytes(model), logits, list(log), model._fp8now_tp.read_bytes)
        fp8now.reload_weights(model, new)
        result[scheme, "reloaded"] = layer_bytes(model)
    return result


def _families(rank: int, ckpt: str, extra: str, log: list) -> dict:
    """Each family folder of `ckpt` named in `extra` (phi3+packed: PACKED_PHI3's plan): logits, replicated."""
    import fp8now
    from fp8now import Fp8Config

    result: dict = {}
    for family in extra.split(","):
        plan = PACKED_PHI3 if family == "phi3+packed" else "auto"
        model, _ = fp8now.load(Path(ckpt) / family.split("+")[0], Fp8Config(scheme="tensor", tp_invariant=True),
                               device="cpu", measure_error=False, tp_plan=plan)
        with torch.no_grad():
            result[family] = (model(IDS).logits.float(), model._fp8now_tp.replicated)
    return result


def _unaligned(rank: int, ckpt: str, extra: str, log: list) -> dict:
    """block refused (the error, the reads before it), then tensor and channel bytes."""
    import fp8now
    from fp8now import Fp8Config

    result: dict = {"block": _error(lambda: fp8now.load(ckpt, Fp8Config(scheme="block"), device="cpu",
                                                        tp_plan="auto"))}
    result["block_reads"] = list(log)
    for scheme in ("tensor", "channel"):
        model, _ = fp8now.load(ckpt, Fp8Config(scheme=scheme), device="cpu", tp_plan="auto")
        result[scheme] = layer_bytes(model)
    return result


# scenario -> what a rank runs for it (the "failure" scenario, which ends the group, is _fail)
SCENARIOS = {"schemes": _schemes, "families": _families, "unaligned": _unaligned, "moe": _moe,
             "moe_reload": _moe_reload}


def _fail(rank: int, ckpt: str, extra: str, results: dict, name: str, out: str) -> None:
    """NaN in rank 1's slice of `ckpt`: both ranks record the load's error; then rank 1 writes its results
    and leaves without a word, and rank 0 records how loading `extra` ends; both exit (the group is broken)."""
    import fp8now
    from fp8now import Fp8Config

    results[name] = {"nan": _error(lambda: fp8now.load(ckpt, Fp8Config(scheme="channel"), device="cpu",
                                                       tp_plan="auto"))}
    if rank == 1:
        torch.save(results, Path(out) / f"{rank}.pt")
        os._exit(0)  # leaves without a word: the others must not hang
    results[name]["gone"] = _error(lambda: fp8now.load(extra, Fp8Config(scheme="tensor"), device="cpu",
                                                       tp_plan="auto"))
    torch.save(results, Path(out) / f"{rank}.pt")
    os._exit(0)  # the group is broken: nothing to tear down


def run(rank: int, size: int, port: int, tasks: list, out: str) -> None:
    """One rank of one process group running each (name, scenario, checkpoint, extra) of `tasks` in turn (a
    rank's start costs seconds: one group serves many checks); writes {name: result} to `out/<rank>.pt`.
    A "failure" task breaks the group, so it can only come last."""
    _init(rank, size, port)
    results: dict = {}
    log: list = []
    record_reads(log)
    for name, scenario, ckpt, extra in tasks:
        log.clear()
        if scenario == "failure":
            _fail(rank, ckpt, extra, results, name, out)
        results[name] = SCENARIOS[scenario](rank, ckpt, extra, log)
    torch.save(results, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()
