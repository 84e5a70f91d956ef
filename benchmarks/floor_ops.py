"""Step-for-step comparison of the product and the floor (benchmarks/floor.py): torch.profiler op
counts and self CPU-seconds of one cross-entropy and one glued epoch of each, side by side.

Where benchmarks/floor.py says how long each side takes, this says what each side runs: an op the
product calls more often than the floor, or one that takes longer per call, is overhead to remove.
CPU only (op self-times under the profiler). Default: the paper-scale zoo capped at 30 SGD steps
per agent with 256 pilots, a few minutes on one core:

    python benchmarks/floor_ops.py --steps 30 --pilots 256

Prints, per epoch, both sides' profiled totals and the 30 ops with the largest self time on either
side (calls and self CPU-seconds of each, and the difference).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor as FL  # noqa: E402

from flwr_sheaf.apps.client_app import app as client_app  # noqa: E402
from flwr_sheaf.apps.scenario import agent_specs  # noqa: E402
from flwr_sheaf.apps.server_app import run_server  # noqa: E402
from flwr_sheaf.config import RunConfig  # noqa: E402


def _profiled(fn):
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        out = fn()
    return prof, out


def main() -> None:
    """Parse options (module docstring), profile both sides, print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="max-steps-per-epoch")
    ap.add_argument("--pilots", type=int, default=256, help="num-pilots")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--zoo", default="paper-15")
    ap.add_argument("--rows", type=int, default=30, help="ops printed per epoch")
    ap.add_argument("--graph", default="class-overlap", help="run-config graph (tiny zoos: ring)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rc = {
        "preset": "paper",
        "method": "sheaf-frl",
        "zoo": args.zoo,
        "dataset": args.dataset,
        "device": "cpu",
        "num-server-rounds": 2,
        "local-epochs": 1,
        "evaluate-every": 2,
        "sheaf-variant": "heterogeneous",
        "torch-threads": 1,
        "results-dir": "/tmp/floor-ops-product",
        "overwrite": True,
        "max-steps-per-epoch": args.steps,
        "num-pilots": args.pilots,
        "graph": args.graph,
    }
    cfg = RunConfig.from_run_config(rc)
    grid = FL.TimedGrid(client_app, len(agent_specs(cfg.scenario)), run_config=rc)
    product: list = []
    orig = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        msgs = list(messages)
        if msgs and msgs[0].metadata.message_type.startswith("train"):
            prof, out = _profiled(lambda: orig(msgs, timeout=timeout))
            product.append(prof)
            return out
        return orig(msgs, timeout=timeout)

    grid.send_and_receive = send_and_receive
    json.loads(Path(run_server(grid, rc)).read_text())
    conf, edges = FL.floor_setup(rc)
    floor: list = []

    class ProfiledClock(FL._Clock):
        def __enter__(self):
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.prof.__exit__(None, None, None)
            floor.append(self.prof)

    FL._Clock = ProfiledClock  # type: ignore[misc]
    t = time.process_time()
    FL.floor_epochs(rc, conf, edges, torch.device("cpu"))
    print(f"floor done in {time.process_time() - t:.1f} CPU-s")
    for name, p, f in (("ce", product[0], floor[0]), ("glued", product[1], floor[1])):
        pa = {e.key: (e.count, e.self_cpu_time_total / 1e6) for e in p.key_averages()}
        fa = {e.key: (e.count, e.self_cpu_time_total / 1e6) for e in f.key_averages()}
        keys = sorted(
            set(pa) | set(fa),
            key=lambda k: -max(pa.get(k, (0, 0.0))[1], fa.get(k, (0, 0.0))[1]),
        )
        print(
            f"== {name} epoch: product self CPU-s {sum(v[1] for v in pa.values()):.2f}, "
            f"floor {sum(v[1] for v in fa.values()):.2f}"
        )
        for k in keys[: args.rows]:
            pc, pt = pa.get(k, (0, 0.0))
            fc, ft = fa.get(k, (0, 0.0))
            print(
                f"{k[:44]:<45} product {pc:>7} calls {pt:8.3f} s | floor {fc:>7} calls {ft:8.3f} s | diff {pt - ft:+8.3f} s"
            )


if __name__ == "__main__":
    main()
