"""FedMuscle's contrastive alignment on shared pilots (Setayesh et al. 2026; notes/baselines-alignment.md, s6).

Cycles of ``task_epochs`` task-only epochs and one epoch of ``task + lambda L_muscle``,
``L_muscle = mean_i softplus((neg_i - pos_i)/tau)``: the positive of pilot i is pilot i on the other
agents (not the reference code's private batch, docs/deviations.md), the negative the mean cosine
to the other pilots' network averages. Widths are pooled to a common D first.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ...sheaf.procrustes import check_pilots

__all__ = ["muscle_loss", "leave_one_out_means", "is_contrastive_epoch"]


def muscle_loss(
    z: torch.Tensor, others_mean: torch.Tensor, all_mean: torch.Tensor, temperature: float
) -> torch.Tensor:
    """FedMuscle's contrastive loss of one agent on a pilot minibatch.

    Args:
        z: the agent's pooled pilot representations ``(B, D)`` (differentiable).
        others_mean: ``(B, D)`` mean over the *other* agents of the same pilots (constants).
        all_mean: ``(B, D)`` mean over all agents of the same pilots (the negatives).
        temperature: tau > 0.

    Returns:
        Scalar ``mean_i softplus((neg_i - pos_i) / tau)`` in ``z``'s dtype.

    Raises:
        ValueError: fewer than 2 rows, mismatched shapes, NaN/inf, tau <= 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    check_pilots(z, "z")
    if z.shape[0] < 2:
        raise ValueError(
            f"muscle_loss needs at least 2 pilots (negatives are the other pilots), got {z.shape[0]}"
        )
    check_pilots(others_mean, "others_mean", d=z.shape[1], k=z.shape[0])
    check_pilots(all_mean, "all_mean", d=z.shape[1], k=z.shape[0])
    zn = F.normalize(z, dim=1)
    pos = (zn * F.normalize(others_mean, dim=1)).sum(1)  # (B,)
    sim = zn @ F.normalize(all_mean, dim=1).T  # (B, B): cos(z_i, zbar_i')
    b = z.shape[0]
    neg = (sim.sum(1) - sim.diagonal()) / (b - 1)  # mean over i' != i
    return F.softplus((neg - pos) / temperature).mean()


def leave_one_out_means(
    reps: Mapping[int, torch.Tensor],
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({k: mean_{j != k} reps[j]}, mean_j reps[j])``, each ``(K, D)`` float32, of ``reps`` ``{partition-id: (K, D)}``.

    Raises:
        ValueError: fewer than two agents, mismatched shapes or NaN/inf (the partition-id named).
    """
    if len(reps) < 2:
        raise ValueError(
            f"FedMuscle needs the representations of at least two agents, got {len(reps)}"
        )
    first, ref = next(iter(reps.items()))
    check_pilots(ref, f"pilot representations of partition-id {first}")
    for k, r in reps.items():
        check_pilots(r, f"pilot representations of partition-id {k}", ref.shape[1], ref.shape[0])
    total = torch.stack([r.double() for r in reps.values()]).sum(0)
    n = len(reps)
    others = {k: ((total - r.double()) / (n - 1)).float() for k, r in reps.items()}
    return others, (total / n).float()


def is_contrastive_epoch(epoch: int, task_epochs: int) -> bool:
    """Whether global local-epoch ``epoch`` (0-based, over all rounds) is contrastive:
    ``task_epochs, 2 task_epochs + 1, ...``; ValueError for negative arguments.
    """
    if epoch < 0 or task_epochs < 0:
        raise ValueError(f"epoch and task_epochs must be >= 0, got {epoch}, {task_epochs}")
    return (epoch + 1) % (task_epochs + 1) == 0
