"""RFedAGS and its baselines (RFedAvg, RFedSVRG, RFedProj) as methods of the app (notes/baselines-rfedags.md, s5).

``method = rfedags | rfedavg | rfedsvrg | rfedproj`` on the planted problem ``rfedags-problem``
(``pca``: Stiefel, ``spd``: SPD Fréchet mean, ``poincare``: Poincaré-ball Fréchet mean).
Participation: the run-config ``participation`` spec, or (empty) the problem's own probabilities.
Each round records the problem's ``gap`` and ``distance_to_optimum`` in ``results.json``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context

ACTION = "rfedags"

from ...config import (  # noqa: E402
    DEFAULTS,
    KEYS,
    ConfigError,
    Key,
    RunConfig,
    Section,
    node_partition_id,
    parse_float,
    parse_int,
    parse_str,
    section,
)
from ...protocol import pack_arrays  # noqa: E402
from ..registry import Method, register  # noqa: E402
from .baselines import BASELINES  # noqa: E402
from .baselines_strategy import RFedBaseline  # noqa: E402
from .client import ProblemClient, register_rfedags_baseline_handlers, register_rfedags_handlers  # noqa: E402,F401
from .frechet import commuting_spd_problem, symmetric_poincare_problem  # noqa: E402
from .pca import planted_pca_problem, subspace_distance  # noqa: E402
from .protocol import POINT  # noqa: E402
from .strategy import RFedAGS, RiemannianArgs  # noqa: E402

PROBLEMS = ("pca", "spd", "poincare")


@section(
    Key(
        "rfedags-problem",
        "pca",
        parse_str(PROBLEMS),
        "RFedAGS family: `pca` (planted PCA, Stiefel), `spd` (SPD Fréchet mean), `poincare` (Poincaré ball)",
    ),
    Key(
        "rfedags-mode",
        "corrected",
        parse_str(("corrected", "known-p", "uncorrected")),
        "RFedAGS aggregation weights (the baselines average uniformly over responders)",
    ),
    Key("rfedags-local-steps", 5, parse_int(1), "RFedAGS family: local Riemannian SGD steps K"),
    Key(
        "rfedags-step-size",
        0.02,
        parse_float(0.0, lo_open=True),
        "RFedAGS family: step size alpha_0",
    ),
    Key(
        "rfedags-decay-rounds",
        0.0,
        parse_float(0.0),
        "RFedAGS family: alpha_t = alpha_0 / (1 + t / decay) (0 = fixed)",
    ),
    Key(
        "rfedags-minibatch-size",
        0,
        parse_int(0),
        "RFedAGS family: local mini-batch (0 = exact gradients)",
    ),
    prefix="rfedags-",
)
class RFedAGSConfig(Section):
    """The RFedAGS family's run-config keys (its own section)."""

    problem: str
    mode: str
    local_steps: int
    step_size: float
    decay_rounds: float
    minibatch_size: int


@functools.lru_cache(maxsize=8)
def planted_problem(name: str, seed: int) -> tuple[Any, np.ndarray]:
    """``(problem, p)``: the planted problem ``name`` of ``seed`` and its participation probabilities."""
    if name == "pca":
        return planted_pca_problem(seed=seed)
    if name == "spd":
        return commuting_spd_problem(seed=seed)
    return symmetric_poincare_problem(seed=seed)


def _problem(c: RunConfig) -> tuple[Any, np.ndarray]:
    return planted_problem(c.own(RFedAGSConfig).problem, c.federation.seed)


def planted_metrics(problem: Any, x: np.ndarray) -> dict[str, float]:
    """``{"gap": F(x) - F(x*), "distance_to_optimum": dist(x, x*)}`` at the new server point ``x``
    (a picklable ``functools.partial`` of ``problem``: server checkpoints hold the strategy).
    """
    dist = (
        problem.distance_to_optimum(x)
        if hasattr(problem, "distance_to_optimum")
        else subspace_distance(x, problem.optimum()[0])
    )
    return {"gap": float(problem.gap(x)), "distance_to_optimum": float(dist)}


