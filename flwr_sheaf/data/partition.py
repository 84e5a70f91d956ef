"""Paper partition (Sec. 6 "Data heterogeneity", Eq. 23): shared pilots + label-shift split.

:func:`make_federated_split`, a pure function of ``(labels, class_sets, shift, seed, fractions)``:
(a) the first ``round(pilot_fraction * M)`` samples of a seeded permutation are the pilot hold-out,
restricted to classes every agent observes, capped at ``num_pilots``; (b) the rest is split class by
class in consecutive chunks by largest-remainder counts of ``theta_i[k] / sum_j theta_j[k]`` (Eq. 23;
the reference draws random owners: docs/deviations.md, s1); (c) each class chunk is split with
``n_val = floor(val_fraction * n + 1/2)``, ``n_test = min(floor(test_fraction * n + 1/2), n -
n_val)``. Paper facts: docs/paper.md, s7. Indices point into :func:`~flwr_sheaf.data.sources.load_source`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flwr_sheaf.data.sources import load_source, register_derived_cache, source_size
from flwr_sheaf.paper import NUM_CLASSES

__all__ = [
    "label_shift_proportions",
    "FederatedSplit",
    "make_federated_split",
    "AgentData",
    "load_agent_data",
    "prepare_split",
    "agent_data",
    "PreparedSplit",
    "check_all_agents",
    "split_floor",
    "PARTITIONER_FORMS",
    "parse_partitioner",
    "make_dirichlet_split",
    "MIN_AGENT_SAMPLES",
    "check_agents_fit",
]

ClassSets = Sequence[Sequence[int]]
_PARTS = ("train", "val", "test", "pool")


# ----------------------------------------------------------------------------------- validation
def _is_int(v: object, lo: int, hi: float = math.inf) -> bool:
    """``v`` is an integer (not a bool) in ``[lo, hi)``."""
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and lo <= int(v) < hi


def _is_real(v: object) -> bool:
    """``v`` is a real number (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, numbers.Real)


def _normalise_class_sets(class_sets: ClassSets, num_classes: int) -> tuple[tuple[int, ...], ...]:
    """Sorted, de-duplicated tuple-of-tuples copy of ``class_sets`` (cached for a tuple of tuples:
    N nodes each normalising all N sets would be quadratic); ValueError on bad input."""
    if isinstance(class_sets, tuple) and all(isinstance(cs, tuple) for cs in class_sets):
        with contextlib.suppress(TypeError):  # unhashable members: validated uncached (named)
            return _normalise_cached(class_sets, num_classes)
    return _normalise_uncached(class_sets, num_classes)


def _normalise_uncached(class_sets: ClassSets, num_classes: int) -> tuple[tuple[int, ...], ...]:
    if not _is_int(num_classes, 1):
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    if (
        isinstance(class_sets, (str, bytes))
        or not isinstance(class_sets, Sequence)
        or len(class_sets) == 0
    ):
        raise ValueError(
            f"class_sets must be a non-empty sequence of class-id sequences, got {class_sets!r}"
        )
    out = []
    for i, cs in enumerate(class_sets):
        try:
            members = list(cs)
        except TypeError:
            raise ValueError(
                f"class set of agent {i} is not a sequence of class ids: {cs!r}"
            ) from None
        if not members:
            raise ValueError(
                f"class set of agent {i} is empty; every agent needs at least one target class"
            )
        for k in members:
            if not _is_int(k, 0, num_classes):
                raise ValueError(f"class {k!r} of agent {i} is outside [0, {num_classes})")
        out.append(tuple(sorted({int(k) for k in members})))
    return tuple(out)


_normalise_cached = functools.lru_cache(maxsize=16)(_normalise_uncached)


def _check_shift(shift: float) -> float:
    if not (_is_real(shift) and 0.0 <= float(shift) <= 1.0):
        raise ValueError(f"shift s must be a real number in [0, 1], got {shift!r}")
    return float(shift)


def _check_fraction(name: str, value: float, *, allow_zero: bool) -> float:
    if not (_is_real(value) and (value >= 0.0 if allow_zero else value > 0.0) and value < 1.0):
        bound = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"{name} must be in {bound}, got {value!r}")
    return float(value)


