"""MoE experts under tensor parallelism (SPEC §6) with real gloo collectives in 2 and 4 spawned processes:
expert parallelism ("ep", whole experts per rank) and TP inside the experts ("tp").

The reference is the TP=1 load of the same checkpoint in this process. Each rank's experts bytes and
scales must equal the matching slice of it exactly (the slices are worked out here from the rank and
the group size), each rank must read only its experts or slices, and the logits must equal TP=1. The
ranks are those of the two groups tp_groups.py starts once per test run for this file and test_tp.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import fp8now
from fp8now import Fp8Config
from fp8now.layers.moe import Fp8Experts
from fp8now.numerics import rel_diff
from moe_tiny import save_moe
from tiny import tiny_model
from test_tp import check_bytes, rows
from tp_groups import GPT_OSS_RUNS, LLAMA4_RUNS, MIXTRAL_REFUSED, MIXTRAL_RUNS, QWEN3_RUNS, group
from tp_worker import IDS, experts_bytes, layer_bytes

TOL = 1e-4       # tp_invariant: logits vs TP=1 (the dense TP tests' bound)
DEFAULT = 2e-2   # without tp_invariant: row-parallel inputs quantized per shard (1e-4 - 8e-4 here)
# Per-expert checkpoint keys: (expert, which matrix). gate/up (w1/w3) rows and down (w2) columns hold I.
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$")
# GPT-OSS and Llama4 store their experts fused and transposed ([E, H, 2I], [E, I, H]): the dim each
# leaf's I is on (down_proj_bias has none). GPT-OSS interleaves gate and up (a rank's columns are one
# run); Llama4 does not (two runs, one read each).
FUSED_KEY = re.compile(r"\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
FUSED_I_DIM = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}


def _expected(ref: tuple, scheme: str, mode: str, size: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The TP=1 experts tensors (w13, w13_scale, w2, w2_scale) rank `rank` must hold."""
    w13, s13, w2, s2 = ref
    if mode == "ep":
        a, b = rows(w13.shape[0], size, rank)
        return w13[a:b], s13[a:b], w2[a:b], s2[a:b]
    i = w2.shape[2]
    a, b = rows(i, size, rank)

    def halves(t: torch.Tensor, lo: int, hi: int, whole: int) -> torch.Tensor:
        return torch.cat([t[:, lo:hi], t[:, whole + lo:whole + hi]], dim=1)

    w13, w2 = halves(w13, a, b, i), w2[:, :, a:b]
    if scheme == "channel":
        s13 = halves(s13, a, b, i)
    elif scheme == "block":
        s13, s2 = halves(s13, a // 128, b // 128, i // 128), s2[:, :, a // 128:b // 128]
    return w13, s13, w2, s2


def _check_reads(log: list, ckpt: Path, mode: str, size: int, rank: int, read_bytes: int) -> None:
    """Experts keys: ep reads its experts whole and never another's; tp reads every expert's I slice."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    reads: dict[str, list] = {}
    for key, index, nbytes in log:
        reads.setdefault(key, []).append((index, nbytes))
    assert read_bytes == sum(n for parts in reads.values() for _, n in parts)
    for key, parts in reads.items():
        fused = FUSED_KEY.search(key)
        if fused is not None:
            _check_fused_read([i for i, _ in parts], fused.group(1), shapes[key], mode, size, rank)
        else:
            assert len(parts) == 1, f"{key} read twice"
    seen = {key: parts[0] for key, parts in reads.items()}
    num_experts = 1 + max((int(m.group(1)) for k in shapes if (m := EXPERT_KEY.search(k))), default=0)
    first, last = rows(num_experts, size, rank)
    for key, shape in shapes.items():
        match = EXPERT_KEY.search(key)
        if match is None:
            assert key in seen, key
            continue
        expert, which = int(match.group(1)), match.group(2)
        if mode == "ep":
            assert (key in seen) == (first <= expert < last), (key, rank)
            assert key not in seen or seen[key] == ("full", 2 * shape[0] * shape[1]), key
            continue
        dim = 1 if which in ("down_proj", "w2") else 0
        index, nbytes = seen[key]
        assert index[dim] == slice(*rows(shape[dim], size, rank)) and index[:dim] == (slice(None),) * dim, key
        assert nbytes == 2 * shape[0] * shape[1] // size, key


def _check_fused_read(indexes: list, leaf: str, shape: list[int], mode: str, size: int, rank: int) -> None:
    """ep: this rank's experts (dim 0); tp: this rank's I range (of the gate half and of the up half)."""
    if mode == "ep":
        assert indexes == [(slice(*rows(shape[0], size, rank)),)], (leaf, indexes)
        return
    if leaf == "down_proj_bias":
        assert indexes == ["full"], (leaf, indexes)
        return
    dim = FUSED_I_DIM[leaf]
    whole = (slice(None),) * dim
    if leaf == "down_proj":
        want = [(*whole, slice(*rows(shape[dim], size, rank)))]
    elif len(indexes) == 1:  # interleaved (GPT-OSS): gate_j, up_j for j in this rank's range
        a, b = rows(shape[dim] // 2, size, rank)
        want = [(*whole, slice(2 * a, 2 * b))]
    else:
        i = shape[dim] // 2
        a, b = rows(i, size, rank)
        want = [(*whole, slice(a, b)), (*whole, slice(i + a, i + b))]
    assert indexes == want, (leaf, indexes, want)


def _check_run(ckpt: Path, ranks: list[dict], run: str, refs: dict, dense_split: bool = True) -> float:
    """Bytes, reads and logits of one `mode:scheme:invariant` run on every rank; -> the worst rel_diff.
    `dense_split`: the model's own plan splits the attention (else, and for "plan" runs, it stays whole)."""
    fields, at, backend = run.partition("@")
    mode, scheme, inv = fields.split(":")
    ref_layers, ref_experts, ref_logits = refs[scheme + at + backend]
    mode = "tp" if mode == "plan" else mode
    worst = 0.0
    for rank, result in enumerate(ranks):
        assert not isinstance(result[run][0], str), result[run][0]
        layers, experts, logits, log, read_bytes, splits, backends = result[run]
        assert set(experts) == set(ref_experts)
        assert set(backends.values()) == {backend or "cpu"}, (run, backends)   # the split layers' own backend
        for name, ref in ref_experts.items():
            want = _expected(ref, scheme, mode, len(ranks), rank)
            for got, expect in zip(experts[name], want):
                assert torch.equal(got, expect), (run, rank, name)
            assert splits[name].mode == mode
        if dense_split and not run.startswith("plan"):
            check_bytes(ref_layers, [r[run][0] for r in ranks], scheme)
        else:
            assert all(torch.equal(layers[n][0], q) and torch.equal(layers[n][1], s)
                       for n, (q, s) in ref_layers.items()) and set(layers) == set(ref_layers)
        _check_reads(log, ckpt, mode, len(ranks), rank, read_bytes)
        worst = max(worst, rel_diff(logits, ref_logits))
    assert worst < (TOL if inv == "1" else DEFAULT), (run, worst)
    return worst


def _refs(ckpt: Path, schemes) -> dict:
    """TP=1 loads: scheme, or "scheme@backend" -> (layer bytes, experts bytes, logits)."""
    out = {}
    for key in schemes:
        scheme, _, backend = key.partition("@")
        model, _ = fp8now.load(ckpt, Fp8Config(scheme=scheme, backend=backend or "auto"), device="cpu",
                               measure_error=False)
        assert {m.backend for m in model.modules() if isinstance(m, Fp8Experts)} == {backend or "cpu"}
        with torch.no_grad():
            out[key] = (layer_bytes(model), experts_bytes(model), model(IDS).logits.float())
    return out


def test_qwen3_moe_two_ranks_every_scheme():
    """Qwen3-MoE at 2 ranks, 128-aligned shards: ep and tp, every scheme, with tp_invariant (rel_diff <
    1e-4) and without (stated bound); tp also through a plan dict in transformers' own expert styles;
    the split layers on the CPU default (cpu) backend, and once on the exact reference backend."""
    root, results = group(2)
    ckpt, ranks = root / "moe" / "qwen3_moe", [r["qwen3_moe"] for r in results]
    refs = _refs(ckpt, ("tensor", "channel", "block", "block@reference"))
    diffs = {run: _check_run(ckpt, ranks, run, refs) for run in QWEN3_RUNS}
    print("logits rel_diff vs TP=1:", diffs)
    for mode in ("ep", "tp"):  # the NaN sits in rank 1's expert (ep) or in rank 1's half of it (tp)
        (e0, _), (e1, _) = (r[f"{mode}:channel:0:nan"] for r in ranks)
        assert e1.startswith("ValueError") and "NaN" in e1 and "model.layers.1.mlp.experts" in e1, e1
        assert e0.startswith("RuntimeError") and "rank 1 failed" in e0 and "NaN" in e0, e0
        assert "experts model.layers.1.mlp.experts" in e0, e0


def test_reload_weights_on_split_experts():
    """RL refit of a 2-rank Qwen3-MoE (ep, and tp inside the experts): reload_weights takes full tensors,
    per-expert checkpoint keys or transformers' fused params, keeps this rank's part in place and
    leaves it equal, byte for byte and in its logits, to a fresh split load of the same weights; saving
    a split model is refused."""
    ranks = [r["moe_reload"] for r in group(2)[1]]   # tp_groups: the Qwen3-MoE above, and one of seed 5
    for rank, result in enumerate(ranks):
        assert result["fused_keys"] and result["per_expert_keys"]   # both spellings were exercised
        for run in ("ep:channel", "tp:tensor", "tp:block"):
            got = result[run]
            assert got["in_place"], (run, rank)
            for which in ("other", "fused"):
                (layers, experts, logits), (want_layers, want_experts, want_logits), partial = got[which]
                assert partial == [], (run, which, partial)
                assert set(experts) == set(want_experts) and len(experts) == 2
                for name, parts in experts.items():
                    assert all(torch.equal(a, b) for a, b in zip(parts, want_experts[name])), (run, which, name)
                for name, (q, sc) in layers.items():
                    assert torch.equal(q, want_layers[name][0]) and torch.equal(sc, want_layers[name][1])
                assert torch.equal(logits, want_logits), (run, which, rank)
        a, b = (r["ep:channel"]["other"][0][1] for r in ranks)   # ep: the ranks hold different experts
        assert not torch.equal(next(iter(a.values()))[0], next(iter(b.values()))[0])
        # saving a rank's slices would write a checkpoint that passes for the whole model: refused, no folder
        error, written = result["save"]
        assert error.startswith("ValueError") and f"rank {rank} of 2 holds slices" in error, error
        assert "load it without tp_plan" in error and not written


def test_mixtral_four_ranks():
    """Mixtral (per-expert w1/w2/w3 keys renamed by transformers' rules) at 4 ranks: one expert per rank
    (ep) or a quarter of every expert (tp); unaligned block shards refused before any read."""
    root, results = group(4)
    ckpt, ranks = root / "moe" / "mixtral", [r["mixtral"] for r in results]
    refs = _refs(ckpt, ("tensor", "channel"))
    diffs = {run: _check_run(ckpt, ranks, run, refs) for run in MIXTRAL_RUNS}
    print("logits rel_diff vs TP=1:", diffs)
    for rank, result in enumerate(ranks):
        error, log = result[MIXTRAL_REFUSED]
        assert error.startswith("ValueError") and "multiple of 128" in error, error
        assert "model.layers.0.mlp.experts" in error and f"{32 * rank}:{32 * (rank + 1)}" in error, error
        assert log == []


def _meta_model(family: str):
    """The CausalLM of a tiny config on the meta device, its experts swapped for meta Fp8Experts."""
    from fp8now.hf.experts import swap_experts, target_experts
    from fp8now.loading.experts import ExpertsLoad
    from moe_tiny import moe_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(moe_config(family))
    config = Fp8Config()
    return model, ExpertsLoad(model, swap_experts(model, target_experts(model, config)[0], config))


def test_experts_plan_errors_without_processes(tmp_path):
    """moe_parallel's values, plan dicts that contradict it or themselves, unknown expert styles, experts
    that do not split evenly: clear errors naming what to change. Placement: transformers' plan where
    the family has one (Shard(0)), else the same even contiguous split."""
    from fp8now.parallel.experts import _split, experts_mode
    from fp8now.parallel.plan import resolve_plan

    model, load = _meta_model("qwen3_moe")
    names = list(load.layers)
    gate_up, down = "model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"
    # transformers' own plans: 5.17 put TP inside the experts in tp_plan, 5.25 EP in ep_plan; "auto" asks neither
    assert experts_mode("auto", names, None) == "ep" and experts_mode("auto", names, "tp") == "tp"
    assert experts_mode({gate_up: "packed_colwise", down: "rowwise"}, names, None) == "tp"
    assert experts_mode({gate_up: "grouped_gemm", down: "grouped_gemm",
                         "model.layers.*.mlp.experts": "ep_dispatch_experts"}, names, None) == "ep"
    with pytest.raises(ValueError, match="moe_parallel must be 'ep'"):
        experts_mode("auto", names, "expert")
    with pytest.raises(ValueError, match="tp on the MoE experts but moe_parallel='ep'"):
        experts_mode({gate_up: "packed_colwise"}, names, "ep")
    with pytest.raises(ValueError, match="ep and tp on the MoE experts"):
        experts_mode({gate_up: "packed_colwise", down: "grouped_gemm"}, names, None)
    with pytest.raises(ValueError, match=r"style 'sideways' of model\.layers\.\*\.mlp\.experts\.down_proj"):
        experts_mode({down: "sideways"}, names, None)
    # a 5.17-style plan with the expert entries: the dense plan keeps only the attention
    plan = {"model.layers.*.self_attn.q_proj": "colwise", gate_up: "packed_colwise", down: "rowwise",
            "model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.gate": "ep_router"}
    assert set(resolve_plan(model, plan, names)) == {f"model.layers.{i}.self_attn.q_proj" for i in range(2)}
    layer = load.layers[names[0]][0]
    with pytest.raises(ValueError, match=r"mlp\.experts: 8 experts do not split evenly over 3 expert-parallel"):
        _split(model, names[0], layer, "ep", 3, 0)
    with pytest.raises(ValueError, match=r"expert intermediate size\): dim of 128 does not split evenly over 3"):
        _split(model, names[0], layer, "tp", 3, 0)
    llama4, load4 = _meta_model("llama4_text")  # 5.25 gives it no expert-parallel plan, 5.17 does
    name4 = next(iter(load4.layers))
    split = _split(llama4, name4, load4.layers[name4][0], "ep", 2, 1)
    planned = "grouped_gemm" in (llama4._ep_plan or {}).values()
    assert split.experts == (2, 4) and split.placement.startswith("transformers" if planned else "even contiguous")
    assert _split(model, names[0], layer, "ep", 2, 1).placement.startswith("transformers ep_plan grouped_gemm")
    ckpt = save_moe("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="moe_parallel splits MoE experts across a tensor-parallel group"):
        fp8now.load(ckpt, device="cpu", moe_parallel="ep")
    dense = tmp_path / "dense"
    tiny_model("llama").save_pretrained(dense)
    fp8 = fp8now.save(fp8now.load(dense, Fp8Config(scheme="channel"), device="cpu")[0], tmp_path / "fp8",
                      source=dense)
    with pytest.raises(ValueError, match="FP8 checkpoint .quantization_config.: tp_plan is not supported"):
        fp8now.load(fp8, device="cpu", tp_plan="auto")  # not silently loaded whole on every rank


def test_gpt_oss_fused_experts_two_ranks():
    """GPT-OSS keeps its experts fused on disk ([E, H, 2I], gate/up interleaved, biases): each rank reads
    its slice of the fused tensors (get_slice), down_proj's bias is added once after the sum."""
    root, results = group(2)
    ckpt, ranks = root / "moe" / "gpt_oss", [r["gpt_oss"] for r in results]
    refs = _refs(ckpt, ("tensor", "channel"))
    diffs = {run: _check_run(ckpt, ranks, run, refs, dense_split=False) for run in GPT_OSS_RUNS}
    print("logits rel_diff vs TP=1:", diffs)


def test_llama4_dense_input_experts_two_ranks():
    """Llama4: fused transposed experts (gate and up halves read as two slices), router-scaled dense
    input (its [E*T, H] rows summed over the group); transformers 5.25 has no expert-parallel plan for
    it (the even contiguous split, the same placement)."""
    root, results = group(2)
    ckpt, ranks = root / "moe" / "llama4_text", [r["llama4"] for r in results]
    refs = _refs(ckpt, ("tensor", "channel"))
    diffs = {run: _check_run(ckpt, ranks, run, refs) for run in LLAMA4_RUNS}
    print("logits rel_diff vs TP=1:", diffs)
