"""Test oracle: one pure-numpy loop for RFedAGS and its baselines on any federated manifold problem.

Kept in the tests (not the package) as the reference the Flower strategies are checked against
(tests/test_rfedags_methods.py, tests/test_rfedags_baselines.py, tests/test_rfedags_manifolds.py);
simulations/rfedags_compare.py and simulations/rfedags_frechet.py import it from here too.

``run_federated(problem, p, method=...)`` runs round ``t = 1..T``: responders
``S_t = bernoulli_participation(p, t, seed)`` (the participation model of notes/participation.md, s1),
the method's client phase for every responder (batched in one call: identical maths, faster), then
its server step with the weights of ``mode`` (:func:`~flwr_sheaf.methods.rfedags.aggregation.participation_weights`).
The client and server functions are the ones the Flower strategies and ClientApp handlers call
(:mod:`~flwr_sheaf.methods.rfedags.strategy`, :mod:`~flwr_sheaf.methods.rfedags.client`); the loop never branches on
the manifold, only on the method.

A problem provides ``manifold``, ``num_clients``, ``samples`` (``(N, S, ...)`` or None),
``local_egrads(x, clients)``, ``minibatch_egrads(x, clients, batch)`` and ``gap(x)``
(:class:`~flwr_sheaf.methods.rfedags.pca.PCAProblem`, :class:`~flwr_sheaf.methods.rfedags.frechet.FrechetMeanProblem`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from flwr_sheaf.methods.rfedags.aggregation import MODES, RFedAGSServer, aggregate_streams
from flwr_sheaf.methods.rfedags.baselines import (
    BASELINES,
    average_ambient,
    average_endpoints,
    projection_correction,
    projection_local_steps,
    require_projection,
    svrg_local_steps,
)
from flwr_sheaf.methods.rfedags.local import local_gradient_stream
from flwr_sheaf.methods.rfedags.pca import batch_indices
from flwr_sheaf.participation import (
    DEFAULT_Q_MIN,
    bernoulli_participation,
    check_probabilities,
)

__all__ = ["METHODS", "run_federated"]

#: Methods of :func:`run_federated`.
METHODS = ("rfedags",) + BASELINES


def run_federated(
    problem,
    p: np.ndarray,
    *,
    method: str = "rfedags",
    mode: str = "corrected",
    num_rounds: int,
    local_steps: int,
    step_size: float | Callable[[int], float],
    x0: np.ndarray | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    q_min: float = DEFAULT_Q_MIN,
    global_step: float = 1.0,
    estimator: str = "plus-one",
    record_every: int = 1,
    metrics: Callable[[np.ndarray], dict] | None = None,
) -> dict:
    """Run ``method`` for ``num_rounds`` rounds under Bernoulli(p_i) participation (module docstring).

    Args:
        problem: the federated problem (module docstring).
        p: ``(N,)`` participation probabilities.
        method: one of :data:`METHODS`.
        mode: aggregation weights, one of :data:`~flwr_sheaf.methods.rfedags.aggregation.MODES`.
        num_rounds: ``T >= 1``; local_steps: ``K >= 1``.
        step_size: fixed ``alpha`` or ``t -> alpha_t`` (``t = round - 1``).
        x0: initial point (default: ``problem.manifold.random_point`` seeded by ``[seed, 2]``).
        seed: participation, mini-batch and default-``x0`` seed (batches from
            :func:`~flwr_sheaf.methods.rfedags.pca.batch_indices`, as the Flower clients draw them).
        batch_size: mini-batch size (needs ``problem.samples``), None = exact local gradients.
        q_min, estimator: the frequency estimator of ``"corrected"``.
        global_step: ``varpi`` / ``eta_g``.
        record_every: record at round 0, every ``record_every`` rounds and at ``T``.
        metrics: optional ``x -> {name: float}`` recorded with the gap.

    Returns:
        dict with lists ``rounds``, ``gap``, ``cpu_seconds`` (process CPU time since the start,
        excluding the metric evaluations), ``num_responders`` and any ``metrics`` names; scalars
        ``max_feasibility`` (max over *every* round of the manifold's constraint violation),
        ``empty_rounds``; ``x`` (final point), ``q`` (final frequency estimates).

    Raises:
        ValueError: unknown method/mode, RFedProj on a manifold it refuses (named), bad sizes.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    probs = check_probabilities(p)
    n = problem.num_clients
    if probs.size != n:
        raise ValueError(f"p has {probs.size} entries, problem has {n} clients")
    if int(num_rounds) != num_rounds or num_rounds < 1:
        raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}")
    if int(record_every) != record_every or record_every < 1:
        raise ValueError(f"record_every must be a positive integer, got {record_every!r}")
    man = problem.manifold
    if method == "rfedproj":
        require_projection(man)
    alpha = step_size if callable(step_size) else (lambda t, a=float(step_size): a)
    if x0 is None:
        x0 = man.random_point(np.random.default_rng([int(seed), 2]))
    man.check_point(x0)
    server = RFedAGSServer(
        man,
        x0,
        n,
        mode=mode,
        p=probs,
        q_min=q_min,
        global_step=global_step,
        estimator_kind=estimator,
    )
    shape = tuple(man.point_shape)
    x_mid = server.x.copy()  # RFedProj's ambient server variable
    x_mid_prev = x_mid.copy()
    zeta_prev = np.zeros((n, *shape))
    prev_mask = np.zeros(n, dtype=bool)
    hist: dict = {"rounds": [], "gap": [], "cpu_seconds": [], "num_responders": []}
    cpu = [0.0]

    def record(t: int, m: int) -> None:
        hist["rounds"].append(t)
        hist["gap"].append(problem.gap(server.x))
        hist["cpu_seconds"].append(cpu[0])
        hist["num_responders"].append(m)
        for k, v in (metrics(server.x) if metrics else {}).items():
            hist.setdefault(k, []).append(v)

    record(0, 0)
    max_feas, empty = float(man.feasibility(server.x)), 0
    for t in range(1, int(num_rounds) + 1):
        c0 = time.process_time()
        mask = bernoulli_participation(probs, t, seed)
        clients = np.flatnonzero(mask)
        a_t = alpha(t - 1)
        if batch_size is None:

            def egrad(x, k, c=clients, b=None):  # b: same signature as the minibatch variant
                return problem.local_egrads(x, c)
        else:
            s = problem.samples.shape[1]
            bidx = (
                np.stack(
                    [batch_indices(seed, t, int(c), local_steps, s, batch_size) for c in clients]
                )
                if clients.size
                else np.zeros((0, local_steps, batch_size), int)
            )

            def egrad(x, k, c=clients, b=bidx):
                return problem.minibatch_egrads(x, c, b[:, k])

        w, _ = server.weights(mask)
        uploads = np.zeros((n, *shape))
        if not clients.size:
            empty += 1
        if method == "rfedags":
            if clients.size:
                uploads[clients] = local_gradient_stream(
                    man, server.x, egrad, local_steps, a_t
                ).zeta
            server.step(mask, uploads)
        elif method == "rfedavg":
            if clients.size:
                uploads[clients] = local_gradient_stream(
                    man, server.x, egrad, local_steps, a_t
                ).endpoint
            server.x, _ = average_endpoints(man, server.x, uploads, w, global_step)
            server.estimator.observe(mask)
        elif method == "rfedsvrg":
            if clients.size:
                # gradient phase: grad f_i(x_t) on the full local data (the authors' prob.grad)
                grads = np.zeros((n, *shape))
                grads[clients] = man.egrad2rgrad(server.x, problem.local_egrads(server.x, clients))
                g_t = aggregate_streams(grads, w, shape, "gradient")
                uploads[clients] = svrg_local_steps(man, server.x, g_t, egrad, local_steps, a_t)
            server.x, _ = average_endpoints(man, server.x, uploads, w, global_step)
            server.estimator.observe(mask)
        else:  # rfedproj
            if clients.size:
                corr = np.zeros((clients.size, *shape))
                again = prev_mask[clients]
                if again.any():
                    corr[again] = projection_correction(
                        man,
                        x_mid_prev,
                        x_mid,
                        zeta_prev[clients[again]],
                        local_steps,
                        a_t,
                        global_step,
                    )
                z_hat, zeta = projection_local_steps(man, x_mid, corr, egrad, local_steps, a_t)
                uploads[clients] = z_hat
                zeta_prev[clients] = zeta
            x_mid_prev = x_mid
            x_mid, server.x = average_ambient(man, x_mid, uploads, w, global_step)
            server.estimator.observe(mask)
        prev_mask = mask
        cpu[0] += time.process_time() - c0
        max_feas = max(max_feas, float(np.max(man.feasibility(server.x))))
        if t % record_every == 0 or t == num_rounds:
            record(t, int(clients.size))
    hist.update(
        max_feasibility=max_feas,
        empty_rounds=empty,
        x=server.x.copy(),
        q=server.estimator.estimate(),
    )
    return hist