def _check_seed(seed: int) -> int:
    if not _is_int(seed, 0):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _check_partition_id(partition_id: int, n: int) -> None:
    if not _is_int(partition_id, 0, n):
        raise ValueError(f"partition id {partition_id!r} is outside [0, {n}) for N={n} agents")


def _as_label_array(labels, num_classes: int) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must have an integer dtype, got {arr.dtype}")
    bad = (arr < 0) | (arr >= num_classes)
    if bad.any():
        raise ValueError(
            f"label {int(arr[bad][0])} (at position {int(np.argmax(bad))}) is outside [0, {num_classes})"
        )
    return arr.astype(np.int64, copy=False)


# ----------------------------------------------------------------------------------- Eq. 23
def label_shift_proportions(
    class_sets: ClassSets, shift: float, num_classes: int = NUM_CLASSES
) -> np.ndarray:
    """Per-agent label distributions of paper Eq. 23: ``theta_i[k] = s * 1[k in C_i] / |C_i| + (1 - s)
    / C`` for ``N`` non-empty class sets ``C_i`` and shift ``s`` in [0, 1] (0 = IID).

    Returns:
        float64 ``(N, C)``; every row sums to 1.

    Raises:
        ValueError: ``shift`` outside [0, 1], an empty class set or a class outside ``[0, C)`` (named).
    """
    s = _check_shift(shift)
    sets = _normalise_class_sets(class_sets, num_classes)
    theta = np.full((len(sets), num_classes), (1.0 - s) / num_classes, dtype=np.float64)
    for i, cs in enumerate(sets):
        theta[i, list(cs)] += s / len(cs)
    return theta


def _largest_remainder(n: int, weights: np.ndarray) -> np.ndarray:
    """Hamilton's method: counts summing to ``n``, each within 1 of ``n * weights`` (sum 1); the
    leftover units go to the largest fractional parts (ties: lower index); zero weight gets 0."""
    quota = n * weights
    counts = np.floor(quota).astype(np.int64)
    counts[weights <= 0] = 0
    leftover = n - int(counts.sum())
    frac = np.where(weights > 0, quota - counts, -1.0)
    order = np.argsort(-frac, kind="stable")
    counts[order[:leftover]] += 1
    return counts


# ----------------------------------------------------------------------------------- the split
@dataclass(frozen=True)
class FederatedSplit:
    """Indices of the shared pilot set and of every agent's train/val/test data.

    Read-only, pairwise disjoint int64 arrays into the source. Agent arrays are sorted;
    ``pilot_idx`` keeps the permutation's order (row ``r`` of every pilot matrix ``(K, d_i)`` is
    sample ``pilot_idx[r]``; capping at ``K`` takes a prefix).

    Attributes:
        pilot_idx: ``(K,)`` shared pilot samples.
        train_idx, val_idx, test_idx: one array per agent (partition id).
        class_sets, shift, seed, num_classes: the normalised ``C_i``, ``s``, seed and ``C``.
    """

    pilot_idx: np.ndarray
    train_idx: list[np.ndarray]
    val_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    class_sets: tuple[tuple[int, ...], ...]
    shift: float
    seed: int
    num_classes: int = NUM_CLASSES

    @property
    def num_agents(self) -> int:
        """Number of agents ``N``."""
        return len(self.train_idx)

    def pool_idx(self, partition_id: int) -> np.ndarray:
        """Agent ``partition_id``'s whole pool: sorted int64 ``(n_i,)`` union of its train, val and
        test indices; ValueError outside ``[0, N)``."""
        _check_partition_id(partition_id, self.num_agents)
        i = int(partition_id)
        return np.sort(np.concatenate([self.train_idx[i], self.val_idx[i], self.test_idx[i]]))

    def class_counts(self, labels, part: str = "pool") -> np.ndarray:
        """Per-agent class histogram int64 ``(N, C)`` of ``part`` (``"train"``, ``"val"``, ``"test"``
        or ``"pool"``) from the split's labels ``(M,)``; ValueError on a bad ``part`` or labels."""
        if part not in _PARTS:
            raise ValueError(f"unknown part {part!r}; valid: {_PARTS}")
        lab = _as_label_array(labels, self.num_classes)
        out = np.zeros((self.num_agents, self.num_classes), dtype=np.int64)
        for i in range(self.num_agents):
            idx = self.pool_idx(i) if part == "pool" else getattr(self, f"{part}_idx")[i]
            if idx.size and idx.max() >= lab.size:
                raise ValueError(
                    f"labels has {lab.size} entries but the split uses index {int(idx.max())}"
                )
            out[i] = np.bincount(lab[idx], minlength=self.num_classes)
        return out


