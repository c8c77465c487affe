"""evaluate: perplexity, KL and top-1 on a tiny random Llama with a byte-level tokenizer (fast, CPU)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8now import Fp8Config
from fp8now.cli.evaluate import (ALL_SCHEMES, batches, bundled_text, compare_models, evaluate, expand_schemes,
                             plot_schemes, scheme_config, tokenize, windows)
from tiny import write_tiny_checkpoint

SEQ_LEN, MAX_TOKENS = 64, 300  # 4 full windows and one of 44 tokens


def save_byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer (256 tokens, no merges) saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}   # a set: sorted, same ids every run
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(directory))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("eval") / "llama", "llama")
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def text() -> str:
    return bundled_text()[1][:2000]


def test_bundled_text_is_the_licences():
    name, text = bundled_text()
    assert name == "licenses.txt"
    assert text.startswith("===== GPL-3: GNU General Public License, version 3")
    assert text.count("\n===== ") == 5 and 120_000 < len(text) < 140_000


def test_scheme_names():
    assert expand_schemes(["all"]) == list(ALL_SCHEMES) == ["channel", "block", "tensor", "tensor-tensor"]
    assert expand_schemes(["ptpc", "channel", "fp8_block", "FP8_PER_TENSOR", "tensorwise"]) == [
        "channel", "block", "tensor-tensor"]
    key, config = scheme_config("tensor-tensor")
    assert key == "tensor-tensor" and config.scheme.value == "tensor" and config.act_kind() == "tensor"
    assert scheme_config("per-tensor") == ("tensor", Fp8Config(scheme="tensor"))
    with pytest.raises(ValueError, match=r"unknown FP8 scheme 'Int4'; fp8now names: .*tensor-tensor.*"
                                         r"eval also takes all"):
        expand_schemes(["Int4"])
    with pytest.raises(ValueError, match="FP8 scheme 'fp8': bare fp8"):
        expand_schemes(["fp8"])


def test_windows_and_batches():
    wins = windows(torch.arange(300), SEQ_LEN)
    assert [w.numel() for w in wins] == [64, 64, 64, 64, 44]
    assert torch.equal(torch.cat(wins), torch.arange(300))
    assert [tuple(b.shape) for b in batches(wins, 3)] == [(3, 64), (1, 64), (1, 44)]
    assert [w.numel() for w in windows(torch.arange(129), 64)] == [64, 64]  # a 1-token tail predicts nothing


def _straightforward(ref_dir: Path, text: str, scheme: str) -> dict[str, float]:
    """The same metrics written out plainly, window by window, with torch's own kl_div/cross_entropy."""
    from transformers import AutoModelForCausalLM

    from fp8now.loading.load import load

    ids = tokenize(ref_dir, text)[:MAX_TOKENS]
    ref = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.bfloat16).eval()
    fp8, _ = load(ref_dir, scheme_config(scheme)[1], device="cpu")
    kl = nll_ref = nll_fp8 = 0.0
    agree = n = 0
    kl_tokens = []
    with torch.no_grad():
        for start in range(0, len(ids), SEQ_LEN):
            x = ids[start:start + SEQ_LEN][None]
            if x.shape[1] < 2:
                continue
            a = ref(x).logits[0, :-1].float()
            b = fp8(x).logits[0, :-1].float()
            y = x[0, 1:]
            per_token = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="none")
            kl_tokens += per_token.sum(-1).tolist()
            kl += float(per_token.sum())
            nll_ref += float(F.cross_entropy(a, y, reduction="sum"))
            nll_fp8 += float(F.cross_entropy(b, y, reduction="sum"))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            n += y.numel()
    return {"kl": kl / n, "ppl_bf16": math.exp(nll_ref / n), "ppl_fp8": math.exp(nll_fp8 / n),
            "top1": agree / n, "n": n, "kl_tokens": kl_tokens}


