"""Sheaf-FRL's message vocabulary (the core's names are in :mod:`flwr_sheaf.protocol`).

``train.sheaf`` carries :class:`~flwr_sheaf.protocol.EdgeConfig`, the neighbours' :data:`PILOTS`
and/or :data:`TRANSPORTED` pilots, and, unless ``pilot-strategy = all``, :data:`PILOT_SELECTION`
with :data:`PILOT_INDEX_DIGEST` / :data:`PILOT_DESCRIBE` in the config. The reply carries the
node's :data:`PILOTS` (key :data:`OWN_PILOTS`) and/or :data:`TRANSPORTED`, :data:`PILOT_PUBLIC`
when asked, and :data:`SVDS` / :data:`PILOT_INDEX_DIGEST` in its metrics.
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
#: per-edge transported pilots ``X A`` ``(K, d_e)`` keyed ``str(j)`` (notes/variants-privacy.md): in a
#: reply, toward each neighbour j; in a message, from each. Replaces ``pilots`` under stringent privacy.
TRANSPORTED = "transported"
#: train metric: SVDs the node computed for its maps this round.
SVDS = "svds"


def pack_neighbour_pilots(pilots: Mapping[int, np.ndarray]) -> ArrayRecord:
    """Neighbours' pilot matrices ``{j: (K, d_j)}`` float32 -> ``ArrayRecord`` keyed ``str(j)``."""
    return pack_arrays({str(int(j)): a for j, a in pilots.items()})


def unpack_neighbour_pilots(rec: ArrayRecord) -> dict[int, np.ndarray]:
    """Inverse of :func:`pack_neighbour_pilots`; ProtocolError on a key that is not a partition-id."""
    out = {}
    for key in rec.keys():
        if not key.isdigit():
            raise ProtocolError(f"pilot record key {key!r} is not a partition-id")
        out[int(key)] = np.asarray(rec[key].numpy(), dtype=np.float32)
    return out


#: pilot selection (paper App. B): record of a ``train.sheaf`` message (:func:`pack_pilot_selection`).
PILOT_SELECTION = "pilot-selection"
PILOT_INDICES = "indices"
PILOT_GROUPS = "groups"
#: config key of ``train.sheaf`` and reply metric: the :func:`index_digest` of the selection sent / used.
PILOT_INDEX_DIGEST = "pilot-index-digest"
#: config key of ``train.sheaf``: ``"class"`` / ``"cluster"`` asks for :data:`PILOT_PUBLIC` in the reply.
PILOT_DESCRIBE = "pilot-describe"
#: reply record: ``labels`` ``(M,)`` int64 and/or ``features`` ``(M, p)`` float32 of the pilots.
PILOT_PUBLIC = "pilot-public"
PILOT_LABELS = "labels"
PILOT_FEATURES = "features"


def index_digest(indices: np.ndarray, groups: np.ndarray | None = None) -> int:
    """Positive 63-bit fingerprint of a pilot selection (SHA-256 of the int64 indices in order and
    the groups): equal iff the same pilots in the same order with the same grouping."""
    import hashlib

    h = hashlib.sha256(np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).tobytes())
    g = b"none" if groups is None else np.ascontiguousarray(np.asarray(groups, np.int64)).tobytes()
    h.update(b"|groups|" + g)
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
    """Inverse of :func:`pack_pilot_selection`, checked against the config's digest.

    Args:
        num_pilots: M, the pilots this node holds.

    Returns:
        ``(indices (m,), groups (m,) or None)`` int64.

    Raises:
        ProtocolError: missing indices, not 1-D int, out of ``[0, M)``, repeated, groups of another
            length, or a digest other than ``expected_digest`` (both keys named).
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