def check_minibatch(cfg: RFedAGSConfig, problem: Any) -> None:
    """Refuse an ``rfedags-minibatch-size`` the planted problem cannot serve, before any message.

    Raises:
        ConfigError: a mini-batch on a problem without per-client samples (``pca``), or larger than
            the clients' sample count ``S``.
    """
    b = cfg.minibatch_size
    if b == 0:
        return
    samples = getattr(problem, "samples", None)
    if samples is None:
        raise ConfigError(
            f"rfedags-minibatch-size={b}: rfedags-problem={cfg.problem!r} has no per-client "
            f"samples, only exact gradients; use rfedags-minibatch-size=0, or a problem with samples "
            f"({', '.join(repr(p) for p in PROBLEMS if p != 'pca')})"
        )
    s = int(samples.shape[1])
    if b > s:
        raise ConfigError(
            f"rfedags-minibatch-size={b}: rfedags-problem={cfg.problem!r} has S={s} samples per "
            f"client; use 1..{s} (or 0 = exact gradients)"
        )


def _build(method: str) -> Callable[[RunConfig, int], RFedAGS | RFedBaseline]:
    def build(c: RunConfig, n: int) -> RFedAGS | RFedBaseline:
        cfg, (problem, p) = c.own(RFedAGSConfig), _problem(c)
        check_minibatch(cfg, problem)
        part = c.federation.participation or p
        settings: RiemannianArgs = {
            "local_steps": cfg.local_steps,
            "step_size": cfg.step_size,
            "decay_rounds": cfg.decay_rounds,
            "manifold": problem.manifold,
            "minibatch_size": cfg.minibatch_size,
            "seed": c.federation.seed,
            "discovery_timeout": c.discovery_timeout,
            "round_metrics": functools.partial(planted_metrics, problem),
        }
        if method == "rfedags":
            return RFedAGS(n, part, mode=cfg.mode, **settings)
        return RFedBaseline(n, part, method=method, **settings)

    return build


def initial_arrays(c: RunConfig) -> ArrayRecord:
    """The initial point ``x_0``: a random point seeded by ``[seed, 2]``."""
    problem, _ = _problem(c)
    return pack_arrays(
        {POINT: problem.manifold.random_point(np.random.default_rng([c.federation.seed, 2]))}
    )


def problem_task_factory() -> Callable[[Context], ProblemClient]:
    """``factory(context)``: the node's client of the run's planted problem (from ``context.run_config``)."""

    def factory(context: Context) -> ProblemClient:
        rc = context.run_config
        cfg = RFedAGSConfig.from_mapping(rc)
        seed = KEYS["seed"](rc["seed"]) if "seed" in rc else DEFAULTS["seed"]
        return ProblemClient(planted_problem(cfg.problem, seed)[0], node_partition_id(context))

    return factory


def report_lines(results: Mapping[str, Any], last: Mapping[str, Any] | None) -> list[str]:
    """Summary lines of an RFedAGS-family run (no client evaluation): the final ``gap`` and
    ``distance_to_optimum`` (:attr:`~flwr_sheaf.methods.registry.Method.report_lines`; only when no
    round was evaluated).
    """
    if last is not None:
        return []
    done = [r for r in results["rounds"] if r.get("gap") is not None]
    if not done:
        return []
    final, cfg = done[-1], results.get("config", {})
    dist = final.get("distance_to_optimum")
    return [
        f"method {cfg['method']} | problem {cfg.get('rfedags-problem', '?')}",
        f"final round {final['round']}: optimality gap {final['gap']:.3e} | distance to the optimum "
        f"{'n/a' if dist is None else f'{dist:.3e}'} | responders {final.get('num_responders', '?')}",
    ]


def _num_nodes(c: RunConfig) -> int:
    return int(_problem(c)[0].num_clients)


def _method(name: str, action: str, handlers: Callable[..., Any]) -> Method:
    return register(
        Method(
            name,
            action,
            _build(name),
            handlers,
            config=RFedAGSConfig,
            num_nodes=_num_nodes,
            task_factory=problem_task_factory,
            initial_arrays=initial_arrays,
            report_lines=report_lines,
        )
    )


METHOD = _method("rfedags", ACTION, register_rfedags_handlers)
BASELINE_METHODS = tuple(
    _method(b, b, functools.partial(register_rfedags_baseline_handlers, methods=(b,)))
    for b in BASELINES
)
