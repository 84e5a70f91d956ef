"""Every registered method is one small unit: its strategy is one level below flwr-sheaf's one base,
and evaluation keeps no state on the strategy between its phases (issue #19, design.md s3)."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import Strategy

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.methods import build_strategy
from flwr_sheaf.config import FederationConfig, LocalTrainConfig, RunConfig
from flwr_sheaf.methods.noncooperative.strategy import NonCooperative
from flwr_sheaf.methods.registry import METHODS
from flwr_sheaf.strategy.graph import GraphStrategy, evaluation_view
from flwr_sheaf.testing import LocalGrid

RC = {"zoo": "tiny-4", "num-pilots": 64, "local-epochs": 1, "seed": 3, "graph": "ring"}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_registered_strategy_is_at_most_two_levels_below_flowers_strategy(name):
    config = RunConfig.from_run_config({**RC, "method": name}, METHODS[name].config)
    strategy = build_strategy(config)
    mro = type(strategy).__mro__
    below = mro[: mro.index(Strategy)]  # the strategy class and its bases of ours
    assert len(below) <= 2, (
        f"{name}: {[c.__name__ for c in below]} (compose shared behaviour instead)"
    )
    assert below[-1] is GraphStrategy, (
        f"{name}: the one base is GraphStrategy, got {below[-1].__name__}"
    )


def _holds_messages(value) -> bool:
    if isinstance(value, Message):
        return True
    if isinstance(value, dict):
        return any(isinstance(v, Message) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, Message) for v in value)
    return False


def test_no_evaluation_state_stays_on_the_strategy_after_an_evaluated_round():
    s = NonCooperative(
        4, federation=FederationConfig(graph="ring", seed=3), train=LocalTrainConfig(local_epochs=1)
    )
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s.start(grid, num_rounds=1, timeout=60.0)
    assert s.ledger.rounds[-1].evaluation is not None and len(s.ledger.edge_results) == 8
    attrs = vars(s)
    assert not [a for a, v in attrs.items() if _holds_messages(v)], "replies kept on the strategy"
    assert not [a for a, v in vars(s.evaluation).items() if _holds_messages(v)], (
        "the component is stateless"
    )


def test_the_evaluation_round_is_a_value_returned_by_the_component():
    s = NonCooperative(
        4, federation=FederationConfig(graph="ring", seed=3), train=LocalTrainConfig(local_epochs=1)
    )
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s.discover(grid, 60.0)
    s.ledger.begin_round(1)
    result = s.evaluation.run(evaluation_view(s, 1), ConfigRecord(), grid, 60.0)
    assert len(result.edges) == 8 and sorted(result.nodes) == [0, 1, 2, 3]
    assert (
        s.ledger.last_evaluation.edges == []
    )  # the strategy records it only through evaluate_round
    metrics = s.evaluate_round(1, ArrayRecord(), ConfigRecord(), grid, 60.0)
    assert (
        metrics["communication_accuracy_degree_weighted"]
        == s.ledger.last_evaluation.summary.communication_accuracy_degree_weighted
    )


def test_handler_hint_names_each_registered_methods_own_function():
    """The missing-handler hint is read from the registry: for every method's action it names an
    importable function that is (or is wrapped by) that method's ``handlers``."""
    import importlib
    import re

    from flwr_sheaf.hints import handler_hint
    from flwr_sheaf.methods import METHODS

    for name, method in METHODS.items():
        hint = handler_hint(f"No train function registered with name '{method.action}'")
        m = re.search(r"call ([\w.]+)\(app, factory\)", hint)
        fn = getattr(method.handlers, "func", method.handlers)
        if not str(getattr(fn, "__module__", "")).startswith("flwr_sheaf."):
            # a researcher's own method registered by another test: named if importable, else the
            # generic hint (never a name that cannot be imported)
            assert m is not None or "ClientMethod" in hint, (name, hint)
            if m is None:
                continue
        assert m is not None, (name, hint)
        module, _, attr = m.group(1).rpartition(".")
        fn = getattr(importlib.import_module(module), attr)
        registered = getattr(method.handlers, "func", method.handlers)
        assert fn is registered or any(
            getattr(o.handlers, "func", o.handlers) is fn
            for o in METHODS.values()
            if o.action == method.action
        ), (name, m.group(1))
    assert "ClientMethod" in handler_hint("No query function registered with name 'not-a-method'")
