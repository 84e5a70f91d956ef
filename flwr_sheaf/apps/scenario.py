"""The CNN-zoo scenario: zoo + data + partition from :class:`flwr_sheaf.config.ScenarioConfig`.

This is where the CNN zoo, the data partition and the Flower glue meet: it turns a node's
``Context`` into a :class:`flwr_sheaf.client.task.LocalTask`.
"""

from __future__ import annotations

import functools

from flwr.app import Context

from ..client.task import LocalTask
from ..config import ConfigError, ScenarioConfig, apply_preset
from ..data.partition import AgentData, PreparedSplit, agent_data, check_all_agents, prepare_split
from ..data.sources import register_derived_cache
from ..models.zoo import build_agent, zoo_specs
from ..paper import AgentSpec

__all__ = ["agent_specs", "scenario_task", "cnn_task_factory", "check_scenario"]


def agent_specs(scenario: ScenarioConfig) -> tuple[AgentSpec, ...]:
    """The agents' specs of ``scenario.zoo`` (one per partition-id; paper Tab. 2 for ``paper-15``).

    Raises:
        ValueError: an unknown zoo name (named, with the valid forms).
    """
    return zoo_specs(scenario.zoo)


def scenario_task(scenario: ScenarioConfig, partition_id: int) -> LocalTask:
    """Model (seeded by ``seed`` and partition-id) and data of one agent (paper Eq. 23 partition or a Dirichlet
    label shift, ``partitioner``; 10% pilots).

    Raises:
        ValueError: partition-id outside ``[0, N)`` for the zoo (named, with N).
    """
    specs = agent_specs(scenario)
    if not 0 <= partition_id < len(specs):
        raise ValueError(
            f"partition-id {partition_id} is outside [0, {len(specs)}) for zoo {scenario.zoo!r}"
        )
    data = _agent_data(
        scenario.dataset,
        scenario.zoo,
        scenario.shift,
        scenario.seed,
        scenario.num_pilots or None,
        scenario.partitioner,
        partition_id,
    )
    model = build_agent(
        specs[partition_id],
        seed=scenario.seed * 1000 + partition_id,
        shrinkage=scenario.whitening_shrinkage,
        eps=scenario.whitening_eps,
    )
    return LocalTask(
        model,
        data.x_train,
        data.y_train,
        data.x_val,
        data.y_val,
        data.x_test,
        data.y_test,
        data.x_pilot,
        tuple(data.classes),
        y_pilot=data.y_pilot,
    )


@functools.lru_cache(maxsize=8)
def _prepared(
    dataset: str, zoo: str, shift: float, seed: int, num_pilots: int | None, partitioner: str
) -> PreparedSplit:
    """The zoo's shared data step (split and pilots), once per process: set-up is O(N) in all, not per node."""
    return prepare_split(
        dataset, [s.classes for s in zoo_specs(zoo)], shift, seed, num_pilots, partitioner
    )


@functools.lru_cache(maxsize=4096)
def _agent_data(
    dataset: str,
    zoo: str,
    shift: float,
    seed: int,
    num_pilots: int | None,
    partitioner: str,
    partition_id: int,
) -> AgentData:
    """One agent's :class:`~flwr_sheaf.data.partition.AgentData`, built once per process and shared by every
    message of that node (read-only: the handlers never write into a task's tensors). Returning the same
    tensor objects lets :func:`flwr_sheaf.client.common.to_device` keep the node's data resident on its
    GPU across messages instead of copying it for each one."""
    return agent_data(_prepared(dataset, zoo, shift, seed, num_pilots, partitioner), partition_id)


register_derived_cache(_prepared.cache_clear)
register_derived_cache(_agent_data.cache_clear)


def check_scenario(scenario: ScenarioConfig) -> None:
    """The CNN-zoo scenario's data checked for every agent on this machine, before any message
    (:func:`~flwr_sheaf.data.partition.check_all_agents`). Where the dataset is not on this machine
    (a deployment whose ServerApp host holds no data) the nodes check their own share at discovery.

    Raises:
        ConfigError: agents with an empty split or a target class without samples (named, with the remedy).
    """
    if scenario.dataset.startswith("hf:"):
        return  # a hub download on the ServerApp's host is not wanted: the nodes check at discovery
    try:
        prepared = _prepared(
            scenario.dataset,
            scenario.zoo,
            scenario.shift,
            scenario.seed,
            scenario.num_pilots or None,
            scenario.partitioner,
        )
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
            f"{exc}"
        ) from None


def cnn_task_factory(context: Context) -> LocalTask:
    """:data:`~flwr_sheaf.client.task.TaskFactory` of the CNN-zoo scenarios (reads ``context.run_config``).

    Raises:
        ConfigError: a bad scenario value in the run config (named; the ServerApp has already
            rejected unknown keys before any message was sent).
    """
    return scenario_task(
        ScenarioConfig.from_mapping(apply_preset(context.run_config)),
        int(context.node_config["partition-id"]),
    )
