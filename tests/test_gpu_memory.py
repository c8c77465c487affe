"""Peak GPU memory while loading a ~1.2B Llama-shaped checkpoint (SPEC §5; run on a GPU machine).

Bound: peak allocated during `load` <= final FP8 model bytes + 1.25 x the bf16 bytes of the largest
quantized layer + 64 MiB. Non-quantized tensors (embeddings, lm_head, norms) count as model bytes.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from fp8now import Fp8Config
from fp8now.loading.load import load
from fp8now.loading.reader import IN_FLIGHT
from tiny import save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the bound is on CUDA allocations"),
]

MIB = 2**20
LLAMA_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=16, kv_heads=16, vocab=32000)


def llama_tensors(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random bf16 tensors named and shaped as LlamaForCausalLM's state dict (untied)."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.bfloat16) * scale).contiguous()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim, scale=hidden ** -0.5),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden, scale=hidden ** -0.5),
            p + "mlp.up_proj.weight": rand(intermediate, hidden, scale=hidden ** -0.5),
            p + "mlp.down_proj.weight": rand(hidden, intermediate, scale=intermediate ** -0.5),
            p + "input_layernorm.weight": 1 + rand(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
        })
    tensors["model.norm.weight"] = 1 + rand(hidden, scale=0.1)
    tensors["lm_head.weight"] = rand(vocab, hidden, scale=hidden ** -0.5)
    return tensors


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16"}


def write_llama_checkpoint(folder: Path, shards: int = 2, **dims: int) -> Path:
    """A Llama-shaped random checkpoint (default ~1.2B parameters, 2 shards), written from the CPU."""
    dims = {**LLAMA_1B, **dims}
    return save_checkpoint(llama_tensors(**dims), llama_config(**dims), folder, shards=shards)


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("llama1b") / "ckpt")


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_peak_device_memory_while_loading(llama_1b, scheme):
    gc.collect()
    torch.cuda.empty_cache()
    model, report = load(llama_1b, Fp8Config(scheme=scheme), device="cuda")
    largest_bf16 = max(2 * row.n * row.k for row in report.layers)
    used = report.peak_device_bytes - report.device_bytes_at_start
    # the FP8 model, the layer being quantized (and a quarter of it in temporaries), the reader's read-ahead
    bound = report.model_bytes + 1.25 * largest_bf16 + IN_FLIGHT["cuda"] + 64 * MIB
    print(f"\n[{scheme}] peak during load {used / MIB:.1f} MiB; FP8 model {report.model_bytes / MIB:.1f} MiB; "
          f"largest layer bf16 {largest_bf16 / MIB:.1f} MiB; bound {bound / MIB:.1f} MiB; "
          f"headroom {(bound - used) / MIB:.1f} MiB; load {report.load_s:.1f} s; "
          f"bf16 weights {report.bf16_bytes / MIB:.0f} MiB -> fp8 {report.fp8_bytes / MIB:.0f} MiB")
    assert len(report.layers) == 16 * 7
    assert all(row.backend != "?" for row in report.layers)
    assert used <= bound, report.format_table()
    with torch.no_grad():
        logits = model(torch.randint(0, 32000, (1, 16), device="cuda")).logits
    assert torch.isfinite(logits).all()
    del model
