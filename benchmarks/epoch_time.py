"""Seconds per local epoch of the 15-agent zoo (all agents, one process) on a device.

Runs ``method`` in-process (LocalGrid: the same ServerApp/ClientApp code as ``flwr run``, every
agent in this process and on ``--device``) for ``--rounds`` server rounds of one local epoch each,
evaluating only in the last round, and prints per-round wall seconds. Round 1 trains on
cross-entropy only (no neighbour pilots yet), so the per-epoch figure is the mean of rounds
2..R-1 (training only); the last round adds the two evaluation phases. ``cpu_seconds_per_epoch`` is
the process CPU time (all threads) of the train round trips of rounds 2..R: unlike wall time it does
not grow when other programs share the machine.

    python benchmarks/epoch_time.py --device cuda --dataset fashion-mnist --rounds 4
    python benchmarks/epoch_time.py --device cpu --dataset fashion-mnist --rounds 3 --threads 2

Defaults: ``preset=paper`` (batch 64, lr 1e-2, pilots = the whole 10% hold-out: 7,000 on
Fashion-MNIST), s = 0.7, ``paper-15`` zoo. Writes ``<out>/epoch_time-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
from inprocess import parse_overrides  # noqa: E402

from flwr_sheaf.apps.client_app import app as client_app  # noqa: E402
from flwr_sheaf.apps.scenario import agent_specs  # noqa: E402
from flwr_sheaf.apps.server_app import run_server  # noqa: E402
from flwr_sheaf.config import RunConfig  # noqa: E402
from flwr_sheaf.testing import LocalGrid  # noqa: E402


class TimedGrid(LocalGrid):
    """LocalGrid that records, per round trip, its message kind, process CPU seconds and wall seconds.

    CPU seconds (``time.process_time``: user + system of this process, all threads) do not grow when
    other programs load the machine, unlike wall seconds, so they compare runs on a busy machine.
    """

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.timings: list[tuple[str, float, float]] = []

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102 - LocalGrid's
        msgs = list(messages)
        cpu, wall = time.process_time(), time.perf_counter()
        out = super().send_and_receive(msgs, timeout=timeout)
        kind = msgs[0].metadata.message_type.split(".")[0] if msgs else "none"
        self.timings.append((kind, time.process_time() - cpu, time.perf_counter() - wall))
        return out


def main() -> None:
    """Parse options (module docstring), run, print and write the timing record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument("--method", default="sheaf-frl")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (run-config torch-threads)"
    )
    ap.add_argument("--extra", nargs="*", default=[], help="more run-config overrides key=value")
    ap.add_argument("--out", default="results/epoch_time")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    tag = f"{args.method}-{args.device.replace(':', '')}"
    rc = {
        "preset": "paper",
        "method": args.method,
        "zoo": args.zoo,
        "dataset": args.dataset,
        "device": args.device,
        "num-server-rounds": args.rounds,
        "local-epochs": 1,
        "evaluate-every": args.rounds,
        "torch-threads": args.threads,
        "results-dir": str(out / tag),
        "overwrite": True,
        **parse_overrides(args.extra),
    }
    t0 = time.monotonic()
    cfg = RunConfig.from_run_config(rc)
    torch.set_num_threads(max(1, cfg.train.torch_threads))
    grid = TimedGrid(client_app, len(agent_specs(cfg.scenario)), run_config=rc)
    res = json.loads(Path(run_server(grid, rc)).read_text())
    total = time.monotonic() - t0
    train_cpu = [c for kind, c, _ in grid.timings if kind == "train"]
    walls = [r["wall_seconds"] for r in res["rounds"]]
    train_only = walls[1:-1] or walls[:1]
    rec = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and args.device != "cpu"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "dataset": args.dataset,
        "zoo": args.zoo,
        "method": args.method,
        "rounds": args.rounds,
        "round_wall_seconds": walls,
        "seconds_per_epoch": sum(train_only) / len(train_only),
        "train_cpu_seconds_per_round": train_cpu,
        "cpu_seconds_per_epoch": (sum(train_cpu[1:]) / len(train_cpu[1:]))
        if len(train_cpu) > 1
        else train_cpu[0],
        "last_round_with_evaluation_seconds": walls[-1],
        "total_seconds_incl_data_load": total,
        "final": {
            k: res["rounds"][-1].get(k)
            for k in (
                "private_accuracy_mean",
                "communication_accuracy_degree_weighted",
                "gluing_loss",
                "ce",
            )
        },
        "steps_per_round_total": res["rounds"][-1].get("steps"),
        "config": {
            k: res["config"][k]
            for k in ("lr", "batch-size", "num-pilots", "pilot-batch-size", "clip-norm")
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"epoch_time-{tag}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
