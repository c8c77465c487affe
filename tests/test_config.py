"""Scheme names, aliases and Fp8Config validation."""

import pytest

from fp8now import Fp8Config, Scheme


@pytest.mark.parametrize("name,scheme", [
    ("tensor", Scheme.TENSOR), ("per-tensor", Scheme.TENSOR), ("FP8", Scheme.TENSOR),
    ("channel", Scheme.CHANNEL), ("ptpc", Scheme.CHANNEL), ("per_channel", Scheme.CHANNEL),
    ("fp8_dynamic", Scheme.CHANNEL), ("block", Scheme.BLOCK), ("per-block", Scheme.BLOCK),
    ("fp8_block", Scheme.BLOCK), (Scheme.BLOCK, Scheme.BLOCK),
])
def test_parse_aliases(name, scheme):
    assert Scheme.parse(name) is scheme


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown FP8 scheme 'int4'.*ptpc.*tensor"):
        Scheme.parse("int4")


def test_config_defaults_and_parsing():
    c = Fp8Config(scheme="ptpc", moe_scheme="fp8_block", ignore=["lm_head", "re:.*gate$"])
    assert c.scheme is Scheme.CHANNEL and c.moe_scheme is Scheme.BLOCK
    assert c.ignore == ("lm_head", "re:.*gate$") and c.expert_scheme is Scheme.BLOCK
    assert c.act_kind() == "token" and c.act_kind(Scheme.BLOCK) == "group"
    with pytest.raises(Exception):
        c.scheme = Scheme.TENSOR  # frozen


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "cutlass"}, "unknown backend 'cutlass'"),
    ({"ignore": "lm_head"}, "sequence of names"),
    ({"ignore": ("re:(",)}, "bad regex"),
    ({"ignore": ("",)}, "non-empty"),
    ({"scheme": "block", "activation": "token"}, "does not fit scheme 'block'"),
    ({"scheme": "channel", "activation": "tensor"}, "does not fit scheme 'channel'"),
    ({"scheme": "tensor", "activation": "tensor", "batch_invariant": True}, "batch_invariant"),
    ({"activation": "row"}, "unknown activation"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Fp8Config(**kwargs)


def test_tensor_scheme_may_use_per_tensor_activations():
    assert Fp8Config(scheme="tensor", activation="tensor").act_kind() == "tensor"
