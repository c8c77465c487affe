"""Which device a load uses: `None` / "auto" picks the GPU when torch sees one."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """cuda (the current GPU) when available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """None or "auto": `default_device()`; a CUDA device where torch sees no GPU is a clear error."""
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for, but this torch {torch.__version__} sees no "
                         "CUDA GPU; pass device='cpu', or leave device unset (auto: cuda when available, "
                         "else cpu)")
    return device
