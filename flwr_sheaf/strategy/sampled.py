"""Sampled discovery (run-config ``discovery = "sampled"``): nodes describe themselves when first sampled.

Instead of querying every SuperNode before round 1 (minutes at 10,000 on Ray:
benchmarks/records/performance-ray-sampled.md), the server builds the graph from the ``expected``
:class:`~flwr_sheaf.protocol.NodeInfo` per partition-id, draws each round over the sorted
registered node ids, and queries the drawn nodes not yet described, each reply checked against
``expected`` (:func:`info_mismatch`). Protocol: notes/participation.md, "Sampled discovery".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.serverapp import Grid

from ..participation import ParticipationSampler
from ..protocol import NodeInfo
from . import messaging
from .discovery import POLL_SECONDS, Discovery, federation_fix, parse_reply
from .exchange import Exchange
from .ledger import RunLedger
from .records import Node

__all__ = ["SampledDiscovery", "Sampling", "info_mismatch", "sample_phase"]

log = logging.getLogger("flwr_sheaf")

#: NodeInfo fields a reply must share with the scenario's expectation
CHECKED_FIELDS = ("d", "classes", "num_pilots", "num_examples", "pilot_digest")


def info_mismatch(reported: NodeInfo, expected: NodeInfo) -> str | None:
    """Why a node's reported :class:`NodeInfo` differs from ``expected``, or None."""
    diffs = [
        f"{f.replace('_', '-')} {getattr(reported, f)!r} (the scenario gives {getattr(expected, f)!r})"
        for f in CHECKED_FIELDS
        if getattr(reported, f) != getattr(expected, f)
    ]
    if not diffs:
        return None
    return (
        f"partition-id {reported.partition_id} reports {', '.join(diffs)}: the node's data or model "
        "is not the scenario's (a different run config, dataset or package version on that node)"
    )


