"""NaN/Inf checks for the float tensors a load or reload stores as they are (norms, biases, embeddings,
lm_head): one pass per tensor, one host sync per batch of tensors instead of one per tensor."""

from __future__ import annotations

import torch

_CHUNK = 1 << 24  # elements per isfinite pass (its bool temporary)


class FiniteCheck:
    """Collects one on-device "all finite" flag per float tensor; `raise_if_bad` syncs once for all."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._names: list[str] = []

    def add(self, t: torch.Tensor, name: str) -> None:
        """Queue `t` (any dtype; only floats are checked); `name` says which tensor in which file."""
        if t.is_floating_point() and t.numel():
            flat = t.reshape(-1)
            flag = torch.isfinite(flat[:_CHUNK]).all()
            for i in range(_CHUNK, flat.numel(), _CHUNK):  # bounded temporaries for a large embedding
                flag &= torch.isfinite(flat[i:i + _CHUNK]).all()
            self._flags.append(flag)
            self._names.append(name)

    def raise_if_bad(self) -> None:
        """Raise a ValueError naming the first tensor holding NaN or Inf; then start empty."""
        flags, names = self._flags, self._names
        self._flags, self._names = [], []
        if not flags:
            return
        ok = torch.stack([f.to(flags[0].device) for f in flags])
        if bool(ok.all()):
            return
        bad = [names[i] for i in (~ok).nonzero().flatten().tolist()]
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" \
            if len(bad) > 1 else ""
        raise ValueError(f"{bad[0]} contains NaN or Inf{more}; fix or re-export the checkpoint "
                         "(a non-finite value makes every output NaN)")


def check_finite(tensors: list[tuple[torch.Tensor, str]]) -> None:
    """Raise (naming the tensor) if any float tensor in `tensors` holds NaN or Inf; one sync in all."""
    check = FiniteCheck()
    for t, name in tensors:
        check.add(t, name)
    check.raise_if_bad()


def nonfinite_slices(tensors: dict[str, torch.Tensor], parts: dict[str, int]
                     ) -> list[tuple[str, int, int]]:
    """(name, i, part) for each `t[i]` of a stacked tensor (e.g. one expert) holding NaN or Inf; each `t[i]`
    is cut along its first dim into `parts[name]` (default 1) parts checked apart (gate and up rows); one sync.

    Checked one slice at a time, so the temporaries stay the size of one expert, not of the stack."""
    flags: list[torch.Tensor] = []
    where: list[tuple[str, int, int]] = []
    for name, t in tensors.items():
        n = parts.get(name, 1)
        for i in range(t.shape[0]):
            for p, piece in enumerate(t[i].chunk(n) if n > 1 else (t[i],)):
                flags.append(torch.isfinite(piece).all())
                where.append((name, i, p))
    if not flags:
        return []
    ok = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    return [w for w, good in zip(where, ok) if not good]


class NonFiniteExperts(ValueError):
    """NaN or Inf in the float weights or biases given to `Fp8Experts.load_` (nothing was written).

    `where`: (leaf, expert, part) per bad piece; part 0 / 1 = gate / up rows of w13 leaves, else 0."""

    def __init__(self, message: str, where: list[tuple[str, int, int]]) -> None:
        super().__init__(message)
        self.where = where
