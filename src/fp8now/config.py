"""Schemes, their group shapes, and the frozen user configuration (SPEC §3)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

# Names a user may pass as `backend=`; "auto" lets the dispatch table choose.
BACKEND_NAMES = ("auto", "reference", "cpu", "torch", "triton", "triton-w8a16")

# Activation quantization a user may force; "auto" takes the scheme's default (SPEC §3 table).
ACTIVATION_NAMES = ("auto", "token", "tensor", "group")


class Scheme(str, Enum):
    """A pair of group shapes: which weight and activation elements share one scale."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"

    @classmethod
    def parse(cls, name: str | Scheme) -> Scheme:
        """`Scheme.parse("ptpc") is Scheme.CHANNEL`; unknown names raise listing the valid ones."""
        if isinstance(name, Scheme):
            return name
        key = str(name).strip().lower().replace("_", "-")
        if key in _ALIASES:
            return _ALIASES[key]
        valid = ", ".join(sorted(_ALIASES))
        raise ValueError(f"unknown FP8 scheme {name!r}; valid names: {valid}")


_ALIASES: dict[str, Scheme] = {
    "tensor": Scheme.TENSOR, "per-tensor": Scheme.TENSOR, "fp8": Scheme.TENSOR,
    "channel": Scheme.CHANNEL, "ptpc": Scheme.CHANNEL, "per-channel": Scheme.CHANNEL,
    "fp8-dynamic": Scheme.CHANNEL,
    "block": Scheme.BLOCK, "per-block": Scheme.BLOCK, "fp8-block": Scheme.BLOCK,
}

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


@dataclass(frozen=True)
class Fp8Config:
    """What to quantize and how.

    scheme: `tensor`, `channel` or `block` (or an alias, e.g. "ptpc").
    moe_scheme: scheme for routed experts (defaults to `scheme`).
    ignore: module names left in high precision: exact names, fnmatch globs, or `re:` regexes.
    backend: "auto" (the dispatch table) or a forced backend name.
    batch_invariant: output rows independent of the batch they run in (SPEC §8).
    activation: "auto", or force per-"token" / per-"tensor" activation scales where the scheme allows.
    decode_graphs: on the triton backend, replay eager calls with M <= 256 from per-layer CUDA graphs
        (fp8now.decode_graphs: same bytes, a fraction of the host time); False launches every call.
    """

    scheme: Scheme = Scheme.CHANNEL
    moe_scheme: Scheme | None = None
    ignore: tuple[str, ...] = ("lm_head",)
    backend: str = "auto"
    batch_invariant: bool = False
    activation: str = "auto"
    decode_graphs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", Scheme.parse(self.scheme))
        if self.moe_scheme is not None:
            object.__setattr__(self, "moe_scheme", Scheme.parse(self.moe_scheme))
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
        if self.batch_invariant and self.activation == "tensor":
            raise ValueError("batch_invariant=True needs per-token or per-group activation scales, "
                             "not activation='tensor' (one scale over the batch couples its rows)")

    def act_kind(self, scheme: Scheme | None = None) -> str:
        """The activation quantization used for `scheme` (default: the dense scheme)."""
        scheme = self.scheme if scheme is None else scheme
        return DEFAULT_ACT[scheme] if self.activation == "auto" else self.activation

    @property
    def expert_scheme(self) -> Scheme:
        """Scheme for routed MoE experts."""
        return self.moe_scheme or self.scheme
