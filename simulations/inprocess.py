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
from flwr_sheaf.apps.methods import num_nodes
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError
from flwr_sheaf.methods import parse_run_config
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
    parse_run_config(out)  # the method's own keys and agent count too (RFedAGS: its problem's)
    return out


def run_inprocess(run_config: dict) -> dict:
    """Run ``run_config`` through :class:`flwr_sheaf.testing.LocalGrid` (one node per agent of the
    run: the zoo's, or the method's own problem's); returns the results dict."""
    cfg, method = parse_run_config(run_config)
    torch.set_num_threads(max(1, cfg.train.torch_threads))
    grid = LocalGrid(client_app, num_nodes(cfg, method), run_config=run_config)
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


#: The headline numbers :func:`summary` prints, where the run has them.
SUMMARY_KEYS = (
    "round",
    "private_accuracy_mean",
    "communication_accuracy_degree_weighted",
    "val_private_accuracy_mean",
    "val_communication_accuracy_degree_weighted",
    "low_variance_fraction_mean",
    "gap",
    "distance_to_optimum",
)


def summary(res: dict) -> dict:
    """The headline numbers of a run's ``results.json`` dict: those of its last evaluated round, or
    of its last round when no round has accuracies (the RFedAGS family's ``gap`` and
    ``distance_to_optimum``; ``evaluate-every=0``)."""
    rounds = res.get("rounds") or []
    evaluated = [r for r in rounds if r.get("private_accuracy_mean") is not None]
    last = (evaluated or rounds or [{}])[-1]
    return {k: last[k] for k in SUMMARY_KEYS if k in last}


if __name__ == "__main__":
    from flwr_sheaf.config import ConfigError

    try:
        res = run_inprocess(parse_overrides(sys.argv[1:]))
    except ConfigError as exc:  # a bad key or value: one line naming it and the fix, no traceback
        print(f"inprocess.py: {exc}", file=sys.stderr)
        sys.exit(2)
    out = summary(res)
    if not any(r.get("private_accuracy_mean") is not None for r in res.get("rounds") or []) and (
        "gap" not in out
    ):  # evaluate-every=0 ("never"): the last round's training, said so
        out["evaluated"] = "no round was evaluated (evaluate-every=0 means never)"
    print(json.dumps(out, indent=1))
