"""RFedAGS on federated PCA through Flower (in-process LocalGrid): corrected vs known-p vs uncorrected.

Two problems (notes/baselines-rfedags.md, s5.5-s5.6):

- ``synthetic``: the paper's setup, ``(d, r, N, S) = (100, 5, 40, 100)``, client i's samples
  ``(i/N) N(0, I)``, ``p_i ~ U(0, 1)``, K = 5 local steps, mini-batch 50 without replacement, fixed
  alpha (default 2e-2, the value of check R4). Metric: optimality gap ``F(x_t) - F*`` (the pooled
  eigengap is ~4e-3, so subspace distances are not meaningful here). The uncorrected method's bias
  floor ``F(U~) - F*`` (``U~`` = minimiser of the ``p~``-re-weighted cost) is reported.
- ``planted``: 5 frequent clients (p = 0.9) spiking ``e0, e1`` and 5 rare ones (p = 0.2) spiking
  ``e2, e3``; exact local gradients, K = 5, ``alpha_t = 0.05 / (1 + t/200)``. Corrected runs find
  ``span(e2, e3)``; the uncorrected mean converges to ``U~ ~ span(e0, e1)`` (distance sqrt 2).

Every run goes through ``RFedAGS`` (strategy) + ``register_rfedags_handlers`` (ClientApp) on
:class:`flwr_sheaf.testing.LocalGrid`; ``--check`` re-runs the pure-numpy reference and reports the
largest difference of the final iterates. Outputs ``results.json`` and ``rfedags_pca.png`` (log-scale
gap and subspace distance per round) under ``--out`` and prints a table.

``--estimators plus-one,empirical`` runs the corrected mode once per frequency estimator (labels
``corrected`` for the default ``plus-one``, ``corrected[empirical]`` for the paper's ``c/t``;
notes/participation.md, s4.1) and ``--modes`` restricts the modes; a gap-curve table (``F(x_t) - F*``
at rounds 1, 2, 3, 5, 10, 20, 50, ...) is printed for every run.

    python simulations/rfedags_pca.py [--out results/rfedags_pca] [--synthetic-rounds 500]
                                      [--planted-rounds 1500] [--seed 1] [--check]
                                      [--modes corrected,known-p,uncorrected] [--estimators plus-one]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp

from flwr_sheaf.methods.rfedags.aggregation import effective_weights_uncorrected
from flwr_sheaf.methods.rfedags.client import problem_factory, register_rfedags_handlers
from flwr_sheaf.methods.rfedags.local import step_size_schedule
from flwr_sheaf.methods.rfedags.pca import (
    PCAProblem,
    planted_pca_problem,
    subspace_distance,
    synthetic_pca_problem,
)
from flwr_sheaf.methods.rfedags.strategy import RFedAGS
from flwr_sheaf.participation import ESTIMATORS, paper_participation
from flwr_sheaf.testing import LocalGrid

# the numpy loop is the tests' oracle of the Flower strategies (tests/oracles/), not package code
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracles.rfedags_runner import run_federated  # noqa: E402

MODES = ("corrected", "known-p", "uncorrected")


def run_one(
    prob: PCAProblem,
    p: np.ndarray,
    mode: str,
    rounds: int,
    x0: np.ndarray,
    *,
    local_steps: int,
    alpha0: float,
    decay_rounds: float,
    seed: int,
    batch_size: int,
    estimator: str = "plus-one",
) -> dict:
    """One Flower run; returns per-round gap / distances and timing (``estimator``: of the corrected mode)."""
    app = register_rfedags_handlers(ClientApp(), problem_factory(prob))
    grid = LocalGrid(app, prob.num_clients)
    strat = RFedAGS(
        prob.num_clients,
        p,
        mode=mode,
        local_steps=local_steps,
        step_size=alpha0,
        decay_rounds=decay_rounds,
        seed=seed,
        minibatch_size=batch_size,
        estimator=estimator,
    )
    u_star, _ = prob.optimum()
    u_tilde = prob.reweighted_optimum(effective_weights_uncorrected(p))
    hist = {"round": [], "gap": [], "dist": [], "dist_reweighted": []}

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        x = arrays["x"].numpy()
        vals = {
            "gap": prob.gap(x),
            "dist": subspace_distance(x, u_star),
            "dist_reweighted": subspace_distance(x, u_tilde),
        }
        hist["round"].append(rnd)
        for k, v in vals.items():
            hist[k].append(v)
        return MetricRecord(vals)

    t0 = time.perf_counter()
    res = strat.start(grid, ArrayRecord({"x": Array(x0)}), num_rounds=rounds, evaluate_fn=evaluate)
    wall = time.perf_counter() - t0
    x = res.arrays["x"].numpy()
    responders = [r["num_responders"] for r in strat.history]
    return {
        **hist,
        "x": x,
        "wall_seconds": wall,
        "mean_responders": float(np.mean(responders)),
        "empty_rounds": int(sum(r == 0 for r in responders)),
        "max_feasibility": float(max(r["feasibility"] for r in strat.history)),
        "final_q": strat.server.estimator.estimate().tolist(),
    }


def run_numpy(
    prob: PCAProblem, p: np.ndarray, mode: str, s: dict, x0: np.ndarray, seed: int, estimator: str
) -> dict:
    """The pure-numpy reference run (``run_federated`` of ``tests/oracles/rfedags_runner.py``) in
    :func:`run_one`'s format."""
    t0 = time.perf_counter()
    u_star = prob.optimum()[0]
    p_tilde = effective_weights_uncorrected(p)
    u_tilde = prob.reweighted_optimum(p_tilde) if p_tilde.sum() > 0 else u_star
    ref = run_federated(
        prob,
        p,
        mode=mode,
        num_rounds=s["rounds"],
        local_steps=s["local_steps"],
        step_size=step_size_schedule(s["alpha0"], s["decay_rounds"]),
        x0=x0,
        seed=seed,
        batch_size=s["batch_size"] or None,
        estimator=estimator,
        metrics=lambda x: {
            "dist": subspace_distance(x, u_star),
            "dist_reweighted": subspace_distance(x, u_tilde),
        },
    )
    responders = ref["num_responders"][1:]
    return {
        "round": ref["rounds"],
        "gap": ref["gap"],
        "dist": ref["dist"],
        "dist_reweighted": ref["dist_reweighted"],
        "x": ref["x"],
        "wall_seconds": time.perf_counter() - t0,
        "mean_responders": float(np.mean(responders)),
        "empty_rounds": int(ref["empty_rounds"]),
        "max_feasibility": float(ref["max_feasibility"]),
        "final_q": np.asarray(ref["q"]).tolist(),
    }


