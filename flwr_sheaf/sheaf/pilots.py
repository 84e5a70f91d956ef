"""Pilot selection strategies and Parseval normalisation (paper App. B; notes/variants-pilots.md):
a :class:`PilotSampler` picks each round's :class:`PilotSelection`, :func:`apply_selection` applies it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .procrustes import polar_factor, procrustes

__all__ = [
    "PILOT_STRATEGY_FORMS",
    "PilotStrategySpec",
    "parse_pilot_strategy",
    "PilotSelection",
    "PilotSampler",
    "round_rng",
    "uniform_indices",
    "stratified_indices",
    "dynamic_indices",
    "adaptive_indices",
    "cluster_pilots",
    "public_pilot_features",
    "pilot_mismatch",
    "apply_selection",
    "group_means",
    "parseval",
    "PILOT_NORMALISATIONS",
]

PILOT_STRATEGY_FORMS = (
    "all",
    "uniform:K",
    "stratified-class:K",
    "stratified-cluster:K",
    "prototype-class",
    "prototype-cluster:K",
    "dynamic:P+R",
    "adaptive:K",
)
"""Forms of the run-config key ``pilot-strategy`` (``K``, ``P``, ``R`` stand for integers)."""
PILOT_NORMALISATIONS = ("none", "parseval")
"""Values of the run-config key ``pilot-normalisation`` (``parseval``: paper App. B)."""
#: stream ids of the selection's random draws (kept apart from every other stream of the run).
_STREAM = {
    "uniform": 11,
    "stratified": 12,
    "dynamic-persistent": 13,
    "dynamic-refresh": 14,
    "adaptive": 15,
    "quota": 16,
}


@dataclass(frozen=True)
class PilotStrategySpec:
    """A parsed ``pilot-strategy`` value.

    Attributes:
        kind: ``"all"``, ``"uniform"``, ``"stratified-class"``, ``"stratified-cluster"``,
            ``"prototype-class"``, ``"prototype-cluster"``, ``"dynamic"``, ``"adaptive"``.
        k: the budget K (clusters for ``prototype-cluster``; P + R for ``dynamic``; else 0).
        persistent, refresh: P and R of ``dynamic`` (0 otherwise).
    """

    kind: str
    k: int = 0
    persistent: int = 0
    refresh: int = 0

    @property
    def groups(self) -> str | None:
        """``"class"``, ``"cluster"`` or None: which pilot grouping the strategy needs."""
        if self.kind.endswith("-class"):
            return "class"
        if self.kind.endswith("-cluster"):
            return "cluster"
        return None

    @property
    def prototype(self) -> bool:
        """True when a pilot matrix has one row per group (group means)."""
        return self.kind.startswith("prototype-")


def parse_pilot_strategy(text: str) -> PilotStrategySpec:
    """Parse a ``pilot-strategy`` value (forms :data:`PILOT_STRATEGY_FORMS`).

    Raises:
        ValueError: an unknown form or a budget < 2 (named, with the valid forms).
    """
    t = str(text).strip()
    if t in ("all", "prototype-class"):
        return PilotStrategySpec(t)
    m = re.fullmatch(
        r"(uniform|stratified-class|stratified-cluster|prototype-cluster|adaptive):(\d+)", t
    )
    if m:
        k = int(m.group(2))
        if k < 2:
            raise ValueError(f"pilot-strategy {t!r}: K must be >= 2")
        return PilotStrategySpec(m.group(1), k)
    m = re.fullmatch(r"dynamic:(\d+)\+(\d+)", t)
    if m:
        p, r = int(m.group(1)), int(m.group(2))
        if p + r < 2 or r < 1:
            raise ValueError(f"pilot-strategy {t!r}: need R >= 1 and P + R >= 2")
        return PilotStrategySpec("dynamic", p + r, p, r)
    raise ValueError(
        f"pilot-strategy {t!r}: expected one of {', '.join(PILOT_STRATEGY_FORMS)} (K, P, R integers)"
    )


@dataclass(frozen=True)
class PilotSelection:
    """The pilots used in one server round, identical on every node.

    Attributes:
        indices: ``(m,)`` int64 sorted ascending, rows of the shared pilot set.
        groups: ``(m,)`` int64 group ids ``0..G-1`` (prototype strategies), else None.
    """

    indices: np.ndarray
    groups: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        """Rows of a reduced pilot matrix: G for prototypes, else m."""
        return int(self.groups.max()) + 1 if self.groups is not None else int(self.indices.size)


def round_rng(seed: int, server_round: int, stream: str) -> np.random.Generator:
    """numpy generator of one selection draw, derived from ``(seed, server round, stream)`` only."""
    return np.random.default_rng(
        np.random.SeedSequence([int(seed), int(server_round), _STREAM[stream]])
    )


def uniform_indices(num_pilots: int, k: int, seed: int, server_round: int) -> np.ndarray:
    """``min(k, M)`` of ``M = num_pilots`` indices uniformly without replacement, sorted; int64."""
    k = min(int(k), int(num_pilots))
    return np.sort(
        round_rng(seed, server_round, "uniform").choice(num_pilots, size=k, replace=False)
    ).astype(np.int64)


def stratified_indices(groups: np.ndarray, k: int, seed: int, server_round: int) -> np.ndarray:
    """``min(k, M)`` sorted int64 indices, stratified by ``groups (M,)``: each of C groups gets
    ``k // C`` (``k % C`` seeded groups one more); a group's shortfall is drawn from the rest."""
    groups = np.asarray(groups)
    k = min(int(k), groups.size)
    rng = round_rng(seed, server_round, "stratified")
    ids = np.unique(groups)
    quota = np.full(ids.size, k // ids.size)
    quota[rng.choice(ids.size, size=k % ids.size, replace=False)] += 1
    chosen = []
    for g, q in zip(ids, quota):
        members = np.flatnonzero(groups == g)
        chosen.append(rng.choice(members, size=min(int(q), members.size), replace=False))
    picked = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
    short = k - picked.size
    if short > 0:
        rest = np.setdiff1d(np.arange(groups.size), picked)
        picked = np.concatenate([picked, rng.choice(rest, size=short, replace=False)])
    return np.sort(picked).astype(np.int64)


def dynamic_indices(
    num_pilots: int, persistent: int, refresh: int, seed: int, server_round: int
) -> np.ndarray:
    """P persistent indices (drawn once from ``seed``) plus R drawn each round from the others;
    sorted int64, ``min(P + R, M)`` in all."""
    p = min(int(persistent), int(num_pilots))
    keep = round_rng(seed, 0, "dynamic-persistent").choice(num_pilots, size=p, replace=False)
    rest = np.setdiff1d(np.arange(num_pilots), keep)
    r = min(int(refresh), rest.size)
    fresh = round_rng(seed, server_round, "dynamic-refresh").choice(rest, size=r, replace=False)
    return np.sort(np.concatenate([keep, fresh])).astype(np.int64)


def adaptive_indices(scores: np.ndarray, k: int, seed: int, server_round: int) -> np.ndarray:
    """The ``min(k, M)`` pilots of largest ``scores (M,)`` (NaN lowest; seeded ties); sorted int64."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf)
    k = min(int(k), s.size)
    tie = round_rng(seed, server_round, "adaptive").permutation(s.size)
    order = np.lexsort((tie, -s))  # primary key: -score; secondary: random tie-break
    return np.sort(order[:k]).astype(np.int64)


def public_pilot_features(x_pilot: np.ndarray, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Public features of the pilot inputs ``(M, ...)``: a fixed Gaussian random projection of the
    pixels to ``(M, dim)`` float64 (Johnson-Lindenstrauss); the raw pixels when they have <= ``dim``."""
    x = np.asarray(x_pilot, dtype=np.float64).reshape(len(x_pilot), -1)
    if x.shape[1] <= dim:
        return x
    proj = np.random.default_rng(seed).standard_normal((x.shape[1], dim)) / np.sqrt(dim)
    return x @ proj


def cluster_pilots(features: np.ndarray, num_clusters: int, seed: int) -> np.ndarray:
    """k-means groups (``KMeans(n_init=4, random_state=seed)``) of ``features (M, p)``, at most
    ``num_clusters``: ``(M,)`` int64 labels ``0..G-1`` by first appearance."""
    from sklearn.cluster import KMeans

    f = np.asarray(features, dtype=np.float64)
    n = min(int(num_clusters), f.shape[0])
    labels = KMeans(n_clusters=n, n_init=4, random_state=int(seed)).fit_predict(f)
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inv].astype(np.int64)


