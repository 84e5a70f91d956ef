"""Sheaf-FRL peer-routing strategy: relays each node only its graph neighbours' pilots.

No global model exists (paper Sec. 4): the server emulates decentralised exchange. Per server
round (design.md s4):

1. ``configure_train``: discovery once (node_id <-> partition-id, d_i, C_i; graph validated and
   oriented), then each sampled node gets an ``ArrayRecord`` with its neighbours' latest whitened
   pilot matrices ``(K, d_j)`` (key = neighbour partition-id) and a ``ConfigRecord`` with lambda,
   local epochs and its incident edges (neighbour ids, dims, orientation).
2. ``aggregate_train``: validates and stores each reply's pilots (shape ``(K, d_i)``, finite).
   Pilot age per node is tracked.
3. ``configure_evaluate``: phase 1 (sent here, synchronously) collects private accuracy and the
   whitened validation/test latents of every node; the returned phase-2 messages route to each
   node its neighbours' pilots and latents.
4. ``aggregate_evaluate``: communication accuracy per directed edge, mean over receivers and the
   degree-weighted mean (= mean over directed edges, paper Fig. 2), recorded in ``history``.

Partial participation (notes ``anchor-rfedags-fedsaf-fedproto.md`` B): each round trains either
``fraction_train`` of the nodes (uniform, seeded) or, when ``participation`` gives per-node
probabilities p_i, an independent Bernoulli(p_i) draw per node
(:func:`flwr_sheaf.rfedags.participation.bernoulli_participation`, seeded by ``(seed, round)``, so
runs that differ only in the absent policy see the same participants). What a sampled node gets of a
neighbour j that did not train in the previous round is the *absent-neighbour policy*:

- ``cached`` (default): j's last pilots. They are exact, because j's encoder has not changed since
  it produced them (pilots are computed in eval mode on fixed inputs), so every edge term is exact and
  partial participation is random block-coordinate descent with the full-participation stationary
  points. Their age (rounds since j produced them) is reported.
- ``drop``: only pilots produced in the previous round are relayed (a relay without a cache). The
  expected gluing penalty then weights edge (i, j) by j's participation probability: a biased
  objective (RFedAGS Thm. 2.1's bias, moved to the edges).
- ``drop-reweighted``: as ``drop``, but each relayed edge term is scaled by ``w_ij = 1/q_j``, with
  ``q_j`` the frequency with which j's pilots arrived in earlier rounds
  (:class:`flwr_sheaf.rfedags.participation.FrequencyEstimator`, floored at ``reweight_q_min``);
  the weights travel in the message config as ``edge-weights``. RFedAGS's ``1/(q_i N)`` with the
  ``1/N`` of its average dropped, since each edge term appears once: ``E[1{j present}/q_j] = 1``.
  The estimate used in round t counts rounds ``1..t-2`` only, so it is independent of whether j's
  round-(t-1) pilots arrived (the paper's order). Unbiased for the penalty gradient at the start of
  local training; several local steps leave a drift bias (notes B.3).

A round in which nobody is sampled sends no train message: every node keeps its weights and the
bank its pilots (evaluation, if due, runs as usual), and the round counts as one with no arrivals in
the frequency estimates. A node with p_i = 0 never trains: its neighbours get no pilots of it (no
edge term), and it is evaluated with its initial weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import networkx as nx
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..client.task import numpy_record
from ..rfedags.participation import FrequencyEstimator, bernoulli_participation, check_probabilities
from .graph import GraphStrategy, nanmean

__all__ = ["SheafFRL", "ABSENT_POLICIES", "parse_participation", "DEFAULT_REWEIGHT_Q_MIN"]

log = logging.getLogger("flwr_sheaf")
ABSENT_POLICIES = ("cached", "drop", "drop-reweighted")
#: Floor of q_j for ``drop-reweighted`` (notes B.3: q >= 0.05, i.e. edge weights <= 20).
DEFAULT_REWEIGHT_Q_MIN = 0.05


def parse_participation(spec: str | float | None, num_nodes: int, seed: int = 0) -> list[float] | None:
    """Per-node participation probabilities from a run-config value (run configs hold no lists).

    Forms: ``""`` (None: use ``fraction-train``); a number ``"0.3"`` (every node); a comma list
    ``"0.9,0.9,0.2"`` (one per partition-id); ``"uniform:<a>-<b>"`` (``p_i ~ U(a, b)`` i.i.d.,
    seeded by ``seed``); ``"uniform"`` / ``"uniform:<seed>"`` (``p_i ~ U(0, 1)``, as RFedAGS's PCA
    app; :func:`flwr_sheaf.strategy.rfedags.participation_from_config`).

    Raises:
        ValueError: unparsable spec, wrong count, a value outside ``[0, 1]`` (named).
    """
    from .rfedags import participation_from_config

    text = "" if spec is None else str(spec).strip()
    if not text:
        return None
    if text.startswith("uniform:") and "-" in text:
        raw = text.split(":", 1)[1]
        try:
            a, b = (float(x) for x in raw.split("-"))
        except ValueError:
            raise ValueError(f"participation spec {text!r}: expected 'uniform:<a>-<b>' with numbers") from None
        if not 0.0 <= a <= b <= 1.0:
            raise ValueError(f"participation spec {text!r}: need 0 <= a <= b <= 1")
        p = a + (b - a) * np.random.default_rng([int(seed), 11]).random(num_nodes)
        return [float(x) for x in check_probabilities(p, "participation")]
    return [float(x) for x in participation_from_config(text, num_nodes)]


class SheafFRL(GraphStrategy):
    """Sheaf-FRL relay strategy (paper Alg. 1 over Flower messages).

    Args:
        num_nodes: number of agents (graph nodes = partition-ids ``0..num_nodes-1``).
        graph: a ``networkx.Graph`` on partition-ids or a spec string for
            :func:`flwr_sheaf.topology.build_graph` (``"class-overlap"``, ``"ring"``, ``"0-1,1-2"``);
            class-overlap graphs are built from the class sets the nodes report.
        train_config: values forwarded to every ``train.sheaf`` message (``lambda``,
            ``local-epochs``, ``lr``, ...; see :class:`flwr_sheaf.client.sheaf.SheafTrainConfig`).
        absent_policy: ``"cached"`` (default), ``"drop"`` or ``"drop-reweighted"`` (module docstring).
        lambda_warmup_rounds: lambda ramps linearly from lambda/W to lambda over the first W rounds.
        reweight_q_min: floor of the arrival-frequency estimate q_j of ``drop-reweighted``
            (edge weights are at most ``1/reweight_q_min``).
        action: message action name (default ``"sheaf"``).
        **kwargs: :class:`GraphStrategy` / :class:`PeerStrategy` options (evaluate_every, num_rounds,
            fraction_train, participation, seed, ...).

    Raises:
        ValueError: unknown absent policy; (at discovery) a graph that is not connected or names a
            missing partition-id; nodes reporting a different pilot count.
    """

    def __init__(self, num_nodes: int, graph: nx.Graph | str = "class-overlap", train_config: Mapping | None = None,
                 absent_policy: str = "cached", lambda_warmup_rounds: int = 0, action: str = "sheaf",
                 reweight_q_min: float = DEFAULT_REWEIGHT_Q_MIN, **kwargs) -> None:
        super().__init__(num_nodes=num_nodes, graph=graph, action=action, **kwargs)
        if absent_policy not in ABSENT_POLICIES:
            raise ValueError(f"absent policy must be one of {ABSENT_POLICIES}, got {absent_policy!r}")
        self.train_config = dict(train_config or {})
        self.absent_policy = absent_policy
        self.lambda_warmup_rounds = int(lambda_warmup_rounds)
        self.seed = int(kwargs.get("seed", 0))
        self._p = None
        if self.participation is not None:
            missing = sorted(set(range(num_nodes)) - set(self.participation))
            if missing:
                raise ValueError(f"participation has no probability for partition-id(s) {missing}")
            self._p = np.array([self.participation[i] for i in range(num_nodes)], dtype=np.float64)
        self.bank: dict[int, np.ndarray] = {}
        self.bank_round: dict[int, int] = {}
        #: arrival frequency of each node's pilots (``drop-reweighted``); the estimate used in round t
        #: is ``self._q_for_next`` (computed in round t-1 before observing it).
        self.frequency = FrequencyEstimator(num_nodes, q_min=reweight_q_min)
        self._q_for_next = self.frequency.estimate()
        #: ``{(receiver i, neighbour j): (age, weight)}`` of the pilots relayed in the last train round.
        self.relayed: dict[tuple[int, int], tuple[int, float]] = {}
        self._train_metrics: dict = {}

    def sample(self, server_round: int) -> list[int]:
        """Nodes that train in ``server_round`` (sorted): Bernoulli(p_i) seeded by ``(seed, round)`` when
        per-node probabilities are set (possibly none), else ``fraction_train`` as in FedAvg."""
        if self._p is None:
            return super().sample(server_round)
        return [int(i) for i in np.flatnonzero(bernoulli_participation(self._p, server_round, self.seed))]

    def neighbour_pilots(self, pid: int, nbrs: list[int], server_round: int) -> tuple[dict[str, np.ndarray], list[float]]:
        """Pilots relayed to ``pid`` under the absent policy, and the edge weights aligned with ``nbrs``.

        Records ``(age, weight)`` per relayed edge in :attr:`relayed`; age = rounds since the
        neighbour produced the pilots (1 = in the previous round). A neighbour that never reported
        contributes nothing (weight 0).
        """
        pilots, weights = {}, []
        for j in nbrs:
            rj = self.bank_round.get(j)
            if rj is None or (self.absent_policy != "cached" and rj != server_round - 1):
                weights.append(0.0)
                continue
            w = 1.0 / float(self._q_for_next[j]) if self.absent_policy == "drop-reweighted" else 1.0
            pilots[str(j)] = self.bank[j]
            weights.append(w)
            self.relayed[(pid, j)] = (server_round - rj, w)
        return pilots, weights

    def lam(self, server_round: int) -> float:
        """Lambda used in ``server_round`` (linear warm-up over ``lambda_warmup_rounds``)."""
        lam = float(self.train_config.get("lambda", 0.1))
        w = self.lambda_warmup_rounds
        return lam * min(1.0, server_round / w) if w > 0 else lam

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One ``train.sheaf`` message per sampled node, carrying only its neighbours' pilots."""
        self.ensure_discovered(grid)
        self.begin_round(server_round)
        sampled = self.sample(server_round)
        self._round["sampled"] = sampled
        self.relayed = {}
        msgs, possible = [], 0
        for pid in sampled:
            ec = self._edge_config(pid)
            pilots, weights = self.neighbour_pilots(pid, ec["neighbours"], server_round)
            possible += sum(1 for j in ec["neighbours"] if j in self.bank_round)
            extra = {"edge-weights": weights} if self.absent_policy == "drop-reweighted" else {}
            cfg = ConfigRecord({**{k: v for k, v in self.train_config.items()}, **dict(config), **ec, **extra,
                                "lambda": self.lam(server_round), "server-round": server_round})
            content = RecordDict({"pilots": numpy_record(pilots), "config": cfg})
            msgs.append(self.message(pid, content, "train", server_round))
        ages = [a for a, _ in self.relayed.values()]
        ws = [w for _, w in self.relayed.values()]
        self._round.update({
            "num_sampled": len(sampled),
            "edges_relayed": len(self.relayed),
            "edges_dropped": possible - len(self.relayed),  # neighbour had pilots, the policy withheld them
            "relayed_pilot_age_mean": nanmean(ages),
            "relayed_pilot_age_max": max(ages) if ages else 0,
            "edge_weight_mean": nanmean(ws),
            "edge_weight_max": max(ws) if ws else float("nan"),
        })
        if not sampled:
            log.info("round %d: no node sampled (nothing trains; pilots and weights unchanged)", server_round)
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and cache the fresh pilots; returns no arrays (there is no global model)."""
        ok = self.split_replies(server_round, "train", replies, self._round.get("sampled", []))
        ce, glue, lvf = [], [], []
        for pid, r in ok.items():
            a = r.content["pilots"]["pilots"].numpy()
            d = self.nodes[pid].d
            if a.ndim != 2 or a.shape != (self.num_pilots, d):
                self.failures.append({"round": server_round, "phase": "train", "partition-id": pid,
                                      "reason": f"pilot matrix shape {a.shape}, expected ({self.num_pilots}, {d})"})
                log.warning("partition-id %d sent pilots of shape %s, expected (%d, %d): ignored", pid, a.shape, self.num_pilots, d)
                continue
            if not np.isfinite(a).all():
                self.failures.append({"round": server_round, "phase": "train", "partition-id": pid, "reason": "NaN/inf pilots"})
                log.warning("partition-id %d sent NaN/inf pilots: ignored, cached pilots kept", pid)
                continue
            self.bank[pid] = a
            self.bank_round[pid] = server_round
            m = r.content["metrics"]
            ce.append(float(m["ce"]))
            glue.append(float(m["gluing"]))
            lvf.append(float(m["low-variance-fraction"]))
        arrived = np.zeros(self.num_nodes, dtype=bool)
        arrived[[p for p, r in self.bank_round.items() if r == server_round]] = True
        self._q_for_next = self.frequency.estimate()  # rounds 1..t-1: independent of round t's arrivals
        self.frequency.observe(arrived)
        ages = [server_round - r for r in self.bank_round.values()]
        self._train_metrics = {
            "ce": nanmean(ce), "gluing_loss": nanmean(glue), "lambda": self.lam(server_round),
            "num_trained": len(ce), "pilot_age_mean": nanmean(ages), "pilot_age_max": max(ages) if ages else 0,
            "never_trained": self.num_nodes - len(self.bank_round),
        }
        self._round.update(self._train_metrics)
        return None, MetricRecord({k: float(v) for k, v in self._train_metrics.items()})
