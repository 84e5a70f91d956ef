"""The product's local epoch against a plain PyTorch floor, in one process (issue "GPUs for real").

Product: the in-process runner (:class:`flwr_sheaf.testing.LocalGrid`: the same ServerApp/ClientApp
code as ``flwr run``, every agent in this process) for two server rounds of one local epoch:
round 1 trains on cross-entropy only (no neighbour pilots yet), round 2 is a glued epoch (Alg. 1).
Only the train round trips are timed (messages, (de)serialisation, the node's model rebuilt and
restored, training, the pilot pass and the upload).

Floor: a plain loop over the same agents (the same models, initial weights and data from
:func:`flwr_sheaf.apps.scenario.scenario_task`), the same graph, batch size, optimiser, clipping
and step count per agent, and for the glued epoch the same arithmetic the penalty needs: per agent
one eval-mode pass over the K pilots after its epoch (its upload; the neighbours' and its own
pilots at the start of the glued epoch are those of the CE epoch, as in the product), the Procrustes SVD of every incident edge (Eq. 18), and per
SGD step the private batch's cross-entropy plus a pilot minibatch through the encoder (eval mode),
its batch whitening and the Eq. 16 residual against each neighbour's fixed pilot rows, backward,
clipping and the SGD step. No messages, no metrics, no state, no checks.

Both are timed in CPU seconds (``time.process_time``: all threads of this process; unlike wall time
they do not grow when other programs share the machine) and, on CUDA, wall seconds after
``torch.cuda.synchronize()``. The ratio product / floor is what the benchmark is for; the absolute
figures depend on the machine. The floor runs twice, before and after the product, and the ratio
uses the mean of the two (``--no-bracket``: once, after): on a shared machine the speed of a core
drifts over a ten-minute run, and a floor measured only after the product once put a product that
matches the floor step for step at 1.17x.

    python benchmarks/floor.py --device cpu --dataset fashion-mnist --threads 1     # paper-scale epoch, CPU
    python benchmarks/floor.py --device cuda --dataset fashion-mnist                # the same on a GPU
    python benchmarks/floor.py --device cpu --zoo tiny-3 --dataset mnist-bundled --extra graph=ring num-pilots=64 max-steps-per-epoch=2

Writes ``<out>/floor-<device>.json``; with ``--profile`` the product runs a third, glued round under
``torch.profiler`` (CPU and CUDA activities; not part of the timed figures) and its top ops go to
``<out>/profile-<device>.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from epoch_time import TimedGrid  # noqa: E402
from inprocess import parse_overrides  # noqa: E402

from flwr_sheaf.apps.client_app import app as client_app  # noqa: E402
from flwr_sheaf.apps.scenario import agent_specs, scenario_task  # noqa: E402
from flwr_sheaf.apps.server_app import run_server  # noqa: E402
from flwr_sheaf.config import RunConfig  # noqa: E402
from flwr_sheaf.devices import resolve_device  # noqa: E402
from flwr_sheaf.topology import build_graph  # noqa: E402


class _Clock:
    """CPU seconds and (device-synchronised) wall seconds of a block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> _Clock:
        self._sync()
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.cpu, self.wall = time.process_time() - self.cpu0, time.perf_counter() - self.wall0


def product_epochs(rc: dict, profile_to: Path | None = None) -> dict:
    """Run the product (two or, when profiling, three server rounds); CPU and wall seconds of the
    first two rounds' train round trips.

    Returns:
        ``{"ce": (cpu, wall), "glued": (cpu, wall), "results": results dict}``.
    """
    cfg = RunConfig.from_run_config(rc)
    grid = TimedGrid(client_app, len(agent_specs(cfg.scenario)), run_config=rc)
    dev = resolve_device(str(rc.get("device", "auto")))
    prof = None
    if (
        profile_to is not None
    ):  # profile a third (glued) round's train round trip, after the two timed ones
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
        )
        prof = torch.profiler.profile(activities=acts)
        orig = grid.send_and_receive

        def send_and_receive(messages, *, timeout=None):
            msgs = list(messages)
            train = bool(msgs) and msgs[0].metadata.message_type.startswith("train")
            if train and sum(1 for k, _, _ in grid.timings if k == "train") == 2:
                with prof:
                    out = orig(msgs, timeout=timeout)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                return out
            return orig(msgs, timeout=timeout)

        grid.send_and_receive = send_and_receive
    res = json.loads(Path(run_server(grid, rc)).read_text())
    train = [(c, w) for kind, c, w in grid.timings if kind == "train"]
    out = {"ce": train[0], "glued": train[1], "results": res}
    if prof is not None:
        events = prof.key_averages()
        sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        table = events.table(sort_by=sort, row_limit=30)
        wall = [w for kind, _, w in grid.timings if kind == "train"][2]
        if (
            dev.type == "cuda"
        ):  # device busy time: the kernels' self time (us) over the round's wall time
            busy = (
                sum(
                    getattr(e, "self_device_time_total", 0.0)
                    or getattr(e, "self_cuda_time_total", 0.0)
                    for e in events
                )
                / 1e6
            )
            out["profile"] = {
                "wall_s": wall,
                "device_busy_s": busy,
                "device_idle_fraction": max(0.0, 1 - busy / wall),
            }
            table += (
                f"\nprofiled glued round: {wall:.3f} s wall, device busy {busy:.3f} s "
                f"({100 * busy / wall:.1f}%), idle {100 * max(0.0, 1 - busy / wall):.1f}%\n"
            )
        profile_to.write_text(table)
    return out