def _contiguous(groups: np.ndarray) -> np.ndarray:
    """Group ids relabelled ``0..G-1`` in ascending order of the original ids."""
    return np.unique(np.asarray(groups), return_inverse=True)[1].astype(np.int64)


def pilot_mismatch(bank: Mapping[int, np.ndarray], edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per-pilot cross-node mismatch: mean over edges of the squared Procrustes residual per row.

    ``bank``: ``{partition-id: (M, d_i)}``; ``edges``: oriented ``(head, tail)``, those with an end
    not in ``bank`` skipped. Returns ``(M,)`` float64 mean of ``||a_h[k] - V a_t[k]||^2`` (V:
    Procrustes, Eq. 18); NaN if no edge.
    """
    total, n = None, 0
    for h, t in edges:
        if h not in bank or t not in bank:
            continue
        ah = torch.from_numpy(np.asarray(bank[h], np.float64))
        at = torch.from_numpy(np.asarray(bank[t], np.float64))
        v = procrustes(ah, at)
        r = ((ah - at @ v.T) ** 2).sum(1).numpy()
        total = r if total is None else total + r
        n += 1
    if total is None:
        m = next(iter(bank.values())).shape[0] if bank else 0
        return np.full(m, np.nan)
    return total / n


class PilotSampler:
    """Decides each server round's :class:`PilotSelection` (paper App. B; module docstring).

    Args:
        num_pilots: M, the shared pilots.
        labels: ``(M,)`` pilot labels (``*-class``).
        features: ``(M, p)`` public features (``*-cluster``; clustered once here).

    Raises:
        ValueError: the grouping the spec needs is missing or has the wrong length (named).
    """

    def __init__(
        self,
        spec: PilotStrategySpec,
        num_pilots: int,
        seed: int,
        labels: np.ndarray | None = None,
        features: np.ndarray | None = None,
    ) -> None:
        self.spec, self.num_pilots, self.seed = spec, int(num_pilots), int(seed)
        self.groups: np.ndarray | None = None
        if spec.groups == "class":
            if labels is None or np.asarray(labels).shape != (self.num_pilots,):
                raise ValueError(
                    f"pilot-strategy={spec.kind}: needs ({self.num_pilots},) pilot labels, got "
                    f"{None if labels is None else np.asarray(labels).shape}"
                )
            self.groups = _contiguous(labels)
        elif spec.groups == "cluster":
            if features is None or np.asarray(features).shape[0] != self.num_pilots:
                raise ValueError(
                    f"pilot-strategy={spec.kind}: needs public pilot features with {self.num_pilots} rows"
                )
            n = spec.k if spec.prototype else max(2, int(round(np.sqrt(spec.k))))
            self.groups = cluster_pilots(features, n, self.seed)

    @property
    def num_groups(self) -> int:
        """Groups of the partition (0 without one)."""
        return 0 if self.groups is None else int(self.groups.max()) + 1

    def select(
        self, server_round: int, mismatch: np.ndarray | None = None
    ) -> PilotSelection | None:
        """This round's selection (None for ``all``); ``mismatch``: ``(M,)`` :func:`pilot_mismatch`
        for ``adaptive`` (None/NaN: a uniform draw)."""
        s, m = self.spec, self.num_pilots
        if s.kind == "all":
            return None
        if s.kind == "uniform":
            return PilotSelection(uniform_indices(m, s.k, self.seed, server_round))
        if s.kind.startswith("stratified-"):
            assert self.groups is not None, "__init__ sets groups for every stratified-* spec"
            return PilotSelection(stratified_indices(self.groups, s.k, self.seed, server_round))
        if s.kind == "dynamic":
            return PilotSelection(
                dynamic_indices(m, s.persistent, s.refresh, self.seed, server_round)
            )
        if s.kind == "adaptive":
            if mismatch is None or not np.isfinite(mismatch).any():
                return PilotSelection(uniform_indices(m, s.k, self.seed, server_round))
            return PilotSelection(adaptive_indices(mismatch, s.k, self.seed, server_round))
        assert s.prototype and self.groups is not None
        return PilotSelection(np.arange(m, dtype=np.int64), self.groups.copy())


def group_means(a: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group means ``(G, d)`` of pilots ``a (m, d)`` with ``groups (m,)`` in ``0..G-1`` (paper
    App. B prototypes; differentiable; zero rows for empty groups)."""
    g = groups.to(a.device).long()
    sums = torch.zeros(num_groups, a.shape[1], dtype=a.dtype, device=a.device).index_add(0, g, a)
    counts = torch.bincount(g, minlength=num_groups).clamp_min(1).to(a.dtype)
    return sums / counts[:, None]


def apply_selection(a: torch.Tensor, sel: PilotSelection | None) -> torch.Tensor:
    """A pilot matrix ``(M, d)`` reduced by ``sel``: rows ``(m, d)`` or group means ``(G, d)``.

    Raises:
        ValueError: an index outside ``[0, M)``.
    """
    if sel is None:
        return a
    idx = torch.as_tensor(sel.indices, dtype=torch.long, device=a.device)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= a.shape[0]):
        raise ValueError(
            f"pilot indices outside [0, {a.shape[0]}): min {int(idx.min())}, max {int(idx.max())}"
        )
    rows = a[idx]
    if sel.groups is None:
        return rows
    return group_means(rows, torch.as_tensor(sel.groups), sel.num_rows)


def parseval(a: torch.Tensor) -> torch.Tensor:
    """Parseval normalisation of a pilot matrix ``a (K, d)`` (paper App. B, end): its polar factor.

    ``U W^T`` of the thin SVD ``P = U S W^T`` (differentiable, ``a``'s dtype): ``(P P^T)^{-1/2} P``
    for ``K <= d``, ``P (P^T P)^{-1/2}`` for ``K >= d`` (rows: a Parseval frame of ``R^d``).

    Raises:
        ValueError: not 2-D, or NaN/inf entries.
    """
    if a.ndim != 2:
        raise ValueError(f"parseval needs a (K, d) pilot matrix, got shape {tuple(a.shape)}")
    if not torch.isfinite(a).all():
        raise ValueError("parseval: pilot matrix has NaN/inf entries")
    if a.shape[0] >= a.shape[1]:
        return polar_factor(a)
    return polar_factor(a.T).T
