"""Sheaf-FRL's pilot selection at the server (paper App. B, ``pilot-strategy``; notes/variants-pilots.md).

Held matrices are reduced with *this* round's indices (:meth:`PilotSelector.reduced`), so rows
always correspond. :func:`upload_problem` checks one reply's pilots against what the variant asks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from ...protocol import METRICS, array_record, as_int, metric_record
from ...sheaf.pilots import (
    PilotSampler,
    PilotSelection,
    apply_selection,
    parse_pilot_strategy,
    pilot_mismatch,
)
from .protocol import (
    OWN_PILOTS,
    PILOT_DESCRIBE,
    PILOT_FEATURES,
    PILOT_INDEX_DIGEST,
    PILOT_LABELS,
    PILOT_PUBLIC,
    PILOT_SELECTION,
    PILOTS,
    TRANSPORTED,
    index_digest,
)

__all__ = ["PilotSelector", "upload_problem"]

log = logging.getLogger("flwr_sheaf")


class PilotSelector:
    """Pilot selection of one run.

    Args:
        pilot_strategy: run-config ``pilot-strategy`` (:func:`~flwr_sheaf.sheaf.pilots.parse_pilot_strategy`).
        seed: the run's seed (selections derive from (seed, server round)).

    Attributes:
        sampler: the parsed ``spec``'s :class:`~flwr_sheaf.sheaf.pilots.PilotSampler` (None until it can be built).
        public: the accepted pilot description (labels or public features), if any.
        selection: this round's selection (None under ``all`` or while the description is missing).
        digest: its :func:`~flwr_sheaf.methods.sheaf_frl.protocol.index_digest` (0 without a selection).
    """

    def __init__(self, pilot_strategy: str, seed: int) -> None:
        self.pilot_strategy = pilot_strategy
        self.seed = seed
        self.spec = parse_pilot_strategy(pilot_strategy)
        self.sampler: PilotSampler | None = None
        self.public: np.ndarray | None = None
        self.selection: PilotSelection | None = None
        self.digest = 0
        self._reduced_cache: dict[int, np.ndarray] = {}

    @property
    def waiting(self) -> bool:
        """Whether no pilots may be relayed this round (a selection is needed, none is known yet)."""
        return self.spec.kind != "all" and self.selection is None

    @property
    def asks_description(self) -> bool:
        """Whether the nodes are asked for the pilots' description this round."""
        return self.spec.groups is not None and self.sampler is None

    def on_discovered(self, num_pilots: int) -> None:
        """Check the budget against the K shared pilots; build the sampler when it needs no description.

        Raises:
            ValueError: ``pilot-strategy``'s budget exceeds the shared pilots (named).
        """
        spec = self.spec
        if spec.kind != "prototype-class" and spec.k > num_pilots and spec.kind != "all":
            raise ValueError(
                f"pilot-strategy={self.pilot_strategy!r}: budget {spec.k} exceeds the "
                f"{num_pilots} shared pilots (num-pilots)"
            )
        if spec.groups is None:
            self.sampler = PilotSampler(spec, num_pilots, self.seed)

    def select(
        self, server_round: int, bank: Mapping[int, np.ndarray], edges: list[tuple[int, int]]
    ) -> None:
        """This round's selection (``adaptive``: ranked by the mismatch of the held raw matrices over ``edges``)."""
        self.selection, self.digest = None, 0
        self._reduced_cache = {}
        if self.sampler is None:
            return
        mismatch = pilot_mismatch(bank, edges) if self.spec.kind == "adaptive" else None
        self.selection = self.sampler.select(server_round, mismatch)
        if self.selection is not None:
            self.digest = index_digest(self.selection.indices, self.selection.groups)

    def end_messages(self) -> None:
        """Drop the reduced matrices (valid only while this round's messages are built)."""
        self._reduced_cache = {}

    def reduced(self, arr: np.ndarray) -> np.ndarray:
        """A held pilot matrix ``(M, w)`` reduced by this round's selection (``(rows, w)`` float32)."""
        if self.selection is None:
            return arr
        key = id(arr)  # relayed to each neighbour of its sender: reduce it once
        if key not in self._reduced_cache:
            self._reduced_cache[key] = (
                apply_selection(torch.tensor(arr), self.selection).numpy().astype(np.float32)
            )
        return self._reduced_cache[key]

    def digest_problem(self, reply: Message) -> str | None:
        """Why a reply's echoed selection digest is refused, or None (without a selection, or the
        digest metric then removed from the reply)."""
        if self.selection is None:
            return None
        metrics = metric_record(reply.content, METRICS)
        used = metrics.get(PILOT_INDEX_DIGEST) if PILOT_INDEX_DIGEST in metrics else None
        if used is None or as_int(used, PILOT_INDEX_DIGEST) != self.digest:
            return (
                f"pilot index mismatch: reply metric "
                f"{PILOT_INDEX_DIGEST!r} = {used}, but this round's {PILOT_SELECTION!r} has "
                f"digest {self.digest} (reply refused, cached pilots kept)"
            )
        del reply.content[METRICS][PILOT_INDEX_DIGEST]
        return None

    def description_problem(self, reply: Message, num_pilots: int) -> tuple[str | None, bool]:
        """Accept a node's pilot description: ``(problem or None, built)``; the first builds the
        sampler, a later one must equal it."""
        what = self.spec.groups
        key = PILOT_LABELS if what == "class" else PILOT_FEATURES
        rec = array_record(reply.content, PILOT_PUBLIC) if PILOT_PUBLIC in reply.content else None
        arr = rec[key].numpy() if rec is not None and key in rec else None
        if arr is None or arr.shape[0] != num_pilots:
            return (
                f"reply lacks {PILOT_PUBLIC}/{key} with {num_pilots} "
                f"rows (asked by {PILOT_DESCRIBE}={what!r})"
            ), False
        if self.public is not None:
            if not np.array_equal(arr, self.public):
                return f"{PILOT_PUBLIC}/{key} differs from the other nodes'", False
            return None, False
        self.public = arr
        labels, feats = (arr, None) if what == "class" else (None, arr)
        self.sampler = PilotSampler(self.spec, num_pilots, self.seed, labels=labels, features=feats)
        return None, True

    def rows(self, num_pilots: int) -> int:
        """Pilot rows relayed this round (the selection's, K under ``all``, 0 while waiting)."""
        if self.selection is not None:
            return self.selection.num_rows
        return num_pilots if self.spec.kind == "all" else 0