def _procrustes(a_head: torch.Tensor, a_tail: torch.Tensor) -> torch.Tensor:
    """Restriction map ``(d_head, d_tail)`` minimising ``||A_head - A_tail V^T||`` (Eq. 18)."""
    u, _, vt = torch.linalg.svd((a_head.T @ a_tail).double(), full_matrices=False)
    return (u @ vt).to(a_head.dtype)


def floor_setup(rc: dict) -> tuple[dict, list[list[int]]]:
    """The product's resolved run config (``results.json``'s ``config``) and its graph's edges,
    computed without running it, so a floor can run before the product.

    The graph is built as the server builds it (:func:`flwr_sheaf.topology.build_graph` on the
    class sets the nodes report at discovery, ``LocalTask.classes``); :func:`main` checks it against the product's own ``results.json``.
    """
    cfg = RunConfig.from_run_config(rc)
    n = len(agent_specs(cfg.scenario))
    classes = [scenario_task(cfg.scenario, i).classes for i in range(n)]  # what each node reports
    graph = build_graph(cfg.federation.graph, n, class_sets=classes)
    return cfg.to_dict(), sorted(sorted([int(a), int(b)]) for a, b in graph.edges())


def floor_epochs(rc: dict, conf: dict, edges: list, device: torch.device) -> dict:
    """The plain loop (module docstring): CPU and wall seconds of a CE-only and of a glued epoch.

    Args:
        rc: the run config (scenario: zoo, dataset, data seed).
        conf: the resolved config (:func:`floor_setup`; lr, momentum, batch sizes, lambda, ...).
        edges: the graph's edges ``[[a, b], ...]``.
        device: where to run.

    Returns:
        ``{"ce": (cpu, wall), "glued": (cpu, wall), "steps": total SGD steps per epoch}``.
    """
    cfg = RunConfig.from_run_config(rc)
    n = len(agent_specs(cfg.scenario))
    tasks = [scenario_task(cfg.scenario, i) for i in range(n)]
    models = [t.model.to(device) for t in tasks]
    data = [(t.x_train.to(device), t.y_train.to(device), t.x_pilot.to(device)) for t in tasks]
    opts = [
        torch.optim.SGD(
            m.parameters(),
            lr=float(conf["lr"]),
            momentum=float(conf["momentum"]),
            weight_decay=float(conf["weight-decay"]),
        )
        for m in models
    ]
    nbrs: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b in edges:
        nbrs[a].append(b)
        nbrs[b].append(a)
    bs, pbs = int(conf["batch-size"]), int(conf["pilot-batch-size"])
    cap = int(conf["max-steps-per-epoch"])
    clip = float(conf["clip-norm"]) if float(conf["clip-norm"]) > 0 else math.inf
    lam = float(conf["lambda"])
    gen = torch.Generator().manual_seed(0)
    steps = [
        max(1, d[0].shape[0] // bs) if cap <= 0 else min(cap, max(1, d[0].shape[0] // bs))
        for d in data
    ]

    def pilots(i: int) -> torch.Tensor:
        m = models[i]
        m.eval()
        with torch.no_grad():
            z = torch.cat(
                [m.latent(x) for x in data[i][2].split(8192 if device.type != "cpu" else 512)]
            )
            m.whitening.fit(z)
            return m.whitening(z)

    held: list[torch.Tensor] = []  # each agent's last upload (the product's cached, exact pilots)

    def epoch(glue: bool) -> None:
        new = []
        for i in range(n):
            m, (x, y, xp), opt = models[i], data[i], opts[i]
            terms = []
            if glue:
                own = held[i]
                for j in nbrs[i]:
                    head = own.shape[1] > held[j].shape[1] or (
                        own.shape[1] == held[j].shape[1] and i > j
                    )
                    v = _procrustes(own, held[j]) if head else _procrustes(held[j], own)
                    terms.append((held[j], v, head))
            perm = torch.randperm(x.shape[0], generator=gen).to(device)
            pidx = torch.stack(
                [torch.randperm(xp.shape[0], generator=gen)[:pbs] for _ in range(steps[i])]
            ).to(device)
            for s in range(steps[i]):
                idx = perm[s * bs : (s + 1) * bs]
                m.train()
                loss = F.cross_entropy(m.private_logits(x[idx]), y[idx])
                if terms:
                    m.eval()
                    m.whitening.train()
                    with m.whitening.finite_checks(False):
                        a = m.whitening(m.latent(xp[pidx[s]]))
                    total = a.new_zeros(())
                    for a_j, v, head in terms:
                        r = (a - a_j[pidx[s]] @ v.T) if head else (a_j[pidx[s]] - a @ v.T)
                        total = total + (r**2).sum()
                    loss = loss + (lam / a.shape[1]) / (2 * a.shape[0]) * total
                    m.train()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                opt.step()
            new.append(pilots(i))  # the agent's upload: one pass over the K pilots
        held[:] = new

    out = {}
    for name, glue in (("ce", False), ("glued", True)):
        with _Clock(device) as c:
            epoch(glue)
        out[name] = (c.cpu, c.wall)
    out["steps"] = sum(steps)
    return out


def main() -> None:
    """Parse options (module docstring), run product then floor, print and write the record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (run-config torch-threads)"
    )
    ap.add_argument("--extra", nargs="*", default=[], help="more run-config overrides key=value")
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler table of the product's glued epoch"
    )
    ap.add_argument(
        "--no-bracket",
        dest="bracket",
        action="store_false",
        help="run the floor once, after the product (default: before and after, ratio to the mean)",
    )
    ap.add_argument("--out", default="results/floor")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(args.device)
    tag = str(dev).replace(":", "")
    rc = {
        "preset": "paper",
        "method": "sheaf-frl",
        "zoo": args.zoo,
        "dataset": args.dataset,
        "device": args.device,
        "num-server-rounds": 3 if args.profile else 2,
        "local-epochs": 1,
        "evaluate-every": 3 if args.profile else 2,
        "sheaf-variant": "heterogeneous",
        "torch-threads": args.threads,
        "results-dir": str(out / f"product-{tag}"),
        "overwrite": True,
        **parse_overrides(args.extra),
    }
    torch.set_num_threads(max(1, args.threads))
    conf, edges = floor_setup(rc)
    # floor, product, floor: the floor brackets the product, so a machine that slows down or
    # speeds up during the run moves both sides (the ratio uses the two floors' mean)
    floors = [floor_epochs(rc, conf, edges, dev)] if args.bracket else []
    prod = product_epochs(rc, out / f"profile-{tag}.txt" if args.profile else None)
    got = sorted(sorted(e) for e in prod["results"]["graph"]["edges"])
    if got != edges:
        raise SystemExit(f"the floor's graph {edges} is not the product's {got}")
    floors.append(floor_epochs(rc, conf, edges, dev))
    flo = {
        k: tuple(sum(f[k][i] for f in floors) / len(floors) for i in (0, 1))
        for k in ("ce", "glued")
    }
    flo["steps"] = floors[0]["steps"]
    rec = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "zoo": args.zoo,
        "dataset": args.dataset,
        "steps_per_epoch_all_agents": flo["steps"],
        "num_pilots": prod["results"]["config"]["num-pilots"],
        "product": {
            "ce_epoch": dict(zip(("cpu_s", "wall_s"), prod["ce"])),
            "glued_epoch": dict(zip(("cpu_s", "wall_s"), prod["glued"])),
        },
        "floor": {
            "ce_epoch": dict(zip(("cpu_s", "wall_s"), flo["ce"])),
            "glued_epoch": dict(zip(("cpu_s", "wall_s"), flo["glued"])),
        },
        "floor_runs": [  # before and after the product (bracket), or after it only
            {
                "ce_epoch": dict(zip(("cpu_s", "wall_s"), f["ce"])),
                "glued_epoch": dict(zip(("cpu_s", "wall_s"), f["glued"])),
            }
            for f in floors
        ],
        "ratio_glued_cpu": prod["glued"][0] / flo["glued"][0],
        "ratio_glued_wall": prod["glued"][1] / flo["glued"][1],
        "ratio_ce_cpu": prod["ce"][0] / flo["ce"][0],
        "ratio_ce_wall": prod["ce"][1] / flo["ce"][1],
        "overrides": args.extra,
        "profile": prod.get("profile"),
    }
    (out / f"floor-{tag}.json").write_text(json.dumps(rec, indent=1))
    print(
        f"{'epoch':<8}{'product cpu-s':>15}{'floor cpu-s':>13}{'ratio':>7}{'product wall-s':>16}{'floor wall-s':>14}{'ratio':>7}"
    )
    for name in ("ce", "glued"):
        p, f = prod[name], flo[name]
        print(
            f"{name:<8}{p[0]:>15.2f}{f[0]:>13.2f}{p[0] / f[0]:>7.2f}{p[1]:>16.2f}{f[1]:>14.2f}{p[1] / f[1]:>7.2f}"
        )
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
