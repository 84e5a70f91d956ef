"""Input checks shared by the sheaf maths (clear errors, never a silent wrong number)."""

from __future__ import annotations

import torch

__all__ = ["check_pilots"]


def check_pilots(a: torch.Tensor, name: str, d: int | None = None, k: int | None = None) -> None:
    """Validate a pilot matrix stored row-wise.

    Args:
        a: pilot matrix ``(K, d)`` (the paper's A_i is ``d x K``; rows are pilot samples).
        name: label used in error messages, e.g. ``"pilots of partition-id 3"``.
        d: expected stalk dimension, if known.
        k: expected number of pilot rows, if known.

    Raises:
        ValueError: not 2-D, wrong ``d`` or ``K``, or any NaN / inf entry.
    """
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a (K, d) matrix, got shape {tuple(a.shape)}")
    if d is not None and a.shape[1] != d:
        raise ValueError(
            f"{name}: stalk dimension mismatch, expected d={d}, got shape {tuple(a.shape)}"
        )
    if k is not None and a.shape[0] != k:
        raise ValueError(f"{name}: expected K={k} pilot rows, got shape {tuple(a.shape)}")
    if not torch.isfinite(a).all():
        bad = int((~torch.isfinite(a)).sum())
        raise ValueError(f"{name}: {bad} NaN/inf entries in pilot matrix of shape {tuple(a.shape)}")