def upload_problem(
    reply: Message, k: int, d: int, want_raw: bool, want_moved: Mapping[int, int], stringent: bool
) -> tuple[str | None, np.ndarray | None, dict[int, np.ndarray]]:
    """``(problem or None, raw pilots or None, {receiver j: transported})`` of one train reply.

    Args:
        k: pilot count K.
        d: the node's d_i.
        want_raw: whether the variant asks for raw pilots ``(K, d_i)``.
        want_moved: ``{receiver j: width}`` of the transported pilots asked for.
        stringent: ``privacy = stringent`` (raw pilots in the reply are refused, never stored).
    """
    has_raw = PILOTS in reply.content and OWN_PILOTS in reply.content[PILOTS]
    if has_raw and stringent:
        return "raw pilots in a reply under privacy='stringent' (discarded, never stored)", None, {}
    a = array_record(reply.content, PILOTS)[OWN_PILOTS].numpy() if has_raw else None
    if want_raw and (a is None or a.shape != (k, d)):
        return f"pilot matrix shape {None if a is None else a.shape}, expected ({k}, {d})", None, {}
    if a is not None and not np.isfinite(a).all():
        return "NaN/inf pilots (cached pilots kept)", None, {}
    rec = (
        array_record(reply.content, TRANSPORTED) if TRANSPORTED in reply.content else ArrayRecord()
    )
    keys = sorted(rec.keys())
    if keys != sorted(str(j) for j in want_moved):
        return (
            f"transported pilots for {keys}, expected for neighbours {sorted(want_moved)}",
            None,
            {},
        )
    moved = {}
    for j, width in want_moved.items():
        m = rec[str(j)].numpy()
        if m.shape != (k, width):
            return (
                f"transported pilots toward {j} of shape {m.shape}, expected ({k}, {width})",
                None,
                {},
            )
        if not np.isfinite(m).all():
            return f"NaN/inf transported pilots toward {j}", None, {}
        moved[j] = m
    return None, (a if want_raw else None), moved