def problem_setups(args: argparse.Namespace) -> dict:
    """The two problems of the module docstring with their run parameters.

    Returns:
        ``{"synthetic": {...}, "planted": {...}}``, each with ``prob`` (:class:`PCAProblem`),
        ``p`` (``(N,)`` probabilities), ``rounds``, ``local_steps``, ``alpha0``, ``decay_rounds``
        and ``batch_size`` (0 = exact gradients).
    """
    syn = synthetic_pca_problem(seed=args.seed)
    p_syn = paper_participation(syn.num_clients, seed=args.seed + 1)
    planted, p_pl = planted_pca_problem(seed=args.seed)
    return {
        "synthetic": dict(
            prob=syn,
            p=p_syn,
            rounds=args.synthetic_rounds,
            local_steps=5,
            alpha0=args.alpha,
            decay_rounds=0.0,
            batch_size=50,
        ),
        "planted": dict(
            prob=planted,
            p=p_pl,
            rounds=args.planted_rounds,
            local_steps=5,
            alpha0=0.05,
            decay_rounds=200.0,
            batch_size=0,
        ),
    }


def plot(results: dict, path: Path) -> None:
    """2 x 2 figure: rows = problems, columns = optimality gap / subspace distance (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for row, (name, res) in enumerate(results.items()):
        for col, key, label in (
            (0, "gap", "F(x_t) - F*"),
            (1, "dist", "||x x^T - U U^T||_F / sqrt 2"),
        ):
            ax = axes[row][col]
            for mode, h in res["runs"].items():
                ys = np.maximum(np.array(h[key]), 1e-16)
                ax.plot(h["round"], ys, label=mode)
            if key == "gap" and res.get("bias_floor") is not None:
                ax.axhline(
                    res["bias_floor"],
                    color="grey",
                    ls="--",
                    lw=1,
                    label="F(U~) - F* (uncorrected floor)",
                )
            if key == "dist":
                if "uncorrected" in res["runs"]:
                    ax.plot(
                        res["runs"]["uncorrected"]["round"],
                        np.maximum(res["runs"]["uncorrected"]["dist_reweighted"], 1e-16),
                        color="C2",
                        ls=":",
                        label="uncorrected: dist to U~",
                    )
            ax.set_yscale("log")
            ax.set_xlabel("server round")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label}")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Run every (problem, mode) pair; write JSON + PNG; print the table. Returns the results dict."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="results/rfedags_pca")
    ap.add_argument("--synthetic-rounds", type=int, default=500)
    ap.add_argument("--planted-rounds", type=int, default=1500)
    ap.add_argument(
        "--alpha", type=float, default=2e-2, help="fixed local step of the synthetic problem"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--check", action="store_true", help="compare with the pure-numpy reference loop"
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of modes to run")
    ap.add_argument(
        "--estimators",
        default="plus-one",
        help="comma list of frequency estimators of the corrected mode (plus-one, empirical)",
    )
    ap.add_argument(
        "--numpy",
        action="store_true",
        help="run the pure-numpy reference loop instead of Flower (same maths, checked by --check and "
        "tests/test_rfedags_flower.py; much faster)",
    )
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    bad = [m for m in modes if m not in MODES] + [e for e in estimators if e not in ESTIMATORS]
    if bad or not modes or not estimators:
        ap.error(
            f"unknown or empty --modes/--estimators {bad}: modes {MODES}, estimators {ESTIMATORS}"
        )
    runs = [(m, e) for m in modes for e in (estimators if m == "corrected" else ["plus-one"])]
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("flwr_sheaf").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results: dict = {}
    for name, s in problem_setups(args).items():
        prob, p = s["prob"], s["p"]
        x0 = prob.manifold.random_point(np.random.default_rng([args.seed, 2]))
        p_tilde = effective_weights_uncorrected(p)
        u_tilde = prob.reweighted_optimum(p_tilde)
        entry = {
            "config": {k: v for k, v in s.items() if k not in ("prob", "p")}
            | {"N": prob.num_clients, "d": prob.d, "r": prob.r, "seed": args.seed},
            "p": p.tolist(),
            "p_tilde": p_tilde.tolist(),
            "F_star": prob.optimum()[1],
            "eigengap": prob.eigengap,
            "bias_floor": prob.gap(u_tilde),
            "runs": {},
        }
        for mode, est in runs:
            label = mode if est == "plus-one" else f"{mode}[{est}]"
            if args.numpy:
                h = run_numpy(prob, p, mode, s, x0, args.seed, est)
            else:
                h = run_one(
                    prob,
                    p,
                    mode,
                    s["rounds"],
                    x0,
                    local_steps=s["local_steps"],
                    alpha0=s["alpha0"],
                    decay_rounds=s["decay_rounds"],
                    seed=args.seed,
                    batch_size=s["batch_size"],
                    estimator=est,
                )
            if args.check and not args.numpy:
                ref = run_federated(
                    prob,
                    p,
                    mode=mode,
                    num_rounds=s["rounds"],
                    local_steps=s["local_steps"],
                    step_size=step_size_schedule(s["alpha0"], s["decay_rounds"]),
                    x0=x0,
                    seed=args.seed,
                    batch_size=s["batch_size"] or None,
                    record_every=s["rounds"],
                    estimator=est,
                )
                h["max_abs_diff_to_reference"] = float(np.abs(h["x"] - ref["x"]).max())
            h["x"] = h["x"].tolist()
            entry["runs"][label] = h
            print(f"  {name:9s} {label:21s} done in {h['wall_seconds']:.1f} s", flush=True)
        results[name] = entry

    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    plot(results, out / "rfedags_pca.png")

    head = (
        f"{'problem':9s} {'mode':21s} {'rounds':>6s} {'gap_0':>9s} {'gap_T':>10s} {'dist_T':>8s} "
        f"{'dist~_T':>8s} {'|S|':>5s} {'empty':>5s} {'wall s':>7s}"
    )
    if args.check:
        head += f" {'|x-ref|':>9s}"
    print(head)
    for name, entry in results.items():
        for mode, h in entry["runs"].items():
            line = (
                f"{name:9s} {mode:21s} {h['round'][-1]:6d} {h['gap'][0]:9.3e} {h['gap'][-1]:10.3e} "
                f"{h['dist'][-1]:8.4f} {h['dist_reweighted'][-1]:8.4f} {h['mean_responders']:5.1f} "
                f"{h['empty_rounds']:5d} {h['wall_seconds']:7.1f}"
            )
            if args.check:
                line += f" {h['max_abs_diff_to_reference']:9.2e}"
            print(line)
        print(
            f"{name:9s} F* = {entry['F_star']:.6f}, eigengap = {entry['eigengap']:.3e}, "
            f"uncorrected bias floor F(U~) - F* = {entry['bias_floor']:.3e}"
        )
    for name, entry in results.items():  # gap curves: F(x_t) - F* at a few rounds
        last = entry["runs"][next(iter(entry["runs"]))]["round"][-1]
        marks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 1500, 2000) if t <= last]
        print(f"{name}: gap F(x_t) - F* at round t")
        print(f"  {'run':21s} " + " ".join(f"{t:>9d}" for t in marks))
        for label, h in entry["runs"].items():
            print(
                f"  {label:21s} " + " ".join(f"{h['gap'][h['round'].index(t)]:9.2e}" for t in marks)
            )
    print(f"wrote {out / 'results.json'} and {out / 'rfedags_pca.png'}")
    return results


if __name__ == "__main__":
    main()
