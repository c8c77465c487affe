"""Scheme names, aliases and Fp8Config validation."""

import pytest

from fp8now import Fp8Config, Scheme
from fp8now.config import SCHEME_NAMES, parse_scheme_name, scheme_key


# Written out here from each tool's documentation (not read from SCHEME_NAMES): name -> (weights, activations).
EXPECTED = {
    "channel": ("channel", "token"), "block": ("block", "group"), "tensor": ("tensor", "token"),
    "tensor-tensor": ("tensor", "tensor"), "channel-token": ("channel", "token"), "block-group": ("block", "group"),
    "tensor-token": ("tensor", "token"),
    "per-tensor": ("tensor", "token"), "per_channel": ("channel", "token"), "per-block": ("block", "group"),
    # vLLM online quantization names
    "fp8_per_tensor": ("tensor", "tensor"), "fp8_per_channel": ("channel", "token"),
    "fp8_per_block": ("block", "group"), "ptpc_fp8": ("channel", "token"), "ptpc": ("channel", "token"),
    # llm-compressor presets
    "FP8_DYNAMIC": ("channel", "token"), "FP8_BLOCK": ("block", "group"),
    # torchao / torch._scaled_mm granularities
    "row": ("channel", "token"), "rowwise": ("channel", "token"), "tensorwise": ("tensor", "tensor"),
    "blockwise": ("block", "group"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_name_parses_to_its_scheme_and_activation(name):
    weights, act = EXPECTED[name]
    for typed in (name, name.upper(), name.lower().replace("_", "-"), f" {name} "):
        assert parse_scheme_name(typed) == (Scheme(weights), act), typed
        assert Scheme.parse(typed) is Scheme(weights)
        config = Fp8Config(scheme=typed)  # a name that fixes the activations sets them in the config
        assert (config.scheme.value, config.act_kind()) == (weights, act)
        assert scheme_key(config.scheme, config.act_kind()) == (f"{weights}-tensor" if act == "tensor" else weights)


def test_the_table_holds_exactly_the_names_tested():
    assert set(SCHEME_NAMES) == {n.lower().replace("_", "-") for n in EXPECTED}
    assert Scheme.parse(Scheme.BLOCK) is Scheme.BLOCK


@pytest.mark.parametrize("typed", ["fp8", "FP8", " Fp8 "])
def test_bare_fp8_is_refused_with_what_each_tool_means(typed):
    with pytest.raises(ValueError) as e:
        parse_scheme_name(typed)
    msg = str(e.value)
    assert msg.startswith(f"FP8 scheme {typed!r}:")
    assert "vLLM" in msg and "transformers" in msg and "llm-compressor" in msg
    assert "tensor-tensor" in msg and "type block" in msg and "static" in msg
    with pytest.raises(ValueError, match="bare fp8"):
        Fp8Config(scheme=typed)


@pytest.mark.parametrize("typed", ["int4", "Tensor-PT", " nvfp4_x "])
def test_unknown_scheme_echoes_the_input_and_lists_the_names(typed):
    with pytest.raises(ValueError) as e:
        Scheme.parse(typed)
    msg = str(e.value)
    assert msg.startswith(f"unknown FP8 scheme {typed!r};")
    assert "fp8now names: channel, block, tensor, tensor-tensor;" in msg
    assert "ptpc" in msg and "fp8-per-block" in msg and "tensorwise" in msg


def test_a_name_that_fixes_activations_conflicts_with_another_activation():
    assert Fp8Config(scheme="tensorwise", activation="tensor").act_kind() == "tensor"
    with pytest.raises(ValueError, match=r"scheme='tensorwise' means per-tensor activation scales, but "
                                         r"activation='token'"):
        Fp8Config(scheme="tensorwise", activation="token")
    with pytest.raises(ValueError, match="batch_invariant"):
        Fp8Config(scheme="fp8_per_tensor", batch_invariant=True)
    c = Fp8Config(scheme="tensor", moe_scheme="tensorwise")
    assert c.moe_scheme is Scheme.TENSOR and c.act_kind() == "tensor"


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
