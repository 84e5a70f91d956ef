"""FedProto mathematics in torch (Tan et al., AAAI 2022; notes/baselines-prototypes.md, s3).

A prototype set is a ``dict[int, Tensor(d)]`` keyed by **Python int** class ids (tensor keys make
int look-ups miss silently, s3.6: keys are converted with ``int()``, non-integral ones rejected).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "class_prototypes",
    "aggregate_prototypes",
    "fedproto_loss",
    "nearest_prototype_predict",
    "PoolingAdapter",
    "LOSS_REDUCTIONS",
]

#: Accepted ``reduction`` values of :func:`fedproto_loss`.
LOSS_REDUCTIONS = ("per_sample", "mse")


def _class_id(key: object, where: str) -> int:
    """A class key (int, numpy integer, 0-dim integer tensor) as a Python int; ValueError otherwise."""
    if isinstance(key, bool):
        raise ValueError(f"{where}: class id {key!r} is a bool, expected an integer")
    if isinstance(key, torch.Tensor):
        bad_dtype = key.is_floating_point() or key.is_complex() or key.dtype == torch.bool
        if key.numel() != 1 or bad_dtype:
            raise ValueError(
                f"{where}: class id must be an integer scalar, got tensor of dtype {key.dtype} "
                f"and shape {tuple(key.shape)}"
            )
        return int(key.item())
    if isinstance(key, numbers.Integral):
        return int(key)
    raise ValueError(f"{where}: class id {key!r} ({type(key).__name__}) is not an integer")


def _check_labels(y: torch.Tensor, batch: int, num_classes: int | None, name: str = "y") -> None:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.ndim != 1:
        raise ValueError(f"{name} must have shape (B,), got {tuple(y.shape)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (e.g. int64), got dtype {y.dtype}")
    if y.shape[0] != batch:
        raise ValueError(f"{name} has {y.shape[0]} labels but the latents have {batch} rows")
    if y.numel() > 0:
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or (num_classes is not None and hi >= num_classes):
            bad = lo if lo < 0 else hi
            rng = f"[0, num_classes={num_classes})" if num_classes is not None else "[0, inf)"
            raise ValueError(f"{name} contains class id {bad} outside {rng}")


def _check_latents(z: torch.Tensor, name: str = "z", rows: str = "B") -> None:
    """ValueError unless ``z`` is a floating 2-D tensor ``(rows, d)``."""
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(z).__name__}")
    if z.ndim != 2:
        raise ValueError(f"{name} must have shape ({rows}, d), got {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {z.dtype}")


def _positive_int(v: object, what: str) -> int:
    """``v`` as an int; ValueError ``"<what> must be a positive int, got ..."`` unless it is one (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{what} must be a positive int, got {v!r}")
    return int(v)


def _normalise_protos(
    protos: Mapping, where: str, num_classes: int | None = None
) -> dict[int, torch.Tensor]:
    """Validated prototype dict: int keys in range, 1-D finite float tensors of one dim."""
    if not isinstance(protos, Mapping):
        raise ValueError(
            f"{where}: prototypes must be a dict[int, Tensor], got {type(protos).__name__}"
        )
    out: dict[int, torch.Tensor] = {}
    dim: int | None = None
    for key, p in protos.items():
        c = _class_id(key, where)
        if c < 0 or (num_classes is not None and c >= num_classes):
            rng = f"[0, num_classes={num_classes})" if num_classes is not None else "[0, inf)"
            raise ValueError(f"{where}: class id {c} outside {rng}")
        if c in out:
            raise ValueError(f"{where}: class id {c} appears twice (keys {list(protos)!r})")
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise ValueError(f"{where}: prototype of class {c} must be a floating torch.Tensor")
        if p.ndim != 1:
            raise ValueError(
                f"{where}: prototype of class {c} must have shape (d,), got {tuple(p.shape)}"
            )
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"{where}: prototype of class {c} has NaN/inf entries")
        if dim is None:
            dim = p.shape[0]
        elif p.shape[0] != dim:
            raise ValueError(
                f"{where}: prototypes have different dims "
                f"(d={dim} and d={p.shape[0]} for class {c})"
            )
        out[c] = p
    return out


