"""Schemes, their group shapes, and the frozen user configuration (SPEC §3)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

# Names a user may pass as `backend=`; "auto" lets the dispatch table choose.
BACKEND_NAMES = ("auto", "reference", "cpu", "torch", "triton", "triton-w8a16")

# Activation quantization a user may force; "auto" takes the scheme's default (SPEC §3 table).
ACTIVATION_NAMES = ("auto", "token", "tensor", "group")

# How weights become FP8 bytes and scales (Fp8Config.weight_numerics) -> what it is. The llm-compressor
# rules exist for its data-free presets only: FP8_DYNAMIC (channel) and FP8_BLOCK (block).
WEIGHT_NUMERICS: dict[str, str] = {
    "spec": "the SPEC's float32 rules (SPEC §4)",
    "llm-compressor": "llm-compressor's bytes: scales in the weight's dtype, the quotient rounded to it before "
                      "FP8 (its torch ops: what it writes on a CPU or a GPU before Hopper)",
    "llm-compressor-triton": "llm-compressor's bytes when it ran on a Hopper or newer GPU with Triton "
                             "(the same scales, the quotient in float32)",
}


class Scheme(str, Enum):
    """A pair of group shapes: which weight and activation elements share one scale."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"

    @classmethod
    def parse(cls, name: str | Scheme) -> Scheme:
        """The weight scheme of any accepted name: `Scheme.parse("ptpc") is Scheme.CHANNEL`."""
        return name if isinstance(name, Scheme) else parse_scheme_name(name)[0]

# The schemes of llm-compressor's data-free presets, FP8_DYNAMIC and FP8_BLOCK (weight_numerics other than spec).
LLMC_SCHEMES = (Scheme.CHANNEL, Scheme.BLOCK)

# Group shapes (rows, cols) of one scale; -1 spans the whole dimension.
#   weight [N, K]: tensor (-1, -1) -> scale [];  channel (1, -1) -> [N, 1];  block (128, 128) -> [N/128, K/128]
WEIGHT_GROUP: dict[Scheme, tuple[int, int]] = {
    Scheme.TENSOR: (-1, -1),
    Scheme.CHANNEL: (1, -1),
    Scheme.BLOCK: (128, 128),
}
#   activation [M, K]: token (1, -1) -> [M, 1];  tensor (-1, -1) -> [];  group (1, 128) -> [M, K/128]
ACT_GROUP: dict[str, tuple[int, int]] = {
    "token": (1, -1),
    "tensor": (-1, -1),
    "group": (1, 128),
}
# The activation quantization each scheme uses unless overridden (tensor: per token, SPEC §3).
DEFAULT_ACT: dict[Scheme, str] = {
    Scheme.TENSOR: "token",
    Scheme.CHANNEL: "token",
    Scheme.BLOCK: "group",
}
# Which overrides make sense per scheme: block GEMMs need 1x128 groups; channel needs row scales.
ALLOWED_ACT: dict[Scheme, tuple[str, ...]] = {
    Scheme.TENSOR: ("token", "tensor"),
    Scheme.CHANNEL: ("token",),
    Scheme.BLOCK: ("group",),
}


# Why `block` refuses fast_accum instead of ignoring it.
FAST_ACCUM_BLOCK = ("its GEMMs multiply every 128-wide K-block's product by that block's own scales, so each "
                    "product leaves the tensor-core accumulator after one block anyway; there is no long "
                    "accumulation to make faster. Use scheme 'channel' or 'tensor' with fast_accum=True, or "
                    "block without it")


