"""Sheaf-FRL's message vocabulary (the core's names are in :mod:`flwr_sheaf.protocol`).

``train.sheaf`` carries the core's config plus :class:`~flwr_sheaf.protocol.EdgeConfig`, the neighbours'
:data:`PILOTS` (:func:`pack_neighbour_pilots`) and/or :data:`TRANSPORTED` pilots
(notes/variants-privacy.md), and, for a ``pilot-strategy`` other than ``all``, :data:`PILOT_SELECTION`
(:func:`pack_pilot_selection`) with :data:`PILOT_INDEX_DIGEST` / :data:`PILOT_DESCRIBE` in the config.
The reply carries the node's own :data:`PILOTS` (key :data:`OWN_PILOTS`, ``(K, d_i)``) and/or
:data:`TRANSPORTED`, :data:`PILOT_PUBLIC` when asked, and :data:`SVDS` / :data:`PILOT_INDEX_DIGEST`
in its metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from ...protocol import ProtocolError, pack_arrays

__all__ = [
    "PILOTS",
    "OWN_PILOTS",
    "TRANSPORTED",
    "SVDS",
    "pack_neighbour_pilots",
    "unpack_neighbour_pilots",
    "PILOT_SELECTION",
    "PILOT_INDICES",
    "PILOT_GROUPS",
    "PILOT_INDEX_DIGEST",
    "PILOT_DESCRIBE",
    "PILOT_PUBLIC",
    "PILOT_LABELS",
    "PILOT_FEATURES",
    "index_digest",
    "pack_pilot_selection",
    "unpack_pilot_selection",
]

#: record of a train message (the neighbours' whitened pilots, :func:`pack_neighbour_pilots`) and of
#: a train reply (the node's own whitened pilots ``(K, d_i)``, key :data:`OWN_PILOTS`).
PILOTS = "pilots"
OWN_PILOTS = "pilots"
#: Sheaf-FRL variants (notes/variants-privacy.md): per-edge *transported* pilots ``X A`` keyed ``str(j)``.
#: In a train reply: the node's pilots moved by its own map toward each neighbour j (``(K, d_e)``,
#: ``d_e = max(d_i, d_j)``; homogeneous standard: only toward heads, ``(K, d)``). In a train message:
#: what each neighbour j sent toward this node (same keys). Under ``privacy = stringent`` it replaces
#: the ``pilots`` record both ways: raw pilots never leave the node.
TRANSPORTED = "transported"
#: Sheaf-FRL train metric: SVDs the node computed for its maps this round (notes/variants-privacy.md).
SVDS = "svds"


def pack_neighbour_pilots(pilots: Mapping[int, np.ndarray]) -> ArrayRecord:
    """Neighbours' whitened pilot matrices ``{j: (K, d_j)}`` float32 -> ``ArrayRecord`` keyed ``str(j)``."""
    return pack_arrays({str(int(j)): a for j, a in pilots.items()})


def unpack_neighbour_pilots(rec: ArrayRecord) -> dict[int, np.ndarray]:
    """Inverse of :func:`pack_neighbour_pilots`: ``{j: (K, d_j)}`` float32 arrays.

    Raises:
        ProtocolError: a key that is not a partition-id.
    """
    out = {}
    for key in rec.keys():
        if not key.isdigit():
            raise ProtocolError(f"pilot record key {key!r} is not a partition-id")
        out[int(key)] = np.asarray(rec[key].numpy(), dtype=np.float32)
    return out


