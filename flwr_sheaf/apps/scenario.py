"""A scenario = zoo + data + partition, read from the run config (shared by all methods).

This is where the CNN zoo, the data partition and the Flower glue meet: it turns a node's
``Context`` into a :class:`flwr_sheaf.client.task.LocalTask`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flwr.app import Context

from ..client.task import LocalTask
from ..data.partition import load_agent_data
from ..models.zoo import build_agent, zoo_specs
from ..paper import AgentSpec

__all__ = ["Scenario", "cnn_task_factory", "DEFAULTS"]

#: Defaults of every run-config key the apps read (pyproject's [tool.flwr.app.config] mirrors them).
DEFAULTS: dict[str, object] = {
    "method": "sheaf-frl",
    "num-server-rounds": 10,
    "local-epochs": 2,
    "seed": 0,
    "shift": 0.7,
    "lambda": 0.1,
    "lambda-warmup-rounds": 0,
    "dataset": "mnist-bundled",
    "zoo": "paper-15",
    "graph": "class-overlap",
    "num-pilots": 500,
    "pilot-batch-size": 64,
    "fraction-train": 1.0,
    "participation": "",
    "absent-policy": "cached",
    "reweight-q-min": 0.05,
    "max-steps-per-epoch": 0,
    "lr": 0.05,
    "momentum": 0.9,
    "weight-decay": 5e-4,
    "batch-size": 32,
    "clip-norm": 5.0,
    "whitening-shrinkage": 0.0,
    "whitening-eps": 1e-3,
    "torch-threads": 1,
    "evaluate-every": 1,
    "results-dir": "results/default",
    # FedProto / FedSAF (flwr_sheaf.apps.methods)
    "fedproto-dim": 0,
    "fedproto-lambda": 1.0,
    "fedproto-reduction": "mse",
    "fedproto-aggregation": "weighted",
    "fedproto-missing": "carry",
    "fedsaf-lambda": 1.0,
    "fedsaf-gamma": 1.0,
    "fedsaf-structure": "",
}


def run_config_value(rc: Mapping, key: str):
    """``rc[key]`` with the documented default; raises KeyError for an unknown key."""
    if key in rc:
        return rc[key]
    if key not in DEFAULTS:
        raise KeyError(f"unknown run-config key {key!r}")
    return DEFAULTS[key]


@dataclass(frozen=True)
class Scenario:
    """Zoo, dataset and partition parameters.

    Attributes:
        zoo: zoo name (``"paper-15"``, ``"two-agent:<d>"``, ``"tiny-<N>"``).
        dataset: data source spec (``"mnist-bundled"``, ``"idx:<dir>"``, ``"hf:<name>"``).
        shift: label-shift strength s in [0, 1] (Eq. 23).
        seed: partition and initialisation seed.
        num_pilots: cap K on the shared pilots (``0`` = all of the 10% hold-out).
        whitening_shrinkage, whitening_eps: whitening-layer regularisation.

    Raises:
        ValueError: s outside [0, 1] (named).
    """

    zoo: str = "paper-15"
    dataset: str = "mnist-bundled"
    shift: float = 0.7
    seed: int = 0
    num_pilots: int = 500
    whitening_shrinkage: float = 0.0
    whitening_eps: float = 1e-3

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.shift) <= 1.0:
            raise ValueError(f"shift s must be in [0, 1], got {self.shift}")

    @classmethod
    def from_run_config(cls, rc: Mapping) -> "Scenario":
        """Build from a Flower run config (missing keys take :data:`DEFAULTS`)."""
        v = lambda k: run_config_value(rc, k)  # noqa: E731
        return cls(str(v("zoo")), str(v("dataset")), float(v("shift")), int(v("seed")), int(v("num-pilots")),
                   float(v("whitening-shrinkage")), float(v("whitening-eps")))

    @property
    def specs(self) -> tuple[AgentSpec, ...]:
        """The agents' specs (one per partition-id)."""
        return zoo_specs(self.zoo)

    @property
    def num_nodes(self) -> int:
        """Number of agents N."""
        return len(self.specs)

    def task(self, partition_id: int) -> LocalTask:
        """Model (seeded by ``seed`` and partition-id) and data of one agent.

        Raises:
            ValueError: unknown partition-id (named, with N).
        """
        specs = self.specs
        if not 0 <= partition_id < len(specs):
            raise ValueError(f"partition-id {partition_id} is outside [0, {len(specs)}) for zoo {self.zoo!r}")
        data = load_agent_data(self.dataset, [s.classes for s in specs], self.shift, self.seed, partition_id,
                               num_pilots=self.num_pilots or None)
        model = build_agent(specs[partition_id], seed=self.seed * 1000 + partition_id,
                            shrinkage=self.whitening_shrinkage, eps=self.whitening_eps)
        return LocalTask(model, data.x_train, data.y_train, data.x_val, data.y_val, data.x_test, data.y_test,
                         data.x_pilot, tuple(data.classes))


def cnn_task_factory(context: Context) -> LocalTask:
    """:data:`~flwr_sheaf.client.task.TaskFactory` of the CNN zoo scenarios (reads the run config)."""
    return Scenario.from_run_config(context.run_config).task(int(context.node_config["partition-id"]))
