"""Tensor parallelism (SPEC §6) with real gloo collectives in 2 and 4 spawned processes.

The reference is the TP=1 load of the same checkpoint in this process; each rank's FP8 bytes and
scales must equal the matching slice of it exactly, and each rank must read only its slices. The ranks
are those of the two groups tp_groups.py starts once per test run for this file and test_tp_moe.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import fp8now
from fp8now import Fp8Config
from fp8now.hf.skeleton import build_skeleton
from fp8now.numerics import rel_diff
from tp_groups import FAMILY_RUNS, group, save_dense
from tp_worker import IDS, layer_bytes

# Which weight dim the Llama/Qwen2 plans split (independent of fp8now.parallel.shard's table).
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def rows(n: int, size: int, rank: int) -> tuple[int, int]:
    return n * rank // size, n * (rank + 1) // size


def _expect_slice(name: str, q: torch.Tensor, s: torch.Tensor, scheme: str, size: int, rank: int):
    """The TP=1 weight bytes and scale that rank `rank` must hold for layer `name`."""
    dim = SPLIT_DIM[name.rsplit(".", 1)[-1]]
    a, b = rows(q.shape[dim], size, rank)
    q_local = q.narrow(dim, a, b - a)
    if scheme == "tensor" or (scheme == "channel" and dim == 1):
        return q_local, s
    if scheme == "channel":
        return q_local, s[a:b]
    return q_local, s.narrow(dim, a // 128, math.ceil(b / 128) - a // 128)


def check_bytes(ref: dict, ranks: list[dict], scheme: str) -> None:
    size = len(ranks)
    for rank, got in enumerate(ranks):
        assert set(got) == set(ref)
        for name, (q, s) in ref.items():
            want_q, want_s = _expect_slice(name, q, s, scheme, size, rank)
            assert torch.equal(got[name][0], want_q), (scheme, rank, name)
            assert torch.equal(got[name][1], want_s), (scheme, rank, name)


def _check_reads(log: list, ckpt: Path, size: int, rank: int, read_bytes: int) -> None:
    """Every planned tensor read through get_slice at exactly this rank's range; the rest whole."""
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    plan = build_skeleton(ckpt, torch.bfloat16)._tp_plan  # the model's own plan: is embed_tokens split?
    vocab_split = any(k.endswith("embed_tokens") for k in plan)
    seen = {}
    for key, index, nbytes in log:
        assert key not in seen, f"{key} read twice"
        seen[key] = (index, nbytes)
    assert set(seen) == set(shapes)
    for key, shape in shapes.items():
        index, nbytes = seen[key]
        leaf = key.rsplit(".", 2)[-2] if key.endswith((".weight", ".bias")) else ""
        dim = SPLIT_DIM.get(leaf, 0 if leaf == "lm_head" or (leaf == "embed_tokens" and vocab_split) else None)
        if dim is None or (dim == 1 and key.endswith(".bias")):
            assert index == "full", key
            assert nbytes == 2 * math.prod(shape)
            continue
        a, b = rows(shape[dim], size, rank)
        assert index[dim] == slice(a, b) and all(i == slice(None) for i in index[:dim]), (key, index)
        assert nbytes == 2 * math.prod(shape) // size, key
    assert read_bytes == sum(n for _, n in seen.values())


@pytest.mark.parametrize("size,family", [(2, "qwen2"), (4, "llama")])
def test_every_scheme_matches_tp1_slices(size, family):
    """Bytes and scales = the TP=1 slices; tp_invariant logits = TP=1; reads = own slices; reload."""
    root, results = group(size)
    ckpt, new = root / family, root / f"{family}-new"
    ranks = [r["schemes"] for r in results]
    for scheme in ("tensor", "channel", "block"):
        model, _ = fp8now.load(ckpt, Fp8Config(scheme=scheme), device="cpu")
        with torch.no_grad():
            ref_logits = model(IDS).logits.float()
        for inv in (False, True):
            check_bytes(layer_bytes(model), [r[scheme, inv][0] for r in ranks], scheme)
            for r in ranks:
                assert torch.equal(r[scheme, inv][1], ranks[0][scheme, inv][1])  # replicated logits
            diff = rel_diff(ranks[0][scheme, inv][1], ref_logits)
            if inv:
                assert diff < 1e-4, (scheme, diff)
            else:  # local per-token scales and bf16 partial sums: about the quantization error itself
                assert diff < 2e-2, (scheme, diff)
        for rank, r in enumerate(ranks):
            _check_reads(r[scheme, False][2], ckpt, size, rank, r[scheme, False][3])
        reloaded, _ = fp8now.load(new, Fp8Config(scheme=scheme), device="cpu")
        check_bytes(layer_bytes(reloaded), [r[scheme, "reloaded"] for r in ranks], scheme)