# ------------------------------------------------------------------------------ pilot selection (paper App. B)
#: Record of a ``train.sheaf`` message holding this round's pilot selection (:func:`pack_pilot_selection`);
#: absent under ``pilot-strategy=all``.
PILOT_SELECTION = "pilot-selection"
PILOT_INDICES = "indices"
PILOT_GROUPS = "groups"
#: Config key of ``train.sheaf`` (the :func:`index_digest` of the selection sent) and metric of the reply
#: (the digest of the selection the node used); the strategy refuses a reply whose digest differs.
PILOT_INDEX_DIGEST = "pilot-index-digest"
#: Config key of ``train.sheaf``: ``"class"`` or ``"cluster"`` asks the node to add :data:`PILOT_PUBLIC`
#: to its reply (the pilots' labels / public features, sent once so the strategy can group the pilots).
PILOT_DESCRIBE = "pilot-describe"
#: Reply record: ``labels`` ``(M,)`` int64 and/or ``features`` ``(M, p)`` float32 of the shared pilots.
PILOT_PUBLIC = "pilot-public"
PILOT_LABELS = "labels"
PILOT_FEATURES = "features"


def index_digest(indices: np.ndarray, groups: np.ndarray | None = None) -> int:
    """A 63-bit fingerprint of a pilot selection: SHA-256 of the int64 indices in order and the group
    ids (or a marker for none), first 8 bytes, as a positive int (fits a ``ConfigRecord``/``MetricRecord``).

    Two selections have the same digest iff (up to hash collisions) they name the same pilots in the
    same order with the same grouping.
    """
    import hashlib

    h = hashlib.sha256(np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).tobytes())
    h.update(
        b"|groups|"
        + (
            b"none"
            if groups is None
            else np.ascontiguousarray(np.asarray(groups, np.int64)).tobytes()
        )
    )
    return int.from_bytes(h.digest()[:8], "big") >> 1 or 1


def pack_pilot_selection(indices: np.ndarray, groups: np.ndarray | None = None) -> ArrayRecord:
    """Record :data:`PILOT_SELECTION`: ``indices (m,)`` int64 [and ``groups (m,)`` int64]."""
    out = {PILOT_INDICES: np.asarray(indices, dtype=np.int64)}
    if groups is not None:
        out[PILOT_GROUPS] = np.asarray(groups, dtype=np.int64)
    return pack_arrays(out)


def unpack_pilot_selection(
    rec: ArrayRecord, expected_digest: int, num_pilots: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Inverse of :func:`pack_pilot_selection`, checked against the digest the config carries.

    Args:
        rec: the :data:`PILOT_SELECTION` record.
        expected_digest: the config's :data:`PILOT_INDEX_DIGEST`.
        num_pilots: M, the pilots this node holds.

    Returns:
        ``(indices (m,), groups (m,) or None)`` int64.

    Raises:
        ProtocolError: missing indices, not 1-D int, out of ``[0, M)``, repeated, groups of another
            length, or a digest that differs from ``expected_digest`` (the indices or their order
            were changed: both keys named).
    """
    if PILOT_INDICES not in rec:
        raise ProtocolError(f"record {PILOT_SELECTION!r} lacks {PILOT_INDICES!r}")
    idx = rec[PILOT_INDICES].numpy()
    grp = rec[PILOT_GROUPS].numpy() if PILOT_GROUPS in rec else None
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_INDICES} must be a 1-D integer array, got {idx.dtype} {idx.shape}"
        )
    if idx.size and (idx.min() < 0 or idx.max() >= num_pilots):
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_INDICES} outside [0, {num_pilots}): [{idx.min()}, {idx.max()}]"
        )
    if np.unique(idx).size != idx.size:
        raise ProtocolError(f"{PILOT_SELECTION}/{PILOT_INDICES} repeat a pilot")
    if grp is not None and grp.shape != idx.shape:
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_GROUPS} has shape {grp.shape}, expected {idx.shape}"
        )
    got = index_digest(idx, grp)
    if got != int(expected_digest):
        raise ProtocolError(
            f"pilot index mismatch: {PILOT_SELECTION}/{PILOT_INDICES} has digest {got} but config "
            f"{PILOT_INDEX_DIGEST!r} = {int(expected_digest)} (other pilots, another order or other "
            f"groups than the neighbours' matrices were reduced with)"
        )
    return idx.astype(np.int64), None if grp is None else grp.astype(np.int64)
