"""Who trains in server round r: the one participation sampler of every strategy.

Two modes (docs/participation.md):

- **fraction** ``f`` in (0, 1]: ``n = max(1, floor(f N))`` nodes per round, uniformly without
  replacement (Flower's FedAvg semantics);
- **Bernoulli** ``p_i``: node i trains independently with probability ``p_i`` (RFedAGS's arbitrary
  participation; ``p_i = 0`` never, ``p_i = 1`` always).

Both read the same per-round uniforms ``u_i(seed, r)`` (entry i of
``numpy.random.default_rng([seed, 0, r]).random(N)``, as
:func:`flwr_sheaf.rfedags.participation.bernoulli_participation`): Bernoulli takes ``u_i < p_i``,
fraction takes the ``n`` partition-ids with the smallest ``u_i``. A Bernoulli draw therefore
depends only on (seed, server round, partition-id), a fraction draw only on (seed, server round)
and the partition-ids — never on earlier calls, on the method, or on which strategy asks — so
every method run with the same spec trains the same nodes in every round, and a numpy reference
loop draws the same masks (docs/participation.md, s1.2). The evaluators of ``fraction-evaluate`` are
a fraction draw from the separate uniforms ``default_rng([seed, 1, r])`` (s1.4).

No Flower imports: strategies and simulations both use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from .rfedags.participation import bernoulli_participation, check_probabilities

__all__ = [
    "check_participation_spec",
    "parse_participation",
    "ParticipationSampler",
    "TRAIN_STREAM",
    "EVALUATE_STREAM",
]


def _range(text: str) -> tuple[float, float]:
    raw = text.split(":", 1)[1]
    try:
        a, b = (float(x) for x in raw.split("-"))
    except ValueError:
        raise ValueError(
            f"participation spec {text!r}: expected 'uniform:<a>-<b>' with numbers"
        ) from None
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
            f"participation spec {text!r} is neither a number, a comma-separated list, "
            f"'uniform:<a>-<b>' nor 'uniform[:<seed>]'"
        ) from None
    check_probabilities(vals, "participation")
    return vals


def check_participation_spec(spec: str) -> None:
    """Syntax and range check of a participation spec (the count is checked by :func:`parse_participation`).

    Raises:
        ValueError: unparsable spec or a probability outside [0, 1] (named).
    """
    text = str(spec).strip()
    if not text:
        return
    if text.startswith("uniform:") and "-" in text:
        _range(text)
    elif text == "uniform" or text.startswith("uniform:"):
        _, sep, seed = text.partition(":")
        if sep and not re.fullmatch(r"[0-9]+", seed):
            raise ValueError(
                f"participation spec {text!r}: 'uniform:<seed>' needs a non-negative integer seed"
            )
    else:
        _values(text)


def parse_participation(
    spec: str | float | Sequence[float] | np.ndarray | Mapping[int, float] | None,
    num_nodes: int,
    seed: int = 0,
) -> np.ndarray | None:
    """Per-node participation probabilities from a spec.

    Forms: ``""`` / None (no Bernoulli: use the fraction); a number ``"0.3"`` (every node); a comma
    list ``"0.9,0.9,0.2"`` (one per partition-id); ``"uniform:<a>-<b>"`` (``p_i ~ U(a, b)`` i.i.d.,
    from ``default_rng([seed, 11])``); ``"uniform"`` / ``"uniform:<s>"`` (``p_i ~ U(0, 1)``, the
    RFedAGS paper's PCA setting, :func:`flwr_sheaf.rfedags.pca.paper_participation` with seed s);
    or an explicit sequence / ``{partition-id: p}`` mapping.

    Returns:
        ``(num_nodes,)`` float64 probabilities, or None for an empty spec.

    Raises:
        ValueError: unparsable spec, wrong count, missing partition-ids, or a value outside
            ``[0, 1]`` (named).
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
        from .rfedags.pca import paper_participation

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


#: Uniform streams of :class:`ParticipationSampler`: training draws (``[seed, 0, r]``, shared with
#: :func:`~flwr_sheaf.rfedags.participation.bernoulli_participation`) and evaluator draws (``[seed, 1, r]``).
TRAIN_STREAM, EVALUATE_STREAM = 0, 1


class ParticipationSampler:
    """Per-round training (or evaluation) sets over partition-ids ``0..N-1`` (module docstring).

    Args:
        num_nodes: N >= 1.
        fraction: fraction in (0, 1] (used when ``probabilities`` is None).
        probabilities: optional ``(N,)`` Bernoulli probabilities (see :func:`parse_participation`).
        seed: non-negative integer.
        stream: which uniforms ``numpy.random.default_rng([seed, stream, r])`` are read:
            :data:`TRAIN_STREAM` (0) for training, :data:`EVALUATE_STREAM` (1) for the evaluators of
            ``fraction-evaluate``, so the two sets are drawn independently. Bernoulli needs stream 0.
        key: the run-config key named in errors (``fraction-train`` / ``fraction-evaluate``).

    Raises:
        ValueError: N < 1, a fraction outside (0, 1], probabilities of the wrong length or range,
            probabilities with a stream other than 0.
    """

    def __init__(
        self,
        num_nodes: int,
        fraction: float = 1.0,
        probabilities: Sequence[float] | np.ndarray | None = None,
        seed: int = 0,
        *,
        stream: int = TRAIN_STREAM,
        key: str = "fraction-train",
    ) -> None:
        if int(num_nodes) != num_nodes or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"{key}={fraction!r}: must be in (0, 1]")
        if int(stream) != stream or stream < 0:
            raise ValueError(f"stream must be a non-negative integer, got {stream!r}")
        if probabilities is not None and stream != TRAIN_STREAM:
            raise ValueError("Bernoulli participation draws from stream 0 only")
        self.num_nodes = int(num_nodes)
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.stream = int(stream)
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
        """Sampler from the run-config values ``fraction-train`` and ``participation`` (see the module docstring)."""
        return cls(
            num_nodes, fraction_train, parse_participation(participation, num_nodes, seed), seed
        )

    def uniforms(self, server_round: int) -> np.ndarray:
        """``(N,)`` float64 uniforms ``u_i(seed, server_round)`` of this sampler's stream, shared by both modes."""
        return np.random.default_rng([self.seed, self.stream, int(server_round)]).random(
            self.num_nodes
        )

    def sample(self, server_round: int) -> list[int]:
        """Sorted partition-ids that train in ``server_round`` (possibly none under Bernoulli; docs/participation.md, s1)."""
        if self.probabilities is not None:
            return [
                int(i)
                for i in np.flatnonzero(
                    bernoulli_participation(self.probabilities, server_round, self.seed)
                )
            ]
        n = max(1, int(self.num_nodes * self.fraction))
        if n >= self.num_nodes:
            return list(range(self.num_nodes))
        return sorted(int(i) for i in np.argsort(self.uniforms(server_round), kind="stable")[:n])

    def describe(self) -> dict:
        """Mode and parameters (for ``results.json``)."""
        if self.probabilities is not None:
            return {
                "mode": "bernoulli",
                "seed": self.seed,
                "probabilities": [float(p) for p in self.probabilities],
            }
        return {"mode": "fraction", "seed": self.seed, "fraction": self.fraction}