def test_other_families_match_tp1():
    """The other families' own plans at TP=2 (phi3's fused projections gathered then split again,
    gemma's head tied to its embeddings, qwen3's head norms), and phi3 with a user plan splitting its
    fused gate_up in halves (packed_colwise), give the TP=1 logits with tp_invariant."""
    root, results = group(2)
    for family in FAMILY_RUNS:
        model, _ = fp8now.load(root / "families" / family.split("+")[0], Fp8Config(scheme="tensor"),
                               device="cpu")
        with torch.no_grad():
            ref = model(IDS).logits.float()
        for r in results:
            assert rel_diff(r["families"][family][0], ref) < 1e-4, (family, rel_diff(r["families"][family][0], ref))


def test_unaligned_block_refused_before_reading():
    """Hidden 192 splits into 96-column shards: block refused with no data read; tensor/channel exact."""
    root, results = group(2)
    ranks = [r["unaligned"] for r in results]
    for r in ranks:
        assert r["block"] is not None and "multiple of 128" in r["block"] and "layers.0." in r["block"]
        assert r["block_reads"] == []
    for scheme in ("tensor", "channel"):
        model, _ = fp8now.load(root / "llama", Fp8Config(scheme=scheme), device="cpu")
        check_bytes(layer_bytes(model), [r[scheme] for r in ranks], scheme)


def test_failing_rank_stops_the_others():
    """NaN in rank 1's half of a row-parallel weight: rank 1 names it, rank 0 names rank 1 and the layer;
    then rank 1 leaves without a word and rank 0 stops with an error instead of hanging (the group's
    last task: tp_groups)."""
    r0, r1 = (r["failure"] for r in group(2)[1])
    assert r1["nan"].startswith("ValueError") and "NaN" in r1["nan"] and "layers.1.mlp.down_proj" in r1["nan"]
    assert r0["nan"].startswith("RuntimeError") and "rank 1 failed" in r0["nan"]
    assert "layers.1.mlp.down_proj" in r0["nan"] and "NaN" in r0["nan"]
    assert r0["gone"] is not None and "another rank probably stopped" in r0["gone"], r0["gone"]


def test_plan_errors_without_processes(tmp_path):
    """No process group, an unknown style, a style on a parameter: clear errors, nothing loaded
    (the MoE experts' plan errors are in test_tp_moe.py)."""
    from fp8now.parallel.plan import resolve_plan

    ckpt = save_dense(tmp_path / "ckpt", "llama")
    with pytest.raises(RuntimeError, match="torchrun"):
        fp8now.load(ckpt, tp_plan="auto", device="cpu")
    dense = build_skeleton(ckpt, torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: tensor-parallel style"):
        resolve_plan(dense, {"model.layers.*.mlp.up_proj.weight": "colwise"})
    with pytest.raises(ValueError, match=r"style 'sideways' of model\.layers\.0\.mlp\.up_proj"):
        resolve_plan(dense, {"model.layers.*.mlp.up_proj": "sideways"})


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
@pytest.mark.parametrize("shape", [(320, 192), (64, 1000), (7, 6)])
def test_global_amax_gives_the_unsplit_bytes(scheme, shape):
    """numerics alone: shards quantized with the MAX of their amaxes equal the slices of the whole."""
    from fp8now.numerics import quantize_weight, weight_amax

    g = torch.Generator().manual_seed(shape[0] * shape[1])
    w = (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape[0], 1, generator=g))).bfloat16()
    q, s = quantize_weight(w, scheme)
    for dim in (0, 1):
        if scheme == "channel" and dim == 0:
            continue  # a row split needs no reduction for per-row scales
        halves = w.chunk(2, dim=dim)
        amax = torch.maximum(*(weight_amax(h, scheme) for h in halves))
        for h, q_want in zip(halves, q.chunk(2, dim=dim)):
            q_got, s_got = quantize_weight(h, scheme, amax=amax, chunk_bytes=256)
            assert torch.equal(q_got.view(torch.uint8), q_want.view(torch.uint8))
            assert torch.equal(s_got, s)