def _hold_out(
    labels, seed, pilot_fraction, val_fraction, test_fraction, num_classes: int
) -> tuple[int, tuple[float, float, float], np.ndarray, np.ndarray, int]:
    """Step (a) before the pilots are chosen: checked seed and fractions (ValueError, named), labels
    ``(M,)`` int64, the seeded permutation ``(M,)`` and the hold-out size ``round(pilot_fraction * M)``."""
    seed = _check_seed(seed)
    pilot_fraction = _check_fraction("pilot_fraction", pilot_fraction, allow_zero=False)
    val_fraction = _check_fraction("val_fraction", val_fraction, allow_zero=True)
    test_fraction = _check_fraction("test_fraction", test_fraction, allow_zero=True)
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}"
        )
    lab = _as_label_array(labels, num_classes)
    perm = np.random.default_rng(seed).permutation(lab.size)
    n_hold = int(round(pilot_fraction * lab.size))
    return seed, (pilot_fraction, val_fraction, test_fraction), lab, perm, n_hold


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


def make_federated_split(
    labels,
    class_sets: ClassSets,
    shift: float,
    seed: int,
    pilot_fraction: float = 0.1,
    num_pilots: int | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    num_classes: int = NUM_CLASSES,
    min_per_split: int = 0,
) -> FederatedSplit:
    """Hold out the shared pilots, then split the rest (every sample of an observed class) across
    agents by Eq. 23 (module docstring).

    Args:
        labels: int class ids ``(M,)`` (numpy or torch) in ``[0, num_classes)``.
        class_sets: the agents' target classes ``C_i`` (``N`` non-empty sets).
        shift: ``s`` in [0, 1] (Eq. 23).
        pilot_fraction: share of the ``M`` samples held out for pilots, in (0, 1).
        num_pilots: optional cap ``K`` on the pilots (``None``: all).
        val_fraction, test_fraction: per-class shares, each in [0, 1), sum < 1.
        min_per_split: 0: the paper's per-class split. ``m >= 1``: the ``cross-device`` rule: per
            agent, its shuffled samples (seeded by ``(seed, i)``) give ``max(m, round(val_fraction
            * n))`` for validation, likewise test, the rest training (fewer than ``2 m + 1``
            samples: all training); class sets become the classes received.

    Raises:
        ValueError: bad ``shift``, ``class_sets``, fractions, seed or labels, ``num_pilots`` < 1 or
            above the eligible pilots, or no eligible pilot (``s = 1``, disjoint class sets).
    """
    theta = label_shift_proportions(class_sets, shift, num_classes)
    sets = _normalise_class_sets(class_sets, num_classes)
    s = _check_shift(shift)
    seed, (pilot_fraction, val_fraction, test_fraction), lab, perm, n_hold = _hold_out(
        labels, seed, pilot_fraction, val_fraction, test_fraction, num_classes
    )
    pilots = _eq23_pilots(lab, perm[:n_hold], theta, s, num_pilots, pilot_fraction)
    per_agent = _eq23_chunks(lab, perm[n_hold:], theta)
    if min_per_split:
        train, val, test = _train_val_test_per_agent(
            per_agent, val_fraction, test_fraction, int(min_per_split), seed
        )
        sets = _received_classes(lab, train, val, test)
    else:
        train, val, test = _train_val_test(per_agent, val_fraction, test_fraction)
    return FederatedSplit(_frozen(pilots), train, val, test, sets, s, seed, num_classes)