def test_metrics_equal_a_straightforward_computation(tiny_dir, text):
    res = evaluate(tiny_dir, ["ptpc"], text, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN, device="cpu",
                   batch_size=3, progress=False, text_name="gpl")
    assert res["text"] == {"name": "gpl", "tokens": MAX_TOKENS, "tokens_in_text": len(text.encode()),
                           "windows": 5, "seq_len": SEQ_LEN, "predicted": MAX_TOKENS - 5}
    got, want = res["schemes"]["channel"], _straightforward(tiny_dir, text, "channel")
    assert got["kl"] > 0
    assert got["kl"] == pytest.approx(want["kl"], rel=1e-4)
    assert got["ppl_bf16"] == pytest.approx(want["ppl_bf16"], rel=1e-6)
    assert got["ppl_fp8"] == pytest.approx(want["ppl_fp8"], rel=1e-6)
    assert got["top1"] == pytest.approx(want["top1"])
    assert got["ppl_delta_pct"] == pytest.approx(100 * (got["ppl_fp8"] / got["ppl_bf16"] - 1))
    kl_tokens = np.array(want["kl_tokens"])
    assert got["predicted"] == len(kl_tokens) == want["n"]
    assert got["kl_p99"] == pytest.approx(np.percentile(kl_tokens, 99), rel=1e-3)
    assert got["kl_max"] == pytest.approx(kl_tokens.max(), rel=1e-3)
    assert got["kl_se"] == pytest.approx(kl_tokens.std(ddof=1) / math.sqrt(len(kl_tokens)), rel=1e-3)
    p = want["top1"]
    assert got["top1_se"] == pytest.approx(math.sqrt(p * (1 - p) / (want["n"] - 1)))


def test_all_schemes_give_sane_numbers_and_layer_rows(tiny_dir, text, tmp_path):
    res = evaluate(tiny_dir, ["all"], text, max_tokens=128, seq_len=SEQ_LEN, progress=False)
    assert list(res["schemes"]) == list(ALL_SCHEMES)
    for key, r in res["schemes"].items():
        assert r["kl"] >= 0 and 0 <= r["top1"] <= 1, key
        assert math.isfinite(r["ppl_bf16"]) and math.isfinite(r["ppl_fp8"]), key
        assert len(r["layers"]) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
        assert all(row["sqnr_db"] > 20 and row["rel_diff"] < 1e-2 for row in r["layers"]), key
        assert "layers" not in r["load_report"] and r["load_report"]["fp8_bytes"] > 0
    assert res["schemes"]["tensor-tensor"]["config"]["activation"] == "tensor"
    assert len({r["ppl_bf16"] for r in res["schemes"].values()}) == 1  # one reference for all
    png = plot_schemes(res, tmp_path / "sub" / "kl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["kl.png"]  # the temp file was renamed
    mask = os.umask(0)
    os.umask(mask)
    assert png.stat().st_mode & 0o777 == 0o666 & ~mask  # an ordinary file, not mkstemp's 0600


def test_identical_model_gives_zero_kl_and_full_agreement(tiny_dir, text):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.bfloat16).eval()
    same = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.bfloat16).eval()
    wins = windows(tokenize(tiny_dir, text)[:200], SEQ_LEN)
    m = compare_models(ref, {"same": same}, wins, batch_size=2, progress=False).metrics("same")
    assert m["kl"] == 0.0 and m["top1"] == 1.0 and m["ppl_fp8"] == m["ppl_bf16"] and m["ppl_delta_pct"] == 0.0


def test_too_short_text_and_bad_arguments(tiny_dir):
    with pytest.raises(ValueError, match="at least 2"):
        evaluate(tiny_dir, ["channel"], "a", progress=False)
    with pytest.raises(ValueError, match="seq_len"):
        evaluate(tiny_dir, ["channel"], "abc", seq_len=1, progress=False)
    with pytest.raises(ValueError, match="unknown FP8 scheme"):
        evaluate(tiny_dir, ["fp4"], "abc", progress=False)


def test_missing_tokenizer_is_one_clear_error(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "notok", "llama")
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(path, ["channel"], "some text", progress=False)


def test_config_default_is_channel():
    assert Fp8Config().scheme.value == expand_schemes(["channel"])[0]
