"""Message vocabulary that several methods share (the core's names are in :mod:`flwr_sheaf.protocol`).

:data:`UPLOAD`: record of a train reply holding what a node uploads for aggregation;
:data:`GLOBAL_PROTOTYPES`: record holding the aggregated class prototypes (FedProto, FedSAF);
:data:`NUM_CLASSES`, :data:`FEATURE_DIM`: config entries (class count, common dimension D).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from ...protocol import ProtocolError, pack_arrays

__all__ = [
    "UPLOAD",
    "GLOBAL_PROTOTYPES",
    "NUM_CLASSES",
    "FEATURE_DIM",
    "pack_prototypes",
    "unpack_prototypes",
]

UPLOAD = "upload"
GLOBAL_PROTOTYPES = "global-prototypes"
NUM_CLASSES = "num-classes"
FEATURE_DIM = "feature-dim"


def pack_prototypes(
    protos: Mapping[int, np.ndarray], counts: Mapping[int, int] | None = None, dim: int = 0
) -> ArrayRecord:
    """Prototypes ``{class: (D,)}`` -> arrays ``classes (n,)`` int64, ``prototypes (n, D)`` float32
    [, ``counts (n,)`` int64]; ``dim`` gives D for an empty dict.

    Raises:
        KeyError: ``counts`` without an entry for a class of ``protos``.
    """
    classes = sorted(int(c) for c in protos)
    if classes:
        mat = np.stack([np.asarray(protos[c], dtype=np.float32) for c in classes])
    else:
        mat = np.zeros((0, int(dim)), np.float32)
    out: dict[str, np.ndarray] = {"classes": np.asarray(classes, dtype=np.int64), "prototypes": mat}
    if counts is not None:
        out["counts"] = np.asarray([int(counts[c]) for c in classes], dtype=np.int64)
    return pack_arrays(out)


def unpack_prototypes(
    rec: ArrayRecord, where: str
) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
    """Inverse of :func:`pack_prototypes` (Python-int keys); checks the layout and counts (>= 1)
    only: values are checked by :func:`flwr_sheaf.methods._shared.prototypes.aggregate_prototypes`.

    Raises:
        ProtocolError: malformed record; the message starts with ``where`` (e.g. ``"partition-id 3"``).
    """
    missing = {"classes", "prototypes"} - set(rec.keys())
    if missing:
        raise ProtocolError(f"{where}: prototype record lacks {sorted(missing)}")
    classes = rec["classes"].numpy()
    protos = rec["prototypes"].numpy()
    counts = rec["counts"].numpy() if "counts" in rec else None
    if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer):
        raise ProtocolError(
            f"{where}: class ids must be a 1-D integer array, got {classes.dtype} {classes.shape}"
        )
    if protos.ndim != 2 or protos.shape[0] != classes.shape[0]:
        raise ProtocolError(
            f"{where}: prototypes have shape {protos.shape}, expected ({classes.shape[0]}, D)"
        )
    if counts is not None and counts.shape != classes.shape:
        raise ProtocolError(f"{where}: counts have shape {counts.shape}, expected {classes.shape}")
    if counts is not None and not np.issubdtype(counts.dtype, np.integer):
        raise ProtocolError(
            f"{where}: counts must be integers, got dtype {counts.dtype} ({counts.tolist()[:10]})"
        )
    if counts is not None and counts.size and counts.min() < 1:
        bad = {int(c): int(n) for c, n in zip(classes.tolist(), counts.tolist()) if n < 1}
        raise ProtocolError(
            f"{where}: counts must be >= 1 (a prototype averages at least one sample), got {bad}"
        )
    ids = [int(c) for c in classes.tolist()]
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"{where}: class ids {ids} repeat")
    out = {c: protos[i].copy() for i, c in enumerate(ids)}
    return out, ({c: int(counts[i]) for i, c in enumerate(ids)} if counts is not None else None)
