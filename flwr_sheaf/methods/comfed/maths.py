"""ComFed's maths (Badi et al. 2026; notes/baselines-alignment.md, s7): each agent learns a projection
``P_i (r, d_i)`` into a shared space, trained with ``lambda * mean_m ||P_i vbar_{i,m} - mean_{j in N(i)}
P_j vbar_{j,m}||^2`` (class means ``vbar``); a message from j to i is decoded as ``zhat_i = P_i^+ P_j z_j``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["comfed_alignment_loss", "comfed_message", "xavier_projection"]


def comfed_alignment_loss(
    projected: Mapping[int, torch.Tensor], targets: Mapping[int, torch.Tensor]
) -> torch.Tensor:
    """``mean_m ||projected[m] - targets[m]||^2`` over the classes in both (0 when none); values ``(r,)``.

    Raises:
        ValueError: a target of another shape than the projections, or NaN/inf targets.
    """
    common = sorted(set(projected) & set(targets))
    if not common:
        ref = next(iter(projected.values()), torch.zeros(1))
        return ref.sum() * 0.0
    for m in common:
        if targets[m].shape != projected[m].shape:
            raise ValueError(
                f"class {m}: target of shape {tuple(targets[m].shape)}, expected {tuple(projected[m].shape)}"
            )
        if not torch.isfinite(targets[m]).all():
            raise ValueError(f"class {m}: NaN/inf target")
    return torch.stack(
        [((projected[m] - targets[m].to(projected[m].dtype)) ** 2).sum() for m in common]
    ).mean()


def comfed_message(z_j: torch.Tensor, p_j: torch.Tensor, p_i: torch.Tensor) -> torch.Tensor:
    """Decode j's raw latents ``(M, d_j)`` in i's latent space: ``P_i^+ P_j z_j`` ``(M, d_i)``, ``z_j``'s dtype (pinv in float64).

    Raises:
        ValueError: mismatched shapes (the r of both projections, or d_j).
    """
    if p_i.ndim != 2 or p_j.ndim != 2 or p_i.shape[0] != p_j.shape[0]:
        raise ValueError(
            f"projections must share r: P_i {tuple(p_i.shape)}, P_j {tuple(p_j.shape)}"
        )
    if z_j.ndim != 2 or z_j.shape[1] != p_j.shape[1]:
        raise ValueError(f"latents of shape {tuple(z_j.shape)} do not match P_j {tuple(p_j.shape)}")
    pinv = torch.linalg.pinv(p_i.double())  # (d_i, r)
    return (z_j.double() @ p_j.double().T @ pinv.T).to(z_j.dtype)


def xavier_projection(r: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """Xavier-uniform initial ``P`` of shape ``(r, d)`` float32 (the reference's initialisation)."""
    bound = (6.0 / (r + d)) ** 0.5
    return (torch.rand(r, d, generator=generator) * 2.0 - 1.0) * bound
