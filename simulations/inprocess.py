"""Run one flwr-sheaf configuration in-process (LocalGrid, no Ray) and return its results.

The same ServerApp/ClientApp code as ``flwr run``, minus the engine: useful for sweeps on a
small machine. ``python simulations/inprocess.py key=value ...`` runs one configuration; values
are typed by :data:`flwr_sheaf.config.KEYS` (unknown keys and bad values are refused, named).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from flwr_sheaf.apps.client_app import app as client_app
from flwr_sheaf.apps.scenario import agent_specs
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError, RunConfig
from flwr_sheaf.testing import LocalGrid


def parse_overrides(items: list[str]) -> dict:
    """``["lambda=0.1", "zoo=tiny-4"]`` -> typed dict, as ``flwr run --run-config`` would type them.

    Quotes around a value are optional (``method='fedproto'`` as for ``flwr run``, or
    ``method=fedproto``); ``true``/``false`` become booleans, numbers int or float. Unknown keys and bad values are refused by
    :meth:`flwr_sheaf.config.RunConfig.from_run_config`, naming the key and the value.

    Raises:
        ConfigError: an item without ``=`` (named), an unknown key or a bad value.
    """
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not k:
            raise ConfigError(f"run-config override {it!r}: expected key=value")
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            out[k] = v[1:-1]
            continue
        if v in ("true", "false"):  # TOML booleans, as flwr run types them (e.g. resume=true)
            out[k] = v == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    RunConfig.from_run_config(out)
    return out


def run_inprocess(run_config: dict) -> dict:
    """Run ``run_config`` through :class:`flwr_sheaf.testing.LocalGrid`; returns the results dict."""
    cfg = RunConfig.from_run_config(run_config)
    torch.set_num_threads(max(1, cfg.train.torch_threads))
    grid = LocalGrid(client_app, len(agent_specs(cfg.scenario)), run_config=run_config)
    path = run_server(grid, run_config)
    res = json.loads(Path(path).read_text())
    if res.get("status", "completed") != "completed":  # degraded (failed runs raise in run_server)
        print(
            f"[flwr-sheaf] warning: run {run_config.get('results-dir')} is {res['status']}: "
            f"{res.get('degradation')}",
            file=sys.stderr,
            flush=True,
        )
    return res


if __name__ == "__main__":
    from flwr_sheaf.config import ConfigError

    try:
        res = run_inprocess(parse_overrides(sys.argv[1:]))
    except ConfigError as exc:  # a bad key or value: one line naming it and the fix, no traceback
        print(f"inprocess.py: {exc}", file=sys.stderr)
        sys.exit(2)
    evaluated = [r for r in res["rounds"] if r.get("private_accuracy_mean") is not None]
    if not evaluated:  # evaluate-every=0 ("never"): the last round's training, said so
        last = res["rounds"][-1]
        print(
            json.dumps(
                {
                    "round": last.get("round"),
                    "num_trained": last.get("num_trained"),
                    "ce": last.get("ce"),
                    "status": res.get("status"),
                    "evaluated": "no round was evaluated (evaluate-every=0 means never)",
                },
                indent=1,
            )
        )
        sys.exit(0)
    last = evaluated[-1]
    print(
        json.dumps(
            {
                k: last.get(k)
                for k in (
                    "round",
                    "private_accuracy_mean",
                    "communication_accuracy_degree_weighted",
                    "val_private_accuracy_mean",
                    "val_communication_accuracy_degree_weighted",
                    "low_variance_fraction_mean",
                )
            },
            indent=1,
        )
    )
