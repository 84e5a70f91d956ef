"""The CNN-zoo scenario: a node's ``Context`` as a :class:`flwr_sheaf.client.task.LocalTask`
(zoo, data and partition of :class:`flwr_sheaf.config.ScenarioConfig`)."""

from __future__ import annotations

import functools
import re
from typing import Any

from flwr.app import Context

from ..client.task import TASK_TENSORS, LocalTask
from ..config import (
    ConfigError,
    RunConfig,
    ScenarioConfig,
    apply_preset,
    node_partition_id,
)
from ..data.partition import AgentData, PreparedSplit, agent_data, check_all_agents, prepare_split
from ..data.sources import register_derived_cache
from ..methods import Method, get_method
from ..models.zoo import build_agent, zoo_specs
from ..paper import AgentSpec
from ..protocol import NodeInfo, OutsideScenarioError
from ..strategy.sampled import SampledDiscovery

__all__ = [
    "num_nodes",
    "prepare_scenario",
    "agent_specs",
    "scenario_task",
    "cnn_task_factory",
    "node_partition_id",
    "check_scenario",
    "scenario_node_infos",
    "sampled_discovery",
]


def num_nodes(config: RunConfig, method: Method | None = None) -> int:
    """Agents of the run: the method's own count (e.g. RFedAGS's) or the CNN zoo's."""
    method = method or get_method(config.method)
    if method.num_nodes is not None:
        return method.num_nodes(config)
    return len(agent_specs(config.scenario))


def prepare_scenario(config: RunConfig, method: Method, strategy: Any, num_nodes: int) -> None:
    """Before any message: :func:`check_scenario` (for a method without its own task factory),
    then :func:`sampled_discovery` (ConfigError as those)."""
    if method.task_factory is None:
        check_scenario(config.scenario)
    sampled_discovery(config, method, strategy, num_nodes)


def agent_specs(scenario: ScenarioConfig) -> tuple[AgentSpec, ...]:
    """The agents' specs of ``scenario.zoo``, one per partition-id (ValueError: unknown zoo)."""
    return zoo_specs(scenario.zoo)


def scenario_task(scenario: ScenarioConfig, partition_id: int) -> LocalTask:
    """Model (seeded by ``seed`` and partition-id) and data of one agent (paper Eq. 23 partition or
    a Dirichlet label shift, ``partitioner``; 10% pilots).

    Raises:
        OutsideScenarioError: partition-id >= N for the zoo (a ``ValueError``; a spare node).
        ValueError: a negative partition-id.
    """
    specs = agent_specs(scenario)
    if not 0 <= partition_id < len(specs):
        error = OutsideScenarioError if partition_id >= len(specs) else ValueError
        raise error(
            f"partition-id {partition_id} is outside [0, {len(specs)}) for zoo {scenario.zoo!r}"
        )
    spec, data = specs[partition_id], _agent_data(_data_key(scenario), partition_id)
    model = build_agent(
        spec,
        seed=scenario.seed * 1000 + partition_id,
        shrinkage=scenario.whitening_shrinkage,
        eps=scenario.whitening_eps,
    )
    tensors = {name: getattr(data, name) for name in TASK_TENSORS}
    return LocalTask(model, classes=tuple(data.classes), y_pilot=data.y_pilot, **tensors)


#: ``(dataset, zoo, shift, seed, num-pilots or None, partitioner)``: what an agent's data depends on
DataKey = tuple[str, str, float, int, int | None, str]


@functools.lru_cache(maxsize=8)
def _prepared(
    dataset: str, zoo: str, shift: float, seed: int, num_pilots: int | None, partitioner: str
) -> PreparedSplit:
    """The zoo's shared data step (split and pilots), once per process: set-up is O(N) in all, not per node."""
    return prepare_split(
        dataset, [s.classes for s in zoo_specs(zoo)], shift, seed, num_pilots, partitioner
    )


@functools.lru_cache(maxsize=4096)
def _agent_data(key: DataKey, partition_id: int) -> AgentData:
    """One agent's :class:`~flwr_sheaf.data.partition.AgentData`, once per process (read-only)."""
    return agent_data(_prepared(*key), partition_id)


register_derived_cache(_prepared.cache_clear)
register_derived_cache(_agent_data.cache_clear)


def _data_key(scenario: ScenarioConfig) -> DataKey:
    """What the scenario's data depends on: the key of the caches (``num-pilots`` 0: None, all)."""
    return (
        scenario.dataset,
        scenario.zoo,
        scenario.shift,
        scenario.seed,
        scenario.num_pilots or None,
        scenario.partitioner,
    )