@dataclass(eq=False, repr=False)  # identity and a short repr: expected holds N NodeInfos
class SampledDiscovery:
    """Describe nodes when first sampled (module docstring).

    Args:
        expected: ``{partition-id: NodeInfo}`` for ``0..N-1``, what each agent must report.

    Attributes:
        node_ids: the sorted registered node ids the draws are over (set by :meth:`run`).
        described: ``{node id: partition-id}`` of the nodes that described themselves (spares too).
        refused: ``{node id: (partition-id or None, reason)}`` of the nodes whose description failed.
        rounds: ``{round: {phase: [partition-id, ...]}}`` described in that round.
        unfilled: ``{round: {phase: (filled, drawn)}}`` of the draws short of agents.

    Raises:
        ValueError: ``expected`` is not keyed by ``0..N-1``.
    """

    expected: dict[int, NodeInfo]
    num_nodes: int = field(init=False)
    node_ids: list[int] = field(init=False, default_factory=list)
    described: dict[int, int] = field(init=False, default_factory=dict)
    refused: dict[int, tuple[int | None, str]] = field(init=False, default_factory=dict)
    rounds: dict[int, dict[str, list[int]]] = field(init=False, default_factory=dict)
    unfilled: dict[int, dict[str, tuple[int, int]]] = field(init=False, default_factory=dict)
    _query: Discovery | None = field(init=False, default=None)
    _grid: Grid | None = field(init=False, default=None)
    _timeout: float = field(init=False, default=0.0)
    #: partition-ids claimed by a reply (described or refused)
    _pids: set[int] = field(init=False, default_factory=set)
    #: the round being sampled (named in failed descriptions)
    _round: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if sorted(self.expected) != list(range(len(self.expected))) or not self.expected:
            raise ValueError("expected must hold one NodeInfo per partition-id 0..N-1")
        self.expected = dict(self.expected)
        self.num_nodes = len(self.expected)

    def __getstate__(self) -> dict[str, Any]:
        """What a checkpoint stores: the descriptions and records, not the run's grid and query."""
        return {k: v for k, v in vars(self).items() if k not in ("_grid", "_query")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed record; :meth:`run` sets the grid again."""
        vars(self).update(state)
        self._grid, self._query = None, None

    def run(
        self,
        grid: Grid,
        action: str,
        config: Mapping[str, Any],
        discovery_timeout: float,
        timeout: float,
    ) -> dict[int, Node]:
        """Wait until at least N SuperNodes registered, take the sorted snapshot of their ids and
        return ``{partition-id: Node}`` of the expected infos (node id 0: not yet described).

        ``grid`` is kept for the rounds' ``query.<action>`` messages (config entries ``config``, one
        round trip at most ``timeout`` s); ``discovery_timeout``: seconds to wait for N SuperNodes.

        Raises:
            RuntimeError: fewer than N SuperNodes after ``discovery_timeout``, or a node reporting
                ``num-partitions`` < N.
        """
        self._query = Discovery(self.num_nodes, action, config, discovery_timeout)
        self._grid, self._timeout = grid, float(timeout)
        deadline = time.monotonic() + discovery_timeout
        while len(ids := sorted(int(n) for n in grid.get_node_ids())) < self.num_nodes:
            if ids and not self.described and not self.refused:
                # one node's num-partitions tells a federation that is too small at once
                wait = max(1.0, min(self._timeout, deadline - time.monotonic()))
                self.rounds[0] = {"probe": self.describe(ids[:1], wait)}
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the scenario has {self.num_nodes} agents but after {discovery_timeout:.0f} s "
                    f"only {len(ids)} SuperNodes registered (discovery=sampled); run with "
                    f"{federation_fix(self.num_nodes)}, or raise discovery-timeout"
                )
            time.sleep(POLL_SECONDS)
        self.node_ids = ids
        log.info(
            "sampled discovery: %d SuperNodes registered for %d agents; nodes describe themselves "
            "when first sampled",
            len(ids),
            self.num_nodes,
        )
        return {p: Node(0, info) for p, info in self.expected.items()}

    def order(self, sampler: ParticipationSampler, server_round: int) -> list[int]:
        """Every registered node id by increasing uniform of ``sampler`` in ``server_round``: a round
        draws the first ``max(1, floor(f N))``, a spare's or unusable node's slot going to the next.

        Raises:
            ValueError: ``sampler`` draws Bernoulli participation (per partition-id, unknown here).
        """
        if sampler.probabilities is not None:
            raise ValueError(
                "discovery='sampled' draws over node ids: Bernoulli participation (per "
                "partition-id) cannot be drawn before the nodes are described; use a fraction"
            )
        over = ParticipationSampler(
            len(self.node_ids), 1.0, seed=sampler.seed, stream=sampler.stream
        )
        u = over.uniforms(sampler.draw_round(server_round))
        return [self.node_ids[int(i)] for i in np.argsort(u, kind="stable")]

    @property
    def problems(self) -> list[str]:
        """Lines that make the run ``degraded``: unusable descriptions, draws short of agents."""
        out = []
        unusable = [why for p, why in self.refused.values() if p is None]
        if unusable:
            spares = max(0, len(self.node_ids) - self.num_nodes)
            known = sum(1 for p in self.described.values() if p >= self.num_nodes)
            least = len(unusable) - (spares - known)
            out.append(
                f"sampled discovery: {len(unusable)} drawn node(s) gave no usable description and "
                f"were sent nothing (a broken agent, or a spare SuperNode whose query handler "
                f"fails; {spares} of the {len(self.node_ids)} SuperNodes are spares, {known} "
                f"described themselves as spares"
                + (f", so at least {least} agent(s) failed" if least > 0 else "")
                + f"); first: {unusable[0]}"
            )
        if self.unfilled:
            short = [
                f"round {r} {phase}: {filled} of {drawn}"
                for r, phases in sorted(self.unfilled.items())
                for phase, (filled, drawn) in sorted(phases.items())
            ]
            out.append(
                f"sampled discovery: {len(short)} draw(s) could not give every slot to an agent "
                f"(every further SuperNode was a spare or gave no usable description): "
                f"{'; '.join(short[:5])}{' ...' if len(short) > 5 else ''}"
            )
        return out

    def sample(
        self,
        sampler: ParticipationSampler,
        server_round: int,
        phase: str,
        exchange: Exchange,
        ledger: RunLedger,
    ) -> list[int]:
        """The partition-ids drawn for ``phase`` of ``server_round``, new ones described first and
        connected to ``exchange``. A node whose description disagrees is listed and recorded failed
        in ``ledger`` (send it nothing); a spare's or unusable node's slot goes to the next.

        Raises:
            RuntimeError, ValueError: as :meth:`describe` and :meth:`order`.
        """
        order, self._round = self.order(sampler, server_round), server_round
        want, pos = sampler.num_drawn, 0
        drawn: list[int] = []
        new: list[int] = []
        t0 = time.monotonic()
        while len(drawn) < want and pos < len(order):  # a spare's or unusable node's slot: the next
            batch = order[pos : pos + want - len(drawn)]
            pos += len(batch)
            new += self.describe(
                [n for n in batch if n not in self.described and n not in self.refused]
            )
            drawn += [n for n in batch if self._agent(n)]
        self.rounds.setdefault(server_round, {})[phase] = sorted(new)
        if len(drawn) < want:
            self.unfilled.setdefault(server_round, {})[phase] = (len(drawn), want)
            log.warning(
                "sampled discovery, round %d %s: only %d of the %d drawn slots went to agents: every "
                "other SuperNode is a spare or gave no usable description (results.json "
                "'discovery.failed'); the run is degraded",
                server_round,
                phase,
                len(drawn),
                want,
            )
        log.info(
            "round %d %s: %d of %d drawn node(s) described now (%.1f s)",
            server_round,
            phase,
            len(new),
            len(drawn),
            time.monotonic() - t0,
        )
        exchange.connect(
            {p: Node(n, self.expected[p]) for n, p in self.described.items() if p < self.num_nodes}
        )
        out = []
        for n in drawn:
            pid, why = self.described.get(n), None
            if pid is None:
                pid, why = self.refused[n]
            assert pid is not None  # _agent(n)
            if why is not None:
                ledger.record_failure(server_round, phase, pid, why)
            out.append(pid)
        return sorted(out)

    def _agent(self, node_id: int) -> bool:
        """Whether described node ``node_id`` names an agent (partition-id < N), accepted or not."""
        pid = self.described.get(node_id, self.refused.get(node_id, (None, ""))[0])
        return pid is not None and pid < self.num_nodes

    def describe(self, node_ids: list[int], timeout: float | None = None) -> list[int]:
        """Query ``node_ids`` once (``timeout``: default the round timeout), record each outcome, and
        return the partition-ids < N that described themselves correctly.

        Raises:
            RuntimeError: a node reports ``num-partitions`` < N or a partition-id already claimed,
                or a reply is unusable while no spare SuperNode exists.
        """
        if not node_ids:
            return []
        assert self._query is not None and self._grid is not None  # set by run()
        msgs = [self._query.query(n) for n in node_ids]
        wait = self._timeout if timeout is None else timeout
        replies = messaging.send_and_receive(
            self._grid, msgs, wait, messaging.in_flight_limit(self._grid)
        )
        answered = {int(r.metadata.src_node_id): r for r in replies}
        new, unusable = [], []
        for n in node_ids:
            info, why = parse_reply(answered.get(n), self.num_nodes, self._pids)
            if info is None:
                unusable.append(f"node {n}: {str(why)[-500:]}")
                self.refuse(n, None, unusable[-1])
                continue
            pid = info.partition_id
            self._pids.add(pid)
            if pid < self.num_nodes and (why := info_mismatch(info, self.expected[pid])):
                self.refuse(n, pid, why)
            else:
                self.described[n] = pid
                new += [pid] if pid < self.num_nodes else []
        if unusable and len(self.node_ids) <= self.num_nodes:  # no spare SuperNode can stand in
            more = f" (and {len(unusable) - 1} more)" if len(unusable) > 1 else ""
            raise RuntimeError(f"discovery failed on {unusable[0]}{more}")
        return sorted(new)

    def refuse(self, node_id: int, pid: int | None, why: str) -> None:
        """Record ``node_id``'s failed description (``pid`` None: no usable partition-id, logged)."""
        self.refused[node_id] = (pid, why if pid is not None else f"round {self._round}: {why}")
        if pid is None:
            log.warning(
                "sampled discovery, round %d: %s: a broken agent, or a spare SuperNode whose query "
                "handler fails; it is sent nothing, its draw slot goes to the next drawn node and "
                "the run is degraded",
                self._round,
                why,
            )

    def describe_run(self) -> dict[str, Any]:
        """``results.json``'s ``discovery`` entry (docs/results-schema.md)."""
        return {
            "mode": "sampled",
            "registered": len(self.node_ids),
            "described": len([p for p in self.described.values() if p < self.num_nodes]),
            "rounds": {str(r): v for r, v in sorted(self.rounds.items())},
            "idle_node_ids": sorted(n for n, p in self.described.items() if p >= self.num_nodes),
            "failed": [
                {"node_id": n, "partition_id": p, "reason": why}
                for n, (p, why) in sorted(self.refused.items())
            ],
        }


class Sampling(Protocol):
    """What :func:`sample_phase` reads of a strategy (a narrow view; the strategy's class is not imported)."""

    sampled_discovery: SampledDiscovery | None
    exchange: Exchange
    ledger: RunLedger


def sample_phase(
    s: Sampling, sampler: ParticipationSampler, server_round: int, phase: str
) -> list[int]:
    """The partition-ids ``sampler`` picks for ``phase`` of ``server_round``: over partition-ids, or
    with ``s.sampled_discovery`` over node ids (:meth:`SampledDiscovery.sample`)."""
    if s.sampled_discovery is None:
        return sampler.sample(server_round)
    return s.sampled_discovery.sample(sampler, server_round, phase, s.exchange, s.ledger)