# Every scheme name a user may type -> (weight scheme, activation kind). Keys are lower case with `-`;
# parse_scheme_name folds case and `_`. fp8now's grammar: `<weight>` (the scheme's default
# activations) or `<weight>-<activation>`. The other tools' names map to what those tools compute.
SCHEME_NAMES: dict[str, tuple[Scheme, str]] = {
    # fp8now's own
    "channel": (Scheme.CHANNEL, "token"), "block": (Scheme.BLOCK, "group"),
    "tensor": (Scheme.TENSOR, "token"), "tensor-tensor": (Scheme.TENSOR, "tensor"),
    "channel-token": (Scheme.CHANNEL, "token"), "block-group": (Scheme.BLOCK, "group"),
    "tensor-token": (Scheme.TENSOR, "token"),
    "per-tensor": (Scheme.TENSOR, "token"), "per-channel": (Scheme.CHANNEL, "token"),
    "per-block": (Scheme.BLOCK, "group"),
    # vLLM (`--quantization`): its documented fp8_per_tensor recipe scales activations per tensor
    "fp8-per-tensor": (Scheme.TENSOR, "tensor"), "fp8-per-channel": (Scheme.CHANNEL, "token"),
    "fp8-per-block": (Scheme.BLOCK, "group"), "ptpc-fp8": (Scheme.CHANNEL, "token"),
    "ptpc": (Scheme.CHANNEL, "token"),
    # llm-compressor presets (its `FP8` calibrates static activation scales: see AMBIGUOUS_NAMES)
    "fp8-dynamic": (Scheme.CHANNEL, "token"), "fp8-block": (Scheme.BLOCK, "group"),
    # torchao / torch._scaled_mm scaling granularities (the same granularity for both operands)
    "row": (Scheme.CHANNEL, "token"), "rowwise": (Scheme.CHANNEL, "token"),
    "tensorwise": (Scheme.TENSOR, "tensor"), "blockwise": (Scheme.BLOCK, "group"),
}

# Names that mean different things in different tools: refused with what each one means.
AMBIGUOUS_NAMES: dict[str, str] = {
    "fp8": "bare fp8 means a different scheme in each tool, so fp8now does not guess: "
           "vLLM's --quantization fp8 is per-tensor weights with dynamic per-tensor activation scales "
           "(type tensor-tensor, or fp8_per_tensor); transformers' FineGrainedFP8Config (quant_method "
           "\"fp8\") is 128x128 weight blocks with 1x128 activation groups (type block, or fp8_block); "
           "llm-compressor's FP8 preset is per-tensor weights with static per-tensor activation scales "
           "from calibration, which fp8now does not do (tensor-tensor is its dynamic counterpart). "
           "fp8now's default is channel (per-channel weights, per-token activations)",
}


# Fp8Config.keep_bf16: "auto:F" keeps in bf16 the layers a data-free sensitivity pass ranks highest, within
# the fraction F (0 <= F < 1) of the quantizable weight bytes (fp8now.sensitivity.keep).
KEEP_BF16_FORM = "'auto:F' with 0 <= F < 1, e.g. 'auto:0.05' (the most sensitive layers within 5% of the weight bytes)"


def keep_bf16_fraction(text: str) -> float:
    """The fraction F of a `keep_bf16` value "auto:F"; errors quote `text` and show the form."""
    kind, _, value = str(text).strip().partition(":")
    try:
        fraction = float(value) if kind.strip().lower() == "auto" else None
    except ValueError:
        fraction = None
    if fraction is None or not 0.0 <= fraction < 1.0:
        raise ValueError(f"keep_bf16={text!r}: expected {KEEP_BF16_FORM}")
    return fraction


def parse_scheme_name(text: str) -> tuple[Scheme, str]:
    """(weight scheme, activation kind) of a scheme name; errors quote `text` exactly as given."""
    key = str(text).strip().lower().replace("_", "-")
    if key in SCHEME_NAMES:
        return SCHEME_NAMES[key]
    if key in AMBIGUOUS_NAMES:
        raise ValueError(f"FP8 scheme {text!r}: {AMBIGUOUS_NAMES[key]}")
    own = list(dict.fromkeys(scheme_key(*v) for v in SCHEME_NAMES.values()))
    others = [k for k in SCHEME_NAMES if k not in own]
    raise ValueError(f"unknown FP8 scheme {text!r}; fp8now names: {', '.join(own)}; also accepted "
                     f"(any case, _ or -): {', '.join(others)}")


