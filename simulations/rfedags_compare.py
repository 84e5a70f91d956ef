"""The RFedAGS paper's PCA comparison: optimality gap against rounds and CPU time, RFedAGS vs its baselines.

Setup (RFedAGS paper, synthetic PCA; the authors' ``PCAStief_Syn_40.m``; notes/baselines-rfedags.md, s5.5):
``(r, d) = (5, 100)``, ``N = 40`` clients, ``S = 100`` samples per client (client ``i``'s samples
``(i/N) N(0, I_d)``), participation ``p_i ~ U(0, 1)`` (Bernoulli per round), ``K = 5`` local steps,
mini-batch ``50`` without replacement, fixed step ``alpha = 6e-3`` (the authors'), ``1000`` rounds.

Methods (each a ``(method, mode)`` of ``run_federated`` of ``tests/oracles/rfedags_runner.py``, the loop whose
client and server functions the Flower strategies call; the maths layer is used directly because 40
Flower clients x 1000 rounds x 18 runs would take hours on this 2-core machine):

- ``RFedAGS (estimated p)``: ``rfedags`` / ``corrected`` (frequency estimates ``q``);
- ``RFedAGS (known p)``: ``rfedags`` / ``known-p``;
- ``RFedAGS (uncorrected)``: ``rfedags`` / ``uncorrected`` (the paper's "AGS-RS" bias illustration);
- ``RFedAvg``, ``RFedSVRG``, ``RFedProj``: ``uncorrected`` (their papers' mean over responders).

Metric: optimality gap ``F(x_t) - F*`` (``F*`` from ``eigh``), recorded every ``--record-every`` rounds,
against rounds and against process CPU seconds of the method (participation draw, every responder's
local phase, server step; metric evaluations excluded; BLAS pinned to one thread). The authors'
CPU time counts the slowest responder per round (parallel clients); here every responder's local
phase counts (sequential simulation), so the CPU axis measures total compute.

Resumable: each (method, seed) run is written to ``<out>/runs/<method>__seed<k>.csv`` and skipped when
present. Outputs ``<out>/curves.csv`` (all runs), ``<out>/summary.csv`` (final gap mean +- 95% CI over
seeds, CPU seconds) and ``<out>/rfedags_compare.png`` (two panels: gap vs rounds, gap vs CPU seconds;
mean over seeds, log scale). ``--cifar10`` adds the paper's CIFAR-10 PCA variant through ``hf:`` when
the Hugging Face hub is reachable; offline it prints why it is skipped.

    python simulations/rfedags_compare.py [--out results/rfedags_compare] [--rounds 1000] [--seeds 1,2,3]
                                          [--step-size 6e-3] [--methods ...] [--record-every 10] [--cifar10]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from flwr_sheaf.methods.rfedags.pca import PCAProblem, synthetic_pca_problem  # noqa: E402
from flwr_sheaf.participation import paper_participation  # noqa: E402

# the numpy loop is the tests' oracle of the Flower strategies (tests/oracles/), not package code
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracles.rfedags_runner import run_federated  # noqa: E402

#: label -> (method, mode) of run_federated
METHODS = {
    "RFedAGS (estimated p)": ("rfedags", "corrected"),
    "RFedAGS (known p)": ("rfedags", "known-p"),
    "RFedAGS (uncorrected)": ("rfedags", "uncorrected"),
    "RFedAvg": ("rfedavg", "uncorrected"),
    "RFedSVRG": ("rfedsvrg", "uncorrected"),
    "RFedProj": ("rfedproj", "uncorrected"),
}


def _slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("(", "").replace(")", "")


def run_one(prob: PCAProblem, p: np.ndarray, label: str, seed: int, args) -> list[dict]:
    """One (method, seed) run; rows ``method, seed, round, gap, cpu_seconds``."""
    method, mode = METHODS[label]
    x0 = prob.manifold.random_point(
        np.random.default_rng([seed, 9])
    )  # same x0 for every method of a seed
    h = run_federated(
        prob,
        p,
        method=method,
        mode=mode,
        num_rounds=args.rounds,
        local_steps=args.local_steps,
        step_size=args.step_size,
        x0=x0,
        seed=seed,
        batch_size=args.batch_size,
        record_every=args.record_every,
    )
    assert h["max_feasibility"] < 1e-10, (label, h["max_feasibility"])
    return [
        {"method": label, "seed": seed, "round": t, "gap": g, "cpu_seconds": c}
        for t, g, c in zip(h["rounds"], h["gap"], h["cpu_seconds"])
    ]


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by this script, numbers parsed."""
    with open(path) as f:
        return [
            {k: (v if k == "method" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)
        ]


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` (same keys) with a header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def ci95(vals: list[float]) -> float:
    """Half-width of the 95% t interval of the mean (NaN for fewer than two values)."""
    from scipy.stats import t

    return (
        float(t.ppf(0.975, len(vals) - 1)) * statistics.stdev(vals) / math.sqrt(len(vals))
        if len(vals) > 1
        else float("nan")
    )


def summarise(rows: list[dict], labels: list[str]) -> list[dict]:
    """Final-round gap and total CPU seconds per method: mean +- 95% CI over seeds."""
    out = []
    for label in labels:
        mine = [r for r in rows if r["method"] == label]
        if not mine:
            continue
        last = max(r["round"] for r in mine)
        fin = [r for r in mine if r["round"] == last]
        gaps, cpus = [r["gap"] for r in fin], [r["cpu_seconds"] for r in fin]
        gap0 = statistics.mean(r["gap"] for r in mine if r["round"] == 0)
        out.append(
            {
                "method": label,
                "rounds": int(last),
                "seeds": len(fin),
                "gap_round0": gap0,
                "gap_final_mean": statistics.mean(gaps),
                "gap_final_ci95": ci95(gaps),
                "cpu_seconds_mean": statistics.mean(cpus),
            }
        )
    return out


def plot(rows: list[dict], labels: list[str], path: Path, title: str) -> None:
    """Two panels: mean gap over seeds against rounds and against CPU seconds (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label in labels:
        mine = [r for r in rows if r["method"] == label]
        if not mine:
            continue
        rounds = sorted({r["round"] for r in mine})
        gap = [statistics.mean(r["gap"] for r in mine if r["round"] == t) for t in rounds]
        cpu = [statistics.mean(r["cpu_seconds"] for r in mine if r["round"] == t) for t in rounds]
        axes[0].semilogy(rounds, gap, label=label)
        axes[1].semilogy(cpu, gap, label=label)
    axes[0].set_xlabel("round")
    axes[1].set_xlabel("process CPU seconds")
    for ax in axes:
        ax.set_ylabel("optimality gap F(x_t) - F*")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face hub opens within ``timeout`` seconds."""
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def cifar10_problem(
    num_clients: int = 50, samples_per_client: int = 1000, r: int = 4
) -> PCAProblem:
    """The paper's CIFAR-10 PCA variant from ``hf:uoft-cs/cifar10``: flattened ``3 x 32 x 32`` images in [0, 1],
    centred; client ``i`` takes ``S`` consecutive images of the label-sorted training set (non-IID).

    Raises:
        ImportError: without the ``datasets`` package; OSError: the hub is unreachable.
    """
    from datasets import load_dataset

    ds = load_dataset("uoft-cs/cifar10", split="train")
    order = np.argsort(np.asarray(ds["label"]), kind="stable")[: num_clients * samples_per_client]
    imgs = np.stack(
        [np.asarray(ds[int(i)]["img"], dtype=np.float64).reshape(-1) / 255.0 for i in order]
    )
    imgs -= imgs.mean(axis=0)
    z = imgs.reshape(num_clients, samples_per_client, -1)
    cov = np.einsum("nsd,nse->nde", z, z) / samples_per_client
    return PCAProblem(cov, r, samples=z)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/rfedags_compare")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--step-size", type=float, default=6e-3)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--record-every", type=int, default=10)
    ap.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated labels of METHODS"
    )
    ap.add_argument(
        "--cifar10", action="store_true", help="also run the CIFAR-10 variant (needs the HF hub)"
    )
    args = ap.parse_args()
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in labels:
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown {m!r}; choose from {list(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for seed in seeds:
        prob = synthetic_pca_problem(num_clients=40, d=100, r=5, samples_per_client=100, seed=seed)
        p = paper_participation(40, seed=seed)
        for label in labels:
            path = out / "runs" / f"{_slug(label)}__seed{seed}.csv"
            if not path.exists():
                part = run_one(prob, p, label, seed, args)
                write_csv(path, part)
                print(
                    f"seed {seed} {label:24s} final gap {part[-1]['gap']:.4g}  cpu {part[-1]['cpu_seconds']:.1f} s",
                    flush=True,
                )
            rows += read_csv(path)
    write_csv(out / "curves.csv", rows)
    summary = summarise(rows, labels)
    write_csv(out / "summary.csv", summary)
    plot(
        rows,
        labels,
        out / "rfedags_compare.png",
        f"synthetic PCA (r, d) = (5, 100), N = 40, S = 100, p_i ~ U(0,1), K = 5, alpha = {args.step_size:g}, "
        f"{len(seeds)} seeds",
    )
    print(f"{'method':24s} {'gap(0)':>8s} {'final gap':>22s} {'cpu s':>7s}")
    for s in summary:
        print(
            f"{s['method']:24s} {s['gap_round0']:8.4f} {s['gap_final_mean']:10.4f} +- {s['gap_final_ci95']:8.4f} "
            f"{s['cpu_seconds_mean']:7.1f}"
        )
    if args.cifar10:
        if not hub_reachable():
            print(
                "CIFAR-10 PCA skipped: the Hugging Face hub (huggingface.co:443) is not reachable from this "
                "machine (offline); rerun with --cifar10 where it is."
            )
        else:
            prob = cifar10_problem()
            p = paper_participation(prob.num_clients, seed=seeds[0])
            args.step_size, args.rounds = 3e-5, 600
            crow = []
            for label in labels:
                crow += run_one(prob, p, label, seeds[0], args)
            write_csv(out / "cifar10_curves.csv", crow)
            plot(
                crow,
                labels,
                out / "rfedags_compare_cifar10.png",
                "CIFAR-10 PCA (r, d) = (4, 3072), N = 50",
            )


if __name__ == "__main__":
    main()
