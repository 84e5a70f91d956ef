"""The app's run config in pyproject.toml and the code's defaults must agree."""

import tomllib
from pathlib import Path

from flwr_sheaf.apps.scenario import DEFAULTS


def test_pyproject_run_config_matches_defaults():
    cfg = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    run_config = cfg["tool"]["flwr"]["app"]["config"]
    assert run_config == DEFAULTS