def _stack_protos(
    protos: Mapping, like: torch.Tensor | None = None, where: str = "global_protos"
) -> tuple[list[int], torch.Tensor]:
    clean = _normalise_protos(protos, where)
    classes = sorted(clean)
    if not classes:
        return [], torch.empty(0)
    mat = torch.stack([clean[c].detach() for c in classes])
    if like is not None:
        mat = mat.to(dtype=like.dtype, device=like.device)
    return classes, mat


def _prototype_rows(y: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """Row of each label of ``y (B,)`` in the ascending non-empty ``classes``, -1 without a prototype; ``(B,)`` int64."""
    hi = max(max(classes), int(y.max()) if y.numel() else 0)
    lut = torch.full((hi + 1,), -1, dtype=torch.long, device=y.device)
    lut[torch.tensor(classes, dtype=torch.long, device=y.device)] = torch.arange(
        len(classes), device=y.device
    )
    return lut[y]


def class_prototypes(
    z: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Local prototypes ``P^c = mean_{j : y_j = c} z_j`` of the classes present in ``y`` (FedSAF Eq. (15)).

    Args:
        z: ``(B, d)`` floating latents (gradients flow through the means).
        y: ``(B,)`` integer labels in ``[0, num_classes)``.

    Returns:
        ``(protos, counts)``: ``{c: (d,)}`` (``z``'s dtype/device) and ``{c: samples}``, ascending
        Python-int keys (two empty dicts for an empty batch).

    Raises:
        ValueError: bad ``z``, ``y`` or ``num_classes``; a label outside ``[0, num_classes)``.
    """
    num_classes = _positive_int(num_classes, "num_classes")
    _check_latents(z)
    _check_labels(y, z.shape[0], num_classes)
    protos: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    if y.numel() == 0:
        return protos, counts
    y = y.to(z.device)
    for c in torch.unique(y).tolist():  # -> Python ints (notes/baselines-prototypes.md, s3.6)
        mask = y == c
        protos[int(c)] = z[mask].mean(dim=0)
        counts[int(c)] = int(mask.sum())
    return protos, counts


def fedproto_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    global_protos: Mapping,
    reduction: str = "per_sample",
) -> tuple[torch.Tensor, int]:
    """FedProto's prototype regulariser ``L_R`` (notes/baselines-prototypes.md, s3.1) over the covered samples
    ``S = {j : y_j has a global prototype}``: ``"per_sample"`` ``(1/|S|) sum_S ||z_j - P_g^{y_j}||^2``,
    ``"mse"`` (official code) ``(1/(B d)) sum_S ||z_j - P_g^{y_j}||^2``; prototypes are constants.

    Args:
        z: ``(B, d)`` floating latents.
        y: ``(B,)`` non-negative integer labels.
        global_protos: ``dict[int, Tensor(d)]`` (may be empty or partial).

    Returns:
        ``(loss, n_covered)``: 0-dim tensor (``0 * z.sum()`` when nothing is covered) and the count.

    Raises:
        ValueError: bad ``z`` or ``y``; a negative label; a bad prototype or key; prototype dim != ``d``;
            unknown ``reduction``.
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    _check_latents(z)
    _check_labels(y, z.shape[0], None)
    classes, mat = _stack_protos(global_protos, like=z)
    if classes and mat.shape[1] != z.shape[1]:
        raise ValueError(
            f"fedproto_loss: latent dim d={z.shape[1]} differs from global prototype dim "
            f"d={mat.shape[1]} (use a PoolingAdapter to a common dim)"
        )
    if not classes or z.shape[0] == 0:
        return z.sum() * 0.0, 0
    rows = _prototype_rows(y.to(z.device).long(), classes)
    covered = rows >= 0
    n_cov = int(covered.sum())
    if n_cov == 0:
        return z.sum() * 0.0, 0
    sq = ((z[covered] - mat[rows[covered]]) ** 2).sum()
    if reduction == "per_sample":
        return sq / n_cov, n_cov
    return sq / (z.shape[0] * z.shape[1]), n_cov


def nearest_prototype_predict(z: torch.Tensor, global_protos: Mapping) -> torch.Tensor:
    """FedProto's inference ``argmin_c ||z_j - P_g^c||_2`` (notes/baselines-prototypes.md, s3.4), ties
    to the smallest class: ``(B,)`` int64 class ids on ``z``'s device for latents ``z (B, d)``.

    Raises:
        ValueError: ``global_protos`` empty; prototype dim != ``d``; bad shapes/keys/NaN.
    """
    _check_latents(z)
    classes, mat = _stack_protos(global_protos, like=z)
    if not classes:
        raise ValueError("nearest_prototype_predict: global_protos is empty (no class to predict)")
    if mat.shape[1] != z.shape[1]:
        raise ValueError(
            f"nearest_prototype_predict: latent dim d={z.shape[1]} differs from prototype dim "
            f"d={mat.shape[1]}"
        )
    ids = torch.tensor(classes, dtype=torch.int64, device=z.device)
    if z.shape[0] == 0:
        return ids[:0]
    dist = torch.cdist(z.detach(), mat, compute_mode="donot_use_mm_for_euclid_dist")
    return ids[dist.argmin(dim=1)]


def aggregate_prototypes(
    uploads: Sequence,
    weighted: bool = True,
    previous: Mapping | None = None,
    missing: str = "carry",
    *,
    num_classes: int | None = None,
    sources: Sequence[str] | None = None,
) -> dict[int, torch.Tensor]:
    """Global prototypes (notes/baselines-prototypes.md, s3.3): per class ``c``,
    ``sum_i n_i^c P_i^c / sum_i n_i^c`` (``weighted``; FedProto Eq. (6)) or ``(1/|N_c|) sum_i P_i^c``
    (official code). A class of ``previous`` nobody uploaded is kept (``"carry"``) or removed (``"drop"``).

    Args:
        uploads: ``(protos, counts)`` pairs, one per client (counts may be ``None`` when unweighted).
        previous: last round's global prototypes, or None.
        num_classes: if given, class ids must lie in ``[0, num_classes)``.
        sources: one label per upload for error messages (default ``"upload <index>"``).

    Returns:
        ``dict[int, Tensor(d)]``, ascending: accumulated in float64, returned in the uploads' promoted
        dtype on the first upload's device.

    Raises:
        ValueError: a NaN/inf prototype, a bad class id or count (source named), differing
            dimensions (both named), bad ``missing``, ``sources`` of the wrong length.
    """
    if missing not in ("carry", "drop"):
        raise ValueError(f"missing must be 'carry' or 'drop', got {missing!r}")
    if num_classes is not None:
        num_classes = _positive_int(num_classes, "num_classes")
    uploads = list(uploads)
    labels = _source_labels(sources, len(uploads))
    per_class, dim, dim_src = _collect_uploads(uploads, labels, weighted, num_classes)
    prev = _normalise_protos(previous, "previous", num_classes) if previous is not None else {}
    if prev and dim is not None:
        pdim = next(iter(prev.values())).shape[0]
        if pdim != dim:
            raise ValueError(
                f"prototype dimension mismatch: previous global prototypes have d={pdim}, "
                f"{dim_src} has d={dim}"
            )
    out = _weighted_means(per_class)
    if missing == "carry":
        for c, p in prev.items():
            if c not in out:
                out[c] = p.detach().clone()
    return {c: out[c] for c in sorted(out)}


def _source_labels(sources: Sequence[str] | None, n: int) -> list[str]:
    """One label per upload (``sources`` or ``"upload <index>"``); ValueError on a length mismatch."""
    if sources is None:
        return [f"upload {i}" for i in range(n)]
    labels = [str(s) for s in sources]
    if len(labels) != n:
        raise ValueError(f"got {len(labels)} source labels for {n} uploads")
    return labels


def _collect_uploads(
    uploads: list, sources: list[str], weighted: bool, num_classes: int | None
) -> tuple[dict[int, list[tuple[torch.Tensor, float]]], int | None, str]:
    """The uploads' prototypes checked and grouped by class with their weights, the common ``d`` and
    the source that set it (ValueError on a bad upload or a dimension mismatch)."""
    dim: int | None = None
    dim_src = ""
    per_class: dict[int, list[tuple[torch.Tensor, float]]] = {}
    for up, src in zip(uploads, sources):
        if not isinstance(up, (tuple, list)) or len(up) != 2:
            raise ValueError(f"{src}: each upload must be a (protos, counts) pair")
        protos = _normalise_protos(up[0], src, num_classes)
        counts = _upload_counts(up[1], src, weighted)
        for c, p in protos.items():
            if dim is None:
                dim, dim_src = p.shape[0], src
            elif p.shape[0] != dim:
                raise ValueError(
                    f"prototype dimension mismatch: {dim_src} has d={dim}, {src} has "
                    f"d={p.shape[0]} (class {c})"
                )
            per_class.setdefault(c, []).append((p, _weight(counts, c, src, weighted)))
    return per_class, dim, dim_src


def _upload_counts(counts_raw, src: str, weighted: bool) -> dict[int, int]:
    """An upload's counts as ``{int: int}`` (empty when ``None`` and unweighted); ValueError if malformed."""
    if counts_raw is None:
        if weighted:
            raise ValueError(f"{src}: counts are required for weighted aggregation")
        return {}
    if not isinstance(counts_raw, Mapping):
        raise ValueError(f"{src}: counts must be a dict[int, int], got {type(counts_raw).__name__}")
    counts: dict[int, int] = {}
    for k, v in counts_raw.items():
        c = _class_id(k, src)
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{src}: count of class {c} must be an int, got {v!r}")
        counts[c] = int(v)
    return counts


def _weight(counts: dict[int, int], c: int, src: str, weighted: bool) -> float:
    """Class ``c``'s weight: its positive count ``n_i^c`` (weighted), else 1; ValueError on a missing or bad count."""
    if not weighted:
        return 1.0
    if c not in counts:
        raise ValueError(f"{src}: no count for class {c}")
    if counts[c] <= 0:
        raise ValueError(f"{src}: count of class {c} is {counts[c]}, must be > 0")
    return float(counts[c])


def _weighted_means(
    per_class: dict[int, list[tuple[torch.Tensor, float]]],
) -> dict[int, torch.Tensor]:
    """Per class ``sum_i w_i P_i / sum_i w_i``, in float64 on the first prototype's device, returned in the promoted dtype."""
    items = [p for group in per_class.values() for p, _ in group]
    if not items:
        return {}
    dtype, device = items[0].dtype, items[0].device
    for p in items[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    out: dict[int, torch.Tensor] = {}
    for c, group in per_class.items():
        num = torch.zeros(items[0].shape[0], dtype=torch.float64, device=device)
        den = 0.0
        for p, w in group:
            num = num + w * p.detach().to(device=device, dtype=torch.float64)
            den += w
        out[c] = (num / den).to(dtype)
    return out


class PoolingAdapter(nn.Module):
    """Parameter-free adaptive average pooling ``(..., d_in) -> (..., d_common)`` (HtFLlib's ``nn.AdaptiveAvgPool1d``; notes/baselines-prototypes.md, s3.5).

    Raises:
        ValueError: non-positive dims; wrong last dim in ``forward``.
    """

    def __init__(self, d_in: int, d_common: int) -> None:
        super().__init__()
        self.d_in = _positive_int(d_in, "PoolingAdapter: d_in")
        self.d_common = _positive_int(d_common, "PoolingAdapter: d_common")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pool the last axis ``(..., d_in) -> (..., d_common)``, same dtype (``x`` itself when equal); ValueError on a wrong last dim."""
        if x.ndim < 1 or x.shape[-1] != self.d_in:
            raise ValueError(
                f"PoolingAdapter expected last dim d_in={self.d_in}, got shape {tuple(x.shape)}"
            )
        if self.d_in == self.d_common:
            return x
        lead = x.shape[:-1]
        flat = x.reshape(-1, 1, self.d_in)
        return F.adaptive_avg_pool1d(flat, self.d_common).reshape(*lead, self.d_common)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_common={self.d_common}"
