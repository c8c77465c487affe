"""keep_select: the ranking of sensitivity rows and the choice of layers kept in bf16 (pure functions), and the
parsing of Fp8Config(keep_bf16=...)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from fp8now import Fp8Config
from fp8now.config import keep_bf16_fraction
from fp8now.sensitivity.select import ranked, select

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rows_from(scores: list[float], sizes: list[int]) -> list[dict]:
    return [{"name": f"model.layers.{i // 7}.x.{PROJ[i % 7]}", "bytes": b, "score": s}
            for i, (s, b) in enumerate(zip(scores, sizes))]


layer_lists = st.lists(st.tuples(st.floats(-1e-3, 1e-2, allow_nan=False), st.integers(1, 1000)),
                       min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(layer_lists, st.floats(0, 0.99))
def test_the_budget_holds_and_nothing_that_fits_is_passed_over(pairs, fraction):
    rows = rows_from([s for s, _ in pairs], [b for _, b in pairs])
    out = select(rows, fraction)
    total = sum(b for _, b in pairs)
    assert out.total_bytes == total and out.budget_bytes == math.floor(fraction * total)
    assert out.kept_bytes <= out.budget_bytes
    assert all(row["score"] > 0 for row in out.kept)
    kept = set(out.names)
    # every positive layer left out would not have fit beside the kept layers ranked above it
    order = ranked(rows)
    for row in order:
        if row["name"] in kept or row["score"] <= 0:
            continue
        above = sum(r["bytes"] for r in order if r["name"] in kept and r["rank"] < row["rank"])
        assert above + row["bytes"] > out.budget_bytes


@settings(max_examples=200, deadline=None)
@given(layer_lists)
def test_ranking_follows_the_scores_then_size_then_model_order(pairs):
    rows = rows_from([s for s, _ in pairs], [b for _, b in pairs])
    order = ranked(rows)
    assert [r["rank"] for r in order] == list(range(1, len(rows) + 1))
    assert sorted(r["name"] for r in order) == sorted(r["name"] for r in rows)
    index = {r["name"]: i for i, r in enumerate(rows)}
    for a, b in zip(order, order[1:]):
        assert a["score"] >= b["score"]
        if a["score"] == b["score"]:
            assert (a["bytes"], index[a["name"]]) < (b["bytes"], index[b["name"]])


def test_ties_prefer_the_smaller_layer_then_the_earlier_one():
    rows = rows_from([2e-3, 1e-3, 1e-3, 1e-3, 5e-4], [50, 40, 10, 10, 10])
    order = [r["name"] for r in ranked(rows)]
    assert order == [rows[i]["name"] for i in (0, 2, 3, 1, 4)]
    # a budget of 25 bytes: the 50-byte leader does not fit, the two 10-byte ties do, the 40-byte one not
    out = select(rows, 25 / 120)
    assert out.names == [rows[2]["name"], rows[3]["name"]] and out.kept_bytes == 20


def test_non_positive_and_nan_scores_are_never_kept():
    rows = rows_from([0.0, -1e-4, float("nan"), 1e-6], [1, 1, 1, 1])
    out = select(rows, 0.99)
    assert out.names == [rows[3]["name"]]
    assert ranked(rows)[-1]["name"] == rows[2]["name"]   # NaN ranks last


def test_an_explicit_ignore_wins_and_costs_no_budget():
    rng = random.Random(4)
    rows = rows_from([rng.uniform(0, 1e-3) for _ in range(21)], [rng.randint(10, 100) for _ in range(21)])
    top = ranked(rows)[0]["name"]
    pattern = top.rsplit(".", 1)[0] + ".*"            # a glob over the top layer's whole module
    hit = [r["name"] for r in rows if r["name"].startswith(top.rsplit(".", 1)[0] + ".")]
    out = select(rows, 0.2, ignore=(pattern,))
    assert top not in out.names and not set(hit) & set(out.names)
    assert out.ignored == [(name, pattern) for name in [r["name"] for r in ranked(rows)] if name in hit]
    # the same choice as when those layers could never be chosen (scores <= 0), with the same budget
    unscored = [{**r, "score": -1.0} if r["name"] in hit else r for r in rows]
    assert out.names == select(unscored, 0.2).names


@pytest.mark.parametrize("text,fraction", [("auto:0.05", 0.05), ("AUTO: 0.2", 0.2), ("auto:0", 0.0)])
def test_keep_bf16_values(text, fraction):
    assert keep_bf16_fraction(text) == fraction
    assert Fp8Config(keep_bf16=text).keep_bf16 == text


@pytest.mark.parametrize("text", ["auto:1", "auto:-0.1", "0.05", "auto:", "auto:five", "manual:0.1", "auto:nan"])
def test_bad_keep_bf16_values_say_the_form(text):
    with pytest.raises(ValueError, match=r"keep_bf16=.*expected 'auto:F' with 0 <= F < 1"):
        Fp8Config(keep_bf16=text)
