"""Fp8Embedding: per-row FP8 tables and their lookups against the independent loops of fp8_oracle, and the
three weight-scale layouts a tied head's table brings."""

from __future__ import annotations

import pytest
import torch
from fp8_oracle import quantize_loops, varied
from torch import nn

from fp8now import Fp8Config, Fp8Linear
from fp8now.layers.embedding import Fp8Embedding, lookup, quantize_rows

V, H = 300, 200   # partial 128x128 tiles in both dims; not a multiple of anything
# scheme -> (oracle group rows, group cols, rule)
ORACLE = {"channel": (1, -1, "row"), "tensor": (-1, -1, "tensor"), "block": (128, 128, "block")}


def table(seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return varied((V, H), dtype=dtype, seed=seed)


def reference_rows(w: torch.Tensor, ids: torch.Tensor, scheme: str) -> torch.Tensor:
    """The rows `ids` of `w` quantized by the oracle's loops and dequantized in float64 -> float32."""
    gr, gc, rule = ORACLE[scheme]
    q, s = quantize_loops(w, gr, gc, rule)                                   # q float64 values, s [R/gr, C/gc]
    rows = gr if gr != -1 else V
    cols = gc if gc != -1 else H
    spread = s.double().repeat_interleave(rows, 0)[:V].repeat_interleave(cols, 1)[:, :H]
    return (q * spread)[ids].float()


def random_ids(seed: int, shape=(3, 17)) -> torch.Tensor:
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    flat = ids.view(-1)
    flat[0], flat[-1] = 0, V - 1                                              # the padding row, the last row
    return ids


def embedding_of(w: torch.Tensor, padding_idx: int | None = 0) -> nn.Embedding:
    emb = nn.Embedding(V, H, padding_idx=padding_idx, dtype=w.dtype)
    with torch.no_grad():
        emb.weight.copy_(w)
    return emb


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_and_lookup_equal_the_oracle(seed):
    w = table(seed)
    layer = Fp8Embedding.from_embedding(embedding_of(w), name="model.embed_tokens")
    q_ref, s_ref = quantize_loops(w, 1, -1, "row")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (V, 1)
    assert torch.equal(layer.weight.double(), q_ref) and torch.equal(layer.weight_scale, s_ref)
    ids = random_ids(seed + 10)
    out = layer(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 17, H)
    # float32 products of FP8 values and float32 scales are exact before the one rounding to bf16
    assert torch.equal(out, reference_rows(w, ids, "channel").to(torch.bfloat16))
    # the same bytes as the channel scheme gives the matrix (quantize_rows is numerics' channel rule)
    q, s = quantize_rows(w)
    assert torch.equal(q.view(torch.uint8), layer.weight.view(torch.uint8)) and torch.equal(s, layer.weight_scale)


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_a_tied_head_table_serves_lookups_in_each_scale_layout(scheme):
    w = table(5)
    head = nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(w)
    fp8_head = Fp8Linear.from_linear(head, Fp8Config(scheme=scheme), name="lm_head")
    layer = Fp8Embedding(V, H, 0, dtype=torch.bfloat16, device="meta", name="model.embed_tokens", tied_to="lm_head")
    layer.tie_to(fp8_head)
    assert layer.weight is fp8_head.weight and layer.weight_scale is fp8_head.weight_scale
    ids = random_ids(7)
    assert torch.equal(layer(ids), reference_rows(w, ids, scheme).to(torch.bfloat16))
    with pytest.raises(ValueError, match="reads the FP8 weight of lm_head"):
        layer.load_(w)


def test_padding_row_is_returned_as_stored_like_nn_embedding():
    w = table(2)
    w[0] = 0.5                               # a checkpoint may store any value in the padding row
    emb = embedding_of(w, padding_idx=0)
    layer = Fp8Embedding.from_embedding(emb)
    pad = layer(torch.tensor([0, 0]))
    assert torch.equal(pad, emb(torch.tensor([0, 0])).detach())    # 0.5 is exact in FP8 with its row scale
    assert layer.padding_idx == 0 and "padding_idx=0" in repr(layer)


def test_nan_or_inf_raise_naming_the_tensor():
    w = table(3)
    w[17, 4] = float("nan")
    with pytest.raises(ValueError, match=r"model\.embed_tokens.*NaN or Inf"):
        Fp8Embedding.from_embedding(embedding_of(w), name="model.embed_tokens")
    w[17, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_rows(w, "emb")


def test_cast_moves_bytes_and_changes_only_the_lookup_dtype():
    w = table(4)
    layer = Fp8Embedding.from_embedding(embedding_of(w))
    before = layer.weight.clone()
    ids = random_ids(1)
    layer.half()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))
    out = layer(ids)
    assert out.dtype == torch.float16 and torch.equal(out, reference_rows(w, ids, "channel").half())


def test_reload_in_place_keeps_the_storage():
    layer = Fp8Embedding.from_embedding(embedding_of(table(0)))
    ptrs = (layer.weight.data_ptr(), layer.weight_scale.data_ptr())
    w2 = table(9)
    layer.load_(w2)
    assert (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == ptrs
    q_ref, s_ref = quantize_loops(w2, 1, -1, "row")
    assert torch.equal(layer.weight.double(), q_ref) and torch.equal(layer.weight_scale, s_ref)
    with pytest.raises(ValueError, match="shape"):
        layer.load_(table(0)[:10])


def test_pure_lookup_on_a_given_table():
    w = table(6, torch.float32)
    q, s = quantize_rows(w)
    ids = random_ids(3, (5,))
    got = lookup(ids, q, s, Fp8Config().scheme, torch.float32)
    assert torch.equal(got, reference_rows(w, ids, "channel"))
