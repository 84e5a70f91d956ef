"""Who trains in server round r: the one participation sampler of every strategy (notes/participation.md, s1).

**fraction** ``f``: the ``max(1, floor(f N))`` smallest uniforms ``u_i`` of ``default_rng([seed, 0, r])``
(Flower's FedAvg); **Bernoulli** ``p_i``: ``u_i < p_i`` (RFedAGS), so every method trains the same
nodes; evaluators read ``[seed, 1, r]`` (s1.4).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "check_probabilities",
    "bernoulli_participation",
    "simulate_participation",
    "FrequencyEstimator",
    "DEFAULT_Q_MIN",
    "ESTIMATORS",
    "paper_participation",
    "check_participation_spec",
    "parse_participation",
    "ParticipationSampler",
    "smallest_uniforms",
    "TRAIN_STREAM",
    "EVALUATE_STREAM",
    "PANEL_STREAM",
]

# ------------------------------------------------- Bernoulli draws and frequency estimates (RFedAGS)
#: Default floor of the frequency estimate: caps a responder's weight at ``1/(q_min N)``; clients
#: with ``p_i < q_min`` are under-weighted by ``p_i/q_min`` (paper Assumption 3.8: ``q`` > 0).
DEFAULT_Q_MIN = 0.01

#: Frequency estimators of :class:`FrequencyEstimator`: ``"plus-one"`` (default; one pseudo-response,
#: ``q = (c + 1)/(t + 1)``) and ``"empirical"`` (the paper's ``q = c/t``).
ESTIMATORS = ("plus-one", "empirical")


def check_probabilities(p: np.ndarray | Sequence[float], name: str = "p") -> np.ndarray:
    """``(N,)`` float64 copy of the participation probabilities ``p`` (``N >= 1``, each in ``[0, 1]``).

    Raises:
        ValueError: not 1-D, empty, or an entry that is not in ``[0, 1]`` (``name[i]`` named).
    """
    arr = np.array(p, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0.0) | (arr > 1.0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {float(arr[i])} is not a probability in [0, 1]")
    return arr


def responded_mask(responded: np.ndarray | list[bool], n: int) -> np.ndarray:
    """``responded`` as an ``(n,)`` bool mask; ValueError unless shaped so and boolean (or 0/1)."""
    mask = np.asarray(responded)
    if mask.shape != (n,):
        raise ValueError(f"responded mask must have shape ({n},), got {mask.shape}")
    if mask.dtype != bool:
        if not np.all((mask == 0) | (mask == 1)):
            raise ValueError("responded mask must be boolean (or 0/1)")
        mask = mask.astype(bool)
    return mask


def _check_int(name: str, value: int, lo: int = 0) -> None:
    if int(value) != value or value < lo:
        kind = "positive" if lo == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")


def bernoulli_participation(
    p: np.ndarray | list[float],
    server_round: int,
    seed: int = 0,
    force_one_if_empty: bool = False,
) -> np.ndarray:
    """``(N,)`` bool mask of the clients responding in ``server_round``: ``u_i < p_i`` (a function of
    ``(seed, server_round)`` only). ``force_one_if_empty``: an empty round gets one random client
    with ``p_i > 0`` (the authors' fallback; it changes the statistics). ValueError on invalid
    ``p``, ``seed`` or ``server_round``."""
    probs = check_probabilities(p)
    _check_int("seed", seed)
    _check_int("server_round", server_round)
    rng = np.random.default_rng([int(seed), 0, int(server_round)])
    mask = rng.random(probs.size) < probs
    if force_one_if_empty and not mask.any():
        candidates = np.flatnonzero(probs > 0.0)
        if candidates.size:
            mask[int(rng.choice(candidates))] = True
    return mask


def simulate_participation(
    p: np.ndarray | list[float],
    num_rounds: int,
    seed: int = 0,
    first_round: int = 1,
    force_one_if_empty: bool = False,
) -> np.ndarray:
    """``(T, N)`` bool masks of ``T = num_rounds`` rounds from ``first_round``: row ``k`` is
    ``bernoulli_participation(p, first_round + k, seed)``; ValueError on invalid arguments."""
    _check_int("num_rounds", num_rounds)
    probs = check_probabilities(p)
    rows = [
        bernoulli_participation(probs, first_round + k, seed, force_one_if_empty)
        for k in range(int(num_rounds))
    ]
    return np.array(rows, dtype=bool).reshape(int(num_rounds), probs.size)


class FrequencyEstimator:
    """Frequency estimate ``q_i^t`` of the participation probabilities (RFedAGS Assumption 3.8;
    notes/participation.md, s2 and s4).

    With ``c_i`` responses in ``t`` rounds: ``"plus-one"`` ``q_i = max((c_i + 1)/(t + 1), q_min)``
    (expected corrected weight never above ``1/N``, s4.1); ``"empirical"`` (the paper's)
    ``q_i = max(c_i / t, q_min)``, ``prior`` before any round. Call :meth:`estimate` before or after
    :meth:`observe` (or pass ``include``: the authors' order). ``q_min`` and ``prior`` lie in ``(0, 1]``.

    Raises:
        ValueError: invalid ``num_clients``, ``q_min``, ``prior`` or ``estimator`` (named).
    """

    def __init__(
        self,
        num_clients: int,
        q_min: float = DEFAULT_Q_MIN,
        prior: float = 1.0,
        estimator: str = "plus-one",
    ) -> None:
        _check_int("num_clients", num_clients, 1)
        if not (np.isfinite(q_min) and 0.0 < q_min <= 1.0):
            raise ValueError(f"q_min must be in (0, 1], got {q_min!r}")
        if not (np.isfinite(prior) and 0.0 < prior <= 1.0):
            raise ValueError(f"prior must be in (0, 1], got {prior!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self.num_clients = int(num_clients)
        self.q_min = float(q_min)
        self.prior = float(prior)
        self.estimator = estimator
        self.counts = np.zeros(self.num_clients, dtype=np.int64)
        self.rounds = 0

    def observe(self, responded: np.ndarray | list[bool]) -> None:
        """Record one round: ``responded``, the ``(N,)`` bool (or 0/1) mask of the clients whose
        upload arrived; ValueError otherwise."""
        self.counts += responded_mask(responded, self.num_clients)
        self.rounds += 1

    def estimate(self, include: np.ndarray | list[bool] | None = None) -> np.ndarray:
        """``(N,)`` float64 estimates ``q_i^t`` in ``[q_min, 1]``; ``include``: a ``(N,)`` mask of a
        round counted without recording it (ValueError when ill-shaped)."""
        counts, rounds = self.counts, self.rounds
        if include is not None:
            mask = np.asarray(include)
            if mask.shape != (self.num_clients,):
                raise ValueError(
                    f"include mask must have shape ({self.num_clients},), got {mask.shape}"
                )
            counts, rounds = counts + mask.astype(bool), rounds + 1
        if self.estimator == "plus-one":
            return np.maximum((counts + 1.0) / (rounds + 1.0), self.q_min)
        if rounds == 0:
            return np.full(self.num_clients, self.prior)
        return np.maximum(counts / rounds, self.q_min)


def paper_participation(num_clients: int = 40, seed: int = 0) -> np.ndarray:
    """``(N,)`` float64 ``p_i ~ U(0, 1)`` from ``default_rng([seed, 4])`` (the RFedAGS paper's PCA
    experiment, notes/baselines-rfedags.md, s5.5); ValueError unless ``num_clients`` is a positive int.
    """
    _check_int("num_clients", num_clients, 1)
    return np.random.default_rng([int(seed), 4]).random(num_clients)


# ------------------------------------------------------------------------- run-config specs, sampler


#: A probability in a spec: decimal or scientific, no sign (the ``-`` of ``uniform:<a>-<b>``).
_NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_RANGE_RE = re.compile(rf"\s*({_NUMBER})\s*-\s*({_NUMBER})\s*")
#: The grammar of the participation spec, quoted by its errors.
PARTICIPATION_GRAMMAR = (
    "a probability for every node ('0.3'), one per partition-id ('0.9,0.5,0.2'), "
    "'uniform:<a>-<b>' (p_i ~ U(a, b), 0 <= a <= b <= 1; numbers in decimal or scientific "
    "notation, e.g. 'uniform:1e-3-0.5') or 'uniform[:<integer seed>]' (p_i ~ U(0, 1))"
)


def _range(text: str) -> tuple[float, float]:
    m = _RANGE_RE.fullmatch(text.split(":", 1)[1])
    if m is None:
        raise ValueError(f"participation spec {text!r}: expected {PARTICIPATION_GRAMMAR}")
    a, b = float(m.group(1)), float(m.group(2))
    if not 0.0 <= a <= b <= 1.0:
        raise ValueError(f"participation spec {text!r}: need 0 <= a <= b <= 1")
    return a, b


def _values(text: str) -> list[float]:
    items = text.split(",")
    empty = [i for i, v in enumerate(items) if not v.strip()]
    if empty and len(items) > 1:
        raise ValueError(
            f"participation spec {text!r}: entry {empty[0]} (0-based, partition-id {empty[0]}) is empty; "
            f"give one probability per partition-id, e.g. '0.9,0.5,0.2'"
        )
    try:
        vals = [float(v) for v in items]
    except ValueError:
        raise ValueError(
            f"participation spec {text!r} is neither a number nor one of the forms: {PARTICIPATION_GRAMMAR}"
        ) from None
    check_probabilities(vals, "participation")
    return vals


def check_participation_spec(spec: str) -> None:
    """Syntax and range check of a participation spec (not the count); ValueError (named)."""
    text = str(spec).strip()
    if not text:
        return
    if text.startswith("uniform:") and "-" in text:
        _range(text)
    elif text == "uniform" or text.startswith("uniform:"):
        _, sep, seed = text.partition(":")
        if sep and not re.fullmatch(r"[0-9]+", seed):
            raise ValueError(
                f"participation spec {text!r}: 'uniform:<seed>' needs a non-negative integer seed; "
                f"the forms are {PARTICIPATION_GRAMMAR}"
            )
    else:
        _values(text)


def parse_participation(
    spec: str | float | Sequence[float] | np.ndarray | Mapping[int, float] | None,
    num_nodes: int,
    seed: int = 0,
) -> np.ndarray | None:
    """Per-node participation probabilities from a spec.

    Forms: ``""`` / None (use the fraction); ``"0.3"`` (every node); ``"0.9,0.9,0.2"`` (one per
    partition-id); ``"uniform:<a>-<b>"`` (``p_i ~ U(a, b)`` from ``default_rng([seed, 11])``);
    ``"uniform"`` / ``"uniform:<s>"`` (:func:`paper_participation` with seed s); or a sequence /
    ``{partition-id: p}`` mapping.

    Returns ``(num_nodes,)`` float64 probabilities, or None for an empty spec.

    Raises:
        ValueError: unparsable spec, wrong count, missing partition-ids or a bad value (named).
    """
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        missing = sorted(set(range(num_nodes)) - {int(k) for k in spec})
        if missing:
            raise ValueError(f"participation has no probability for partition-id(s) {missing}")
        outside = sorted({int(k) for k in spec} - set(range(num_nodes)))
        if outside:
            raise ValueError(
                f"participation names partition-id(s) {outside} outside [0, {num_nodes}) (N={num_nodes} "
                f"nodes); give one probability per partition-id 0..{num_nodes - 1}"
            )
        return check_probabilities(
            [spec[k] for k in sorted(spec, key=int)][:num_nodes], "participation"
        )
    if not isinstance(spec, (str, int, float)):
        vals = list(spec)
        if len(vals) != num_nodes:
            raise ValueError(
                f"participation has {len(vals)} entries, expected num_nodes={num_nodes}"
            )
        return check_probabilities(vals, "participation")
    text = str(spec).strip()
    if not text:
        return None
    check_participation_spec(text)
    if text.startswith("uniform:") and "-" in text:
        a, b = _range(text)
        return a + (b - a) * np.random.default_rng([int(seed), 11]).random(num_nodes)
    if text.startswith("uniform"):
        _, _, s = text.partition(":")
        return paper_participation(num_nodes, seed=int(s) if s else 0)
    vals = _values(text)
    if len(vals) == 1:
        vals = vals * num_nodes
    if len(vals) != num_nodes:
        raise ValueError(
            f"participation spec {text!r} has {len(vals)} values, expected {num_nodes}"
        )
    return check_probabilities(vals, "participation")


#: Uniform streams of :class:`ParticipationSampler`: training (``[seed, 0, r]``, as
#: :func:`bernoulli_participation`) and evaluators (``[seed, 1, r]``).
TRAIN_STREAM, EVALUATE_STREAM = 0, 1
#: Stream of the fixed evaluation panel (``evaluate-nodes = panel``): one draw ``[seed, 2, 0]``.
PANEL_STREAM = 2


def smallest_uniforms(uniforms: np.ndarray, n: int) -> list[int]:
    """The fraction draw: sorted positions of the ``n`` smallest ``uniforms (M,)`` (stable ties)."""
    if n >= len(uniforms):
        return list(range(len(uniforms)))
    return sorted(int(i) for i in np.argsort(uniforms, kind="stable")[:n])


class ParticipationSampler:
    """Per-round training (or evaluation) sets over partition-ids ``0..N-1`` (module docstring):
    ``fraction`` in (0, 1], or Bernoulli ``probabilities`` ``(N,)`` (:func:`parse_participation`).

    ``stream`` picks the uniforms ``default_rng([seed, stream, r])`` (Bernoulli: stream 0 only);
    ``fixed_round``, when set, is the round every draw reads; ``key`` is named in errors.

    Raises:
        ValueError: N < 1, a fraction outside (0, 1], probabilities of the wrong length or range,
            probabilities with a stream other than 0.
    """

    #: class default: a sampler restored from a checkpoint written before ``fixed_round`` existed
    fixed_round: int | None = None

    def __init__(
        self,
        num_nodes: int,
        fraction: float = 1.0,
        probabilities: Sequence[float] | np.ndarray | None = None,
        seed: int = 0,
        *,
        stream: int = TRAIN_STREAM,
        key: str = "fraction-train",
        fixed_round: int | None = None,
    ) -> None:
        _check_int("num_nodes", num_nodes, 1)
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"{key}={fraction!r}: must be in (0, 1]")
        _check_int("stream", stream)
        if probabilities is not None and stream != TRAIN_STREAM:
            raise ValueError("Bernoulli participation draws from stream 0 only")
        self.num_nodes = int(num_nodes)
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.stream = int(stream)
        self.fixed_round = None if fixed_round is None else int(fixed_round)
        #: ``(N,)`` float64, or None (fraction mode)
        self.probabilities = None
        if probabilities is not None:
            p = check_probabilities(probabilities, "participation")
            if p.size != self.num_nodes:
                raise ValueError(
                    f"participation has {p.size} entries, expected num_nodes={self.num_nodes}"
                )
            self.probabilities = p

    @classmethod
    def from_spec(
        cls, num_nodes: int, fraction_train: float, participation: str, seed: int
    ) -> ParticipationSampler:
        """Sampler from the run-config values ``fraction-train`` and ``participation``."""
        return cls(
            num_nodes, fraction_train, parse_participation(participation, num_nodes, seed), seed
        )

    def draw_round(self, server_round: int) -> int:
        """The round whose uniforms ``server_round``'s draw reads (:attr:`fixed_round` when set)."""
        return int(server_round) if self.fixed_round is None else self.fixed_round

    def uniforms(self, server_round: int) -> np.ndarray:
        """``(N,)`` float64 uniforms of this stream for :meth:`draw_round` of ``server_round``."""
        return np.random.default_rng(
            [self.seed, self.stream, self.draw_round(server_round)]
        ).random(self.num_nodes)

    def sample(self, server_round: int) -> list[int]:
        """Sorted partition-ids that train in ``server_round`` (possibly none under Bernoulli)."""
        if self.probabilities is not None:
            mask = bernoulli_participation(self.probabilities, server_round, self.seed)
            return [int(i) for i in np.flatnonzero(mask)]
        return smallest_uniforms(self.uniforms(server_round), self.num_drawn)

    @property
    def num_drawn(self) -> int:
        """Nodes a fraction draw picks per round: ``max(1, floor(fraction * num_nodes))``."""
        return max(1, int(self.num_nodes * self.fraction))

    def describe(self) -> dict:
        """Mode and parameters (for ``results.json``)."""
        if self.probabilities is not None:
            return {
                "mode": "bernoulli",
                "seed": self.seed,
                "probabilities": [float(p) for p in self.probabilities],
            }
        return {"mode": "fraction", "seed": self.seed, "fraction": self.fraction}