def _eq23_pilots(
    lab: np.ndarray,
    hold: np.ndarray,
    theta: np.ndarray,
    s: float,
    num_pilots: int | None,
    pilot_fraction: float,
) -> np.ndarray:
    """Step (a): the hold-out restricted to classes every agent observes (``theta (N, C) > 0``),
    capped at ``num_pilots``; ValueError when none is eligible or ``num_pilots`` is bad (named)."""
    m = lab.size
    observed_by_all = theta.min(axis=0) > 0.0  # (C,)
    pilots = hold[observed_by_all[lab[hold]]]
    if pilots.size == 0:
        raise ValueError(
            f"no eligible pilots: classes observed by every agent = {np.flatnonzero(observed_by_all).tolist()} "
            f"(s={s}), hold-out size {hold.size} of {m}; use s < 1, overlapping class sets or more data"
        )
    if num_pilots is None:
        return pilots
    if not _is_int(num_pilots, 1):
        raise ValueError(
            f"num-pilots={num_pilots!r}: must be a positive integer (run config: 0 = all eligible pilots)"
        )
    if num_pilots > pilots.size:
        raise ValueError(
            f"num-pilots={num_pilots} exceeds the {pilots.size} eligible pilots (hold-out samples of a "
            f"class every agent sees; the hold-out is {pilot_fraction:g} of the {m} samples); set "
            f"num-pilots <= {pilots.size}, or num-pilots=0 for all of them"
        )
    return pilots[:num_pilots]


def _eq23_chunks(lab: np.ndarray, rest: np.ndarray, theta: np.ndarray) -> list[list[np.ndarray]]:
    """Step (b): per class k, ``rest``'s samples of k cut into consecutive chunks by
    largest-remainder counts of ``theta[:, k]`` (Eq. 23); returns per agent, per class, a chunk."""
    rest_labels = lab[rest]
    per_agent: list[list[np.ndarray]] = [[] for _ in range(theta.shape[0])]
    for k in range(theta.shape[1]):
        members = rest[rest_labels == k]
        col = theta[:, k]
        if col.sum() <= 0.0 or members.size == 0:
            continue  # nobody observes class k (s = 1): dropped
        counts = _largest_remainder(members.size, col / col.sum())
        bounds = np.concatenate([[0], np.cumsum(counts)])
        for i in range(theta.shape[0]):
            per_agent[i].append(members[bounds[i] : bounds[i + 1]])
    return per_agent


def _received_classes(
    lab: np.ndarray, train: list[np.ndarray], val: list[np.ndarray], test: list[np.ndarray]
) -> tuple[tuple[int, ...], ...]:
    """Each agent's class set: the sorted classes of the samples it received."""
    return tuple(
        tuple(sorted({int(c) for c in np.unique(lab[np.concatenate([tr, va, te])])}))
        for tr, va, te in zip(train, val, test)
    )