def check_scenario(scenario: ScenarioConfig) -> None:
    """Check every agent's data on this machine (:func:`~flwr_sheaf.data.partition.check_all_agents`);
    a dataset not here is left to the nodes' discovery.

    Raises:
        ConfigError: agents with an empty split or a target class without samples (the remedy named).
    """
    if scenario.dataset.startswith("hf:"):
        return  # a hub download on the ServerApp's host is not wanted: the nodes check at discovery
    try:
        prepared = _prepared(*_data_key(scenario))
    except (FileNotFoundError, ImportError, OSError):
        return  # not on this machine: the nodes' discovery checks it
    except ValueError as exc:
        raise ConfigError(
            f"scenario zoo={scenario.zoo!r} dataset={scenario.dataset!r}: {exc}"
        ) from None
    try:
        check_all_agents(prepared)
    except ValueError as exc:
        raise ConfigError(
            f"scenario zoo={scenario.zoo!r} dataset={scenario.dataset!r} shift={scenario.shift}: "
            f"{exc}{_largest_tiny_zoo(scenario)}"
        ) from None


def _largest_tiny_zoo(scenario: ScenarioConfig) -> str:
    """Advice for a refused ``tiny-<N>`` zoo: the largest passing ``tiny-<M>``, found by bisection
    (``tiny-M`` is a prefix of ``tiny-N``); ``""`` for another zoo or when ``tiny-2`` fails too."""
    m = re.fullmatch(r"tiny-(\d+)", scenario.zoo.strip())
    if m is None:
        return ""
    key = _data_key(scenario)

    def passes(n: int) -> bool:
        sets = [s.classes for s in zoo_specs(f"tiny-{n}")]
        try:
            check_all_agents(prepare_split(key[0], sets, *key[2:]))
        except ValueError:
            return False
        return True

    lo, hi = 1, int(m.group(1))  # lo: passes (1: none yet), hi: refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    if lo < 2:
        return ""
    return (
        f" (zoo='tiny-{lo}' is the largest tiny zoo this split serves, with this dataset, shift, "
        f"seed, num-pilots and partitioner; tiny-{lo + 1} is not)"
    )


def cnn_task_factory(context: Context) -> LocalTask:
    """:data:`~flwr_sheaf.client.task.TaskFactory` of the CNN-zoo scenarios (ConfigError: a bad
    scenario value in ``context.run_config``)."""
    return scenario_task(
        ScenarioConfig.from_mapping(apply_preset(context.run_config)), node_partition_id(context)
    )


def scenario_node_infos(scenario: ScenarioConfig, num_partitions: int) -> dict[int, NodeInfo]:
    """``{partition-id: NodeInfo}`` that every agent of the scenario reports at discovery (with
    ``num_partitions``), derived on the ServerApp from the definitions the nodes use.

    Raises:
        ConfigError: the scenario's data cannot be prepared on this machine, or is invalid.
    """
    key = f"discovery='sampled' with dataset={scenario.dataset!r}"
    if scenario.dataset.startswith("hf:"):
        raise ConfigError(
            f"{key}: the ServerApp derives every agent's description from the data, and a hub "
            f"dataset is not downloaded on its host; use discovery='all'"
        )
    try:
        prepared = _prepared(*_data_key(scenario))
    except (FileNotFoundError, ImportError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{key}: the ServerApp cannot prepare the scenario's data on this machine ({exc}); use "
            f"discovery='all' (the nodes then describe themselves)"
        ) from None
    specs, digest = agent_specs(scenario), prepared.pilot_digest
    return {
        i: NodeInfo(
            i,
            int(num_partitions),
            int(spec.d),
            tuple(int(c) for c in prepared.class_sets[i]),
            int(prepared.x_pilot.shape[0]),
            int(len(prepared.split.train_idx[i])),
            digest,
        )
        for i, spec in enumerate(specs)
    }


def sampled_discovery(config: RunConfig, method, strategy, num_nodes: int) -> None:
    """Set ``strategy.sampled_discovery`` for ``discovery = "sampled"`` (:func:`scenario_node_infos`).

    Raises:
        ConfigError: the run cannot describe nodes lazily (a method with its own task factory or no
            agents' graph, Bernoulli ``participation``, a resume, data not preparable here).
    """
    if config.discovery != "sampled":
        return
    fix, why = "use discovery='all'", None
    if method.task_factory is not None:
        why = f"method {config.method!r} brings its own task factory, so the ServerApp cannot derive its nodes"
    elif getattr(strategy, "federation", None) is None or not hasattr(
        strategy, "sampled_discovery"
    ):
        why = f"method {config.method!r} has no agents' graph drawn by fraction-train"
    elif config.federation.participation:
        why = (
            f"participation={config.federation.participation!r} draws per partition-id, which are "
            f"unknown until a node is sampled"
        )
        fix = (
            "leave participation empty (fraction-train draws over node ids) or use discovery='all'"
        )
    elif config.resume or config.resume_from:
        why = "a resumed run would meet new node ids and node state keyed by partition-id"
        fix = "resume with discovery='all' from a run started with it, or start a new run"
    if why is not None:
        raise ConfigError(f"discovery='sampled': {why}; {fix}")
    expected = scenario_node_infos(config.scenario, num_nodes)
    if len(expected) != num_nodes:
        raise ConfigError(
            f"discovery='sampled': the zoo {config.scenario.zoo!r} has {len(expected)} agents, the "
            f"strategy {num_nodes}; {fix}"
        )
    strategy.sampled_discovery = SampledDiscovery(expected)