def scheme_key(scheme: Scheme, act: str) -> str:
    """fp8now's name of a (scheme, activation) pair: `channel`, or `tensor-tensor` off the default."""
    return scheme.value if act == DEFAULT_ACT[scheme] else f"{scheme.value}-{act}"


def _named_activation(field: str, name: str | Scheme, activation: str) -> tuple[Scheme, str]:
    """A scheme field's Scheme and the activation the config then takes (`tensorwise` fixes it)."""
    if isinstance(name, Scheme):
        return name, activation
    scheme, act = parse_scheme_name(name)
    if act == DEFAULT_ACT[scheme] or activation == act:
        return scheme, activation
    if activation == "auto":
        return scheme, act
    raise ValueError(f"{field}={name!r} means per-{act} activation scales, but activation={activation!r}")


@dataclass(frozen=True)
class Fp8Config:
    """What to quantize and how.

    scheme: `tensor`, `channel`, `block`, or any name in SCHEME_NAMES (e.g. "ptpc", "tensorwise"; a
        name that fixes the activations, like "tensor-tensor", sets `activation`).
    moe_scheme: scheme for routed experts (defaults to `scheme`).
    ignore: module names left in high precision: exact names, fnmatch globs, or `re:` regexes. The
        output head is governed by `head`, not by a default pattern; a pattern that matches it still
        wins over head=True (the report says so).
    head: quantize the output head (`get_output_embeddings()`, normally `lm_head`) like a block linear:
        an Fp8Linear of `scheme` with dynamic FP8 activations. Off: kept in the model dtype.
    embedding: store the input embedding (`get_input_embeddings()`) as FP8 rows, one float32 scale per
        row (fp8now.layers.embedding.Fp8Embedding; weight-only: lookups return the model dtype). Off: kept in
        the model dtype. With tied word embeddings the head's weight is the embedding: pass both or
        neither (one FP8 copy then serves both; loading refuses one without the other).
    backend: "auto" (the dispatch table) or a forced backend name.
    batch_invariant: output rows independent of the batch they run in (SPEC §8).
    activation: "auto", or force per-"token" / per-"tensor" activation scales where the scheme allows
        (MoE experts keep per-token scales under "tensor": their tokens must not share a scale).
    decode_graphs: on the triton backend, replay eager calls with M <= 256 from per-layer CUDA graphs
        (fp8now.layers.decode_graphs: same bytes, a fraction of the host time); False launches every call.
    tp_invariant: under tensor parallelism, reduce row-parallel inputs' per-token amax over the TP
        group (MAX) before quantizing, so the logits equal TP=1 up to summation order (SPEC §6).
    fast_accum: tensor and channel GEMMs keep the whole K in the FP8 tensor cores' own accumulator
        (Hopper's fast accumulation, torch._scaled_mm's use_fast_accum; torchao's default) instead of
        promoting every K-block's product to float32: faster, fewer accurate bits. Only GPU backends
        with FP8 tensor cores have it (others refuse); `block` refuses it (see FAST_ACCUM_BLOCK).
        Routed experts (Fp8Experts) use it in the triton backend's grouped GEMMs of the sorted path (calls
        of more than one token: plan.MoeTable.direct_max_tokens); the direct kernels of one decode token,
        which read the weights at memory speed, keep promoting.
    weight_numerics: "spec" (SPEC §4: float32 scales and division), or "llm-compressor" /
        "llm-compressor-triton": the FP8 bytes and scales llm-compressor's data-free FP8_DYNAMIC (channel)
        and FP8_BLOCK (block) write (fp8now.kernels.llmc; scales kept in the weight's dtype, which
        fp8now.save writes). Computed with torch ops on every device.
    keep_bf16: None, or "auto:F": fp8now.load first scores every quantizable layer without data (the
        sensitivity pass, cached per checkpoint) and keeps in bf16 the highest-ranked ones within the
        fraction F of the quantizable weight bytes; layers matching `ignore` stay in bf16 whatever their rank
        and cost none of that budget. Only `fp8now.load` of a bf16 checkpoint takes it.
    """

    scheme: Scheme = Scheme.CHANNEL
    moe_scheme: Scheme | None = None
    ignore: tuple[str, ...] = ()
    head: bool = False
    embedding: bool = False
    backend: str = "auto"
    batch_invariant: bool = False
    activation: str = "auto"
    decode_graphs: bool = True
    tp_invariant: bool = False
    fast_accum: bool = False
    weight_numerics: str = "spec"
    keep_bf16: str | None = None

    def __post_init__(self) -> None:
        scheme, activation = _named_activation("scheme", self.scheme, self.activation)
        if self.moe_scheme is not None:
            moe, activation = _named_activation("moe_scheme", self.moe_scheme, activation)
            object.__setattr__(self, "moe_scheme", moe)
        object.__setattr__(self, "scheme", scheme)
        object.__setattr__(self, "activation", activation)
        if isinstance(self.ignore, str):
            raise TypeError(f"Fp8Config.ignore must be a sequence of names, got the string {self.ignore!r}")
        object.__setattr__(self, "ignore", tuple(self.ignore))
        for pattern in self.ignore:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"Fp8Config.ignore entries must be non-empty strings, got {pattern!r}")
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise ValueError(f"Fp8Config.ignore: bad regex {pattern!r}: {e}") from None
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKEND_NAMES)}")
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"unknown activation {self.activation!r}; valid: {', '.join(ACTIVATION_NAMES)}")
        for scheme in (self.scheme, self.moe_scheme or self.scheme):
            act = self.act_kind(scheme)
            if act not in ALLOWED_ACT[scheme]:
                raise ValueError(
                    f"activation={self.activation!r} does not fit scheme {scheme.value!r}; "
                    f"allowed: {', '.join(ALLOWED_ACT[scheme])}")
        for flag in ("fast_accum", "head", "embedding"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"Fp8Config.{flag} must be True or False, got {getattr(self, flag)!r}")
        self._check_numerics()
        if self.keep_bf16 is not None:
            keep_bf16_fraction(self.keep_bf16)
        if self.fast_accum and self.scheme is Scheme.BLOCK:
            raise ValueError(f"fast_accum=True does not apply to scheme 'block': {FAST_ACCUM_BLOCK}")
        if self.batch_invariant and self.activation == "tensor":
            raise ValueError("batch_invariant=True needs per-token or per-group activation scales, "
                             "not activation='tensor' (one scale over the batch couples its rows)")

    def _check_numerics(self) -> None:
        if self.weight_numerics not in WEIGHT_NUMERICS:
            raise ValueError(f"unknown weight_numerics {self.weight_numerics!r}; valid: {', '.join(WEIGHT_NUMERICS)}")
        if self.weight_numerics == "spec":
            return
        for field, scheme in (("scheme", self.scheme), ("moe_scheme", self.expert_scheme)):
            if scheme not in LLMC_SCHEMES:
                raise ValueError(f"weight_numerics={self.weight_numerics!r} covers llm-compressor's data-free "
                                 f"presets FP8_DYNAMIC (scheme channel) and FP8_BLOCK (block), not {field} "
                                 f"{scheme.value!r} (its per-tensor FP8 preset calibrates static activation "
                                 "scales on data); use scheme channel or block, or weight_numerics='spec'")

    def act_kind(self, scheme: Scheme | None = None) -> str:
        """The activation quantization used for `scheme` (default: the dense scheme)."""
        scheme = self.scheme if scheme is None else scheme
        return DEFAULT_ACT[scheme] if self.activation == "auto" else self.activation

    @property
    def expert_scheme(self) -> Scheme:
        """Scheme for routed MoE experts."""
        return self.moe_scheme or self.scheme