def _train_val_test(
    per_agent: list[list[np.ndarray]], val_fraction: float, test_fraction: float
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Step (c): per agent, per class chunk: train | val | test with round-half-up sizes."""
    train, val, test = [], [], []
    for i in range(len(per_agent)):
        tr, va, te = [], [], []
        for chunk in per_agent[i]:
            n = chunk.size
            n_val = math.floor(val_fraction * n + 0.5)
            n_test = min(math.floor(test_fraction * n + 0.5), n - n_val)
            n_train = n - n_val - n_test
            tr.append(chunk[:n_train])
            va.append(chunk[n_train : n_train + n_val])
            te.append(chunk[n_train + n_val :])
        empty = np.empty(0, dtype=np.int64)
        train.append(_frozen(np.sort(np.concatenate(tr)) if tr else empty))
        val.append(_frozen(np.sort(np.concatenate(va)) if va else empty))
        test.append(_frozen(np.sort(np.concatenate(te)) if te else empty))
    return train, val, test


def _train_val_test_per_agent(
    per_agent: list[list[np.ndarray]],
    val_fraction: float,
    test_fraction: float,
    floor: int,
    seed: int,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The cross-device rule (:func:`make_federated_split`, ``min_per_split``): per agent, not per class."""
    train, val, test = [], [], []
    empty = np.empty(0, dtype=np.int64)
    for i, chunks in enumerate(per_agent):
        own = np.concatenate(chunks) if chunks else empty
        own = own[np.random.default_rng([seed, i, 23]).permutation(own.size)]
        n = own.size
        n_val = max(floor, math.floor(val_fraction * n + 0.5))
        n_test = max(floor, math.floor(test_fraction * n + 0.5))
        if n < n_val + n_test + 1:  # too few: all for training (refused later, with the sizes)
            n_val = n_test = 0
        n_train = n - n_val - n_test
        train.append(_frozen(np.sort(own[:n_train])))
        val.append(_frozen(np.sort(own[n_train : n_train + n_val])))
        test.append(_frozen(np.sort(own[n_train + n_val :])))
    return train, val, test


#: Partitioners of :func:`load_agent_data`: Eq. 23 label shift, Dirichlet label shift, or Eq. 23 with
#: the cross-device split rule.
PARTITIONER_FORMS = ("label-shift", "dirichlet:<alpha>", "cross-device")


#: Share of a source held out for the pilots (:func:`prepare_split`'s ``pilot_fraction``).
PILOT_FRACTION = 0.1


#: Fewest samples an agent needs for a training, a validation and a test sample, per partitioner
#: (80/10/10 round-half-up needs 5; cross-device 3; DirichletPartitioner's min_partition_size 10).
MIN_AGENT_SAMPLES = {"label-shift": 5, "cross-device": 3, "dirichlet": 10}


def _larger_dataset(dataset: str, m: int) -> str:
    """Advice naming a known dataset larger than ``m`` samples (not ``dataset`` itself), or ``""``."""
    from .sources import SOURCE_SIZES

    bigger = [(n, name) for name, n in SOURCE_SIZES.items() if n > m and name != dataset.strip()]
    if not bigger:
        return ""
    n, name = max(bigger)
    return f", or a larger dataset (e.g. dataset={name!r}, {n:,} images: `bash scripts/get_data.sh {name}`)"


def check_agents_fit(
    dataset: str,
    num_agents: int,
    num_pilots: int | None = None,
    *,
    zoo: str = "",
    partitioner: str = "label-shift",
) -> None:
    """Refuse, from the dataset's size alone (nothing loaded), more agents than could each get
    :data:`MIN_AGENT_SAMPLES`, or more pilots than the hold-out has. A necessary condition only
    (the exact split is checked by :func:`check_all_agents`); a source of unknown size passes.

    Raises:
        ValueError: too many agents (``zoo``) or pilots, named with the dataset's size and the fix.
    """
    m = source_size(dataset)
    if m is None:
        return
    hold = int(round(PILOT_FRACTION * m))
    kind = str(partitioner).strip()
    kind = "dirichlet" if kind.startswith("dirichlet:") else kind
    need = MIN_AGENT_SAMPLES.get(kind, 3)
    most = (m - hold) // need
    if num_agents > most:
        name = f"zoo={zoo!r} ({num_agents} agents)" if zoo else f"{num_agents} agents"
        raise ValueError(
            f"{name} on dataset={dataset!r}: its {m} samples less the {hold} held out for pilots "
            f"leave {m - hold}, and partitioner={partitioner!r} gives an agent a training, a "
            f"validation and a test sample only if it gets at least {need}, so at most {most} "
            "agents could fit, and in practice fewer (the split is uneven: how many "
            "depends on the zoo's class sets and shift; the run checks the exact split before "
            "training, naming any agent left with an empty split and the largest tiny zoo it "
            "serves); use a smaller zoo"
            f"{_larger_dataset(dataset, m)}"
        )
    if num_pilots is not None and num_pilots > hold:
        raise ValueError(
            f"num-pilots={num_pilots} exceeds the {hold} samples dataset={dataset!r} holds out for "
            f"pilots ({PILOT_FRACTION:g} of its {m}); set num-pilots <= {hold}, or num-pilots=0 for all of them"
        )


def split_floor(spec: str) -> int:
    """Minimum validation / test samples per agent of a partitioner: 1 for ``cross-device``, else 0."""
    return 1 if isinstance(spec, str) and spec.strip() == "cross-device" else 0


def parse_partitioner(spec: str) -> float | None:
    """``"label-shift"``, ``"cross-device"`` -> None (Eq. 23); ``"dirichlet:<alpha>"`` -> ``alpha > 0``;
    ValueError (naming the spec) for anything else."""
    if not isinstance(spec, str):
        raise ValueError(
            f"partitioner must be a string, got {spec!r}; valid forms: {PARTITIONER_FORMS}"
        )
    key = spec.strip()
    if key in ("label-shift", "cross-device"):
        return None
    if key.startswith("dirichlet:"):
        try:
            alpha = float(key[len("dirichlet:") :])
        except ValueError:
            alpha = float("nan")
        if math.isfinite(alpha) and alpha > 0:
            return alpha
    raise ValueError(
        f"partitioner={spec!r}: valid forms are {PARTITIONER_FORMS} with alpha > 0 (e.g. dirichlet:0.1)"
    )


def make_dirichlet_split(
    labels,
    num_agents: int,
    alpha: float,
    seed: int,
    pilot_fraction: float = 0.1,
    num_pilots: int | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    num_classes: int = NUM_CLASSES,
    min_partition_size: int = 10,
) -> FederatedSplit:
    """Shared pilots (every class eligible), a Dirichlet(alpha) label shift by flwr-datasets'
    ``DirichletPartitioner(N, "label", alpha, min_partition_size, self_balancing=False,
    shuffle=True, seed)`` (FedSAF's protocol; notes/baselines-prototypes.md, s4.6), then the split
    of :func:`make_federated_split` (arguments likewise; ``class_sets``: the classes received).

    Raises:
        ValueError: bad arguments (named); ImportError: flwr-datasets missing.
    """
    import flwr_datasets.partitioner  # noqa: F401 - missing: ImportError before the checks

    if not _is_int(num_agents, 1):
        raise ValueError(f"num_agents must be a positive integer, got {num_agents!r}")
    if not (isinstance(alpha, numbers.Real) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"Dirichlet alpha must be positive, got {alpha!r}")
    seed, (_, val_fraction, test_fraction), lab, perm, n_hold = _hold_out(
        labels, seed, pilot_fraction, val_fraction, test_fraction, num_classes
    )
    pilots = perm[:n_hold]
    if num_pilots is not None:
        if not _is_int(num_pilots, 1, n_hold + 1):
            raise ValueError(
                f"num-pilots={num_pilots!r}: must be an integer in [1, {n_hold}] (the hold-out of "
                f"{pilot_fraction:g} of the {lab.size} samples), or num-pilots=0 for all of them"
            )
        pilots = pilots[:num_pilots]
    rest = np.sort(perm[n_hold:])
    per_agent, sets = _dirichlet_chunks(
        lab, rest, int(num_agents), float(alpha), min_partition_size, seed, num_classes
    )
    train, val, test = _train_val_test(per_agent, val_fraction, test_fraction)
    return FederatedSplit(_frozen(pilots), train, val, test, sets, 0.0, seed, num_classes)


def _dirichlet_chunks(
    lab: np.ndarray,
    rest: np.ndarray,
    num_agents: int,
    alpha: float,
    min_partition_size: int,
    seed: int,
    num_classes: int,
) -> tuple[list[list[np.ndarray]], tuple[tuple[int, ...], ...]]:
    """Step (b) of :func:`make_dirichlet_split`: per agent, per class received, a chunk of
    ``rest``; and each agent's received classes."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    part = DirichletPartitioner(
        num_partitions=num_agents,
        partition_by="label",
        alpha=alpha,
        min_partition_size=int(min_partition_size),
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    part.dataset = Dataset.from_dict({"label": lab[rest].tolist(), "idx": rest.tolist()})
    per_agent, sets = [], []
    for i in range(num_agents):
        idx = np.asarray(part.load_partition(i)["idx"], dtype=np.int64)
        chunks = [idx[lab[idx] == k] for k in range(num_classes)]
        per_agent.append([c for c in chunks if c.size])
        sets.append(tuple(k for k in range(num_classes) if chunks[k].size))
    return per_agent, tuple(sets)


# ----------------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class AgentData:
    """One agent's tensors (copies; read-only by convention): images float32 ``(n, 1, 28, 28)`` in
    [0, 1], labels int64 ``(n,)``: its 80/10/10 split, the shared pilots ``(K, ...)`` in
    ``pilot_idx (K,)`` order, its ``partition_id`` and target ``classes``.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_pilot: torch.Tensor
    y_pilot: torch.Tensor
    pilot_idx: np.ndarray
    partition_id: int
    classes: tuple[int, ...]


@functools.lru_cache(maxsize=16)
def _cached_split(
    dataset: str,
    class_sets: tuple[tuple[int, ...], ...],
    shift: float,
    seed: int,
    num_pilots: int | None,
    alpha: float | None = None,
    floor: int = 0,
) -> tuple[FederatedSplit, torch.Tensor, torch.Tensor]:
    """The split of ``dataset`` (once per process and arguments) with the source's images and labels."""
    images, labels = load_source(dataset)
    if alpha is not None:
        split = make_dirichlet_split(labels, len(class_sets), alpha, seed, num_pilots=num_pilots)
    else:
        split = make_federated_split(
            labels, class_sets, shift, seed, num_pilots=num_pilots, min_per_split=floor
        )
    return split, images, labels


def pilot_digest(pilots: np.ndarray) -> int:
    """A positive 63-bit fingerprint of pilot inputs ``(K, ...)`` (SHA-256 of shape and float32
    bytes): equal iff the same samples in the same order (up to collisions)."""
    a = np.ascontiguousarray(np.asarray(pilots, dtype=np.float32))
    h = hashlib.sha256(repr(a.shape).encode() + a.tobytes()).digest()
    return int.from_bytes(h[:8], "big") >> 1 or 1


@dataclass(frozen=True)
class PreparedSplit:
    """The shared, per-process part of every agent's data (:func:`prepare_split`).

    Attributes:
        class_sets: the agents' target classes ``C_i`` (after a Dirichlet split: what each received).
        x_pilot, y_pilot: the shared pilots ``(K, 1, 28, 28)`` float32 / ``(K,)`` int64 (read-only).
        images, labels: the whole source (:func:`load_source`'s cached tensors, read-only).
        pilot_digest: :func:`pilot_digest` of ``x_pilot`` (what every agent reports at discovery).
    """

    dataset: str
    split: FederatedSplit
    class_sets: tuple[tuple[int, ...], ...]
    x_pilot: torch.Tensor
    y_pilot: torch.Tensor
    images: torch.Tensor
    labels: torch.Tensor
    pilot_digest: int


def _gather(
    images: torch.Tensor, labels: torch.Tensor, idx: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of ``idx`` (copies; numpy indexing: torch's costs ~15 ms a call via its
    thread pool on a loaded machine)."""
    t = np.asarray(idx, dtype=np.int64)
    return torch.from_numpy(images.numpy()[t]), torch.from_numpy(labels.numpy()[t])


def prepare_split(
    dataset: str,
    class_sets: ClassSets,
    shift: float,
    seed: int,
    num_pilots: int | None = None,
    partitioner: str = "label-shift",
) -> PreparedSplit:
    """The step shared by all N agents (once per process): checks, the cached index split, pilots.

    Raises:
        ValueError: bad class sets, shift, seed or partitioner (named); every error of
            :func:`load_source` and :func:`make_federated_split`.
    """
    sets = _normalise_class_sets(class_sets, NUM_CLASSES)
    alpha = parse_partitioner(partitioner)
    floor = split_floor(partitioner)
    split, images, labels = _cached_split(
        dataset, sets, _check_shift(shift), _check_seed(seed), num_pilots, alpha, floor
    )
    if alpha is not None or floor:
        sets = split.class_sets
    x_pi, y_pi = _gather(images, labels, split.pilot_idx)
    digest = pilot_digest(x_pi.numpy())
    return PreparedSplit(dataset, split, sets, x_pi, y_pi, images, labels, digest)


def agent_data(prepared: PreparedSplit, partition_id: int) -> AgentData:
    """Agent ``partition_id``'s tensors from a :func:`prepare_split` result (cost: the agent's own samples).

    Raises:
        ValueError: ``partition_id`` outside ``[0, N)``; an empty train, validation or test split, or a
            target class without any sample in the agent's data (each names the partition-id).
    """
    sets, split, dataset = prepared.class_sets, prepared.split, prepared.dataset
    _check_partition_id(partition_id, len(sets))
    i = int(partition_id)
    images, labels = prepared.images, prepared.labels
    x_tr, y_tr = _gather(images, labels, split.train_idx[i])
    x_va, y_va = _gather(images, labels, split.val_idx[i])
    x_te, y_te = _gather(images, labels, split.test_idx[i])
    sizes = {"training": y_tr.numel(), "validation": y_va.numel(), "test": y_te.numel()}
    if min(sizes.values()) == 0:
        raise ValueError(
            f"partition-id {i} (classes {list(sets[i])}) gets {sizes['training']} training, "
            f"{sizes['validation']} validation and {sizes['test']} test samples of dataset {dataset!r} "
            f"({labels.numel()} samples for N={len(sets)} agents): every split must be non-empty; use "
            f"fewer agents (zoo) or a larger dataset"
        )
    own = torch.cat([y_tr, y_va, y_te])
    absent = [c for c in sets[i] if not bool((own == c).any())]
    if absent:
        in_source = {c: int((labels == c).sum()) for c in absent}
        why = (
            "use a dataset with every class of the zoo"
            if not any(in_source.values())
            else f"they are spread over N={len(sets)} agents: use fewer agents"
        )
        raise ValueError(
            f"partition-id {i}: target class(es) {absent} of its class set {list(sets[i])} have no sample "
            f"in its data (samples of those classes in dataset {dataset!r}: {in_source}); {why}"
        )
    pilots = (prepared.x_pilot, prepared.y_pilot, split.pilot_idx)
    return AgentData(x_tr, y_tr, x_va, y_va, x_te, y_te, *pilots, i, sets[i])


register_derived_cache(_cached_split.cache_clear)


def check_all_agents(prepared: PreparedSplit, max_named: int = 5) -> None:
    """:func:`agent_data`'s checks for all N agents at once (about a second at N = 10,000); the
    ValueError names how many fail, the first ``max_named`` with their problem, and the remedy."""
    split, sets = prepared.split, prepared.class_sets
    lab = prepared.labels.numpy()
    empty, missing = [], []
    for i in range(len(sets)):
        sizes = (len(split.train_idx[i]), len(split.val_idx[i]), len(split.test_idx[i]))
        if min(sizes) == 0:
            empty.append(
                f"partition-id {i}: {sizes[0]} training, {sizes[1]} validation, {sizes[2]} test"
            )
            continue
        own = set(np.unique(lab[split.pool_idx(i)]).tolist())
        absent = [c for c in sets[i] if c not in own]
        if absent:
            missing.append(f"partition-id {i}: class(es) {absent} of {list(sets[i])}")
    n = len(sets)
    if empty:
        raise ValueError(
            f"{len(empty)} of N={n} agents get an empty training, validation or test split of dataset "
            f"{prepared.dataset!r} ({lab.size} samples): {'; '.join(empty[:max_named])}"
            f"{'; ...' if len(empty) > max_named else ''}. Every split must be non-empty: use fewer "
            f"agents (zoo) or a larger dataset"
        )
    if missing:
        raise ValueError(
            f"{len(missing)} of N={n} agents have target classes without any sample in their data "
            f"(dataset {prepared.dataset!r}): {'; '.join(missing[:max_named])}"
            f"{'; ...' if len(missing) > max_named else ''}. Use fewer agents (zoo) or a dataset with "
            f"every class of the zoo"
        )


def load_agent_data(
    dataset: str,
    class_sets: ClassSets,
    shift: float,
    seed: int,
    partition_id: int,
    num_pilots: int | None = None,
    partitioner: str = "label-shift",
) -> AgentData:
    """Agent ``partition_id``'s tensors: :func:`prepare_split` (10% pilots, 80/10/10) then
    :func:`agent_data`. ``partitioner``: one of :data:`PARTITIONER_FORMS` (Dirichlet: ``class_sets``
    only fixes ``N``).

    Raises:
        ValueError: as :func:`agent_data`, :func:`load_source` and :func:`make_federated_split`.
        FileNotFoundError: from :func:`load_source` for a missing ``idx:`` directory.
    """
    _normalise_class_sets(class_sets, NUM_CLASSES)
    _check_partition_id(partition_id, len(class_sets))
    return agent_data(
        prepare_split(dataset, class_sets, shift, seed, num_pilots, partitioner), partition_id
    )
