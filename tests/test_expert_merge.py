"""loading.expert_merge.one_copy_merge against transformers' own converter (deep-copied, fed and run as transformers
runs it) on the per-expert tensors of real saved checkpoints of every MoE family fp8now loads: the same fused
tensors bit for bit where it applies, and None (the converter runs) where the parts do not fit it."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from safetensors.torch import load_file

from fp8now.loading.expert_merge import one_copy_merge
from moe_tiny import MOE_FAMILIES, moe_model


def _converters(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter
    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if isinstance(t, WeightConverter)]


def _parts(rule, tensors: dict[str, torch.Tensor], layer: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Per source pattern, layer `layer`'s per-expert (key, tensor) in expert order."""
    import re
    out = []
    for pattern in rule.source_patterns:
        rx = re.compile(rf"layers\.{layer}\..*" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")
        found = sorted(((int(m.group(1)), k) for k in tensors if (m := rx.search(k))), key=lambda x: x[0])
        out.append([(k, tensors[k]) for _, k in found])
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_one_copy_merge_equals_transformers_converter(tmp_path, family):
    model = moe_model(family, seed=7)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    merged = 0
    for rule in _converters(model):
        parts = _parts(rule, tensors, layer=1)
        if not parts[0]:
            continue
        ours = one_copy_merge(rule, [[t for _, t in p] for p in parts])
        converter = deepcopy(rule)
        target = rule.target_patterns[0]
        for pattern, p in zip(rule.source_patterns, parts):
            for key, t in p:
                converter.add_tensor(target, key, pattern, t)
        (want,) = converter.convert(target, model=model, config=model.config).values()
        if ours is None:   # a rule it leaves to transformers: only other operations
            assert [type(op).__name__ for op in rule.operations] not in (["MergeModulelist"],
                                                                         ["MergeModulelist", "Concatenate"])
            continue
        assert ours.dtype == want.dtype and ours.shape == want.shape and torch.equal(ours, want), rule.target_patterns
        merged += 1
    if family not in ("gpt_oss", "llama4_text"):   # families stored per expert: both their rules merged here
        assert merged == 2


def test_parts_that_do_not_fit_go_to_transformers():
    model = moe_model("qwen3_moe", seed=1)
    gate_up = next(r for r in _converters(model) if len(r.source_patterns) == 2)
    g = [torch.randn(4, 8) for _ in range(3)]
    assert one_copy_merge(gate_up, [g, [torch.randn(4, 8) for _ in range(2)]]) is None       # an expert missing
    assert one_copy_merge(gate_up, [g, [torch.randn(4, 8) for _ in range(2)] + [torch.randn(5, 8)]]) is None
    assert one_copy_merge(gate_up, [g, [t.double() for t in g]]) is None                    # dtypes differ
    stacked = one_copy_merge(gate_up, [g, [2 * t for t in g]])
    assert stacked.shape == (3, 8, 8) and torch.equal(stacked[1, 4:], 2 * g[1])
