"""The app's side of the method registry (:mod:`flwr_sheaf.methods`): build the configured strategy,
register every method's handlers on a ClientApp (adding a method edits nothing here)."""

from __future__ import annotations

from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from ..client.task import TaskFactory
from ..config import RunConfig
from ..methods import METHODS, get_method
from .scenario import num_nodes

__all__ = [
    "zoo_methods",
    "build_strategy",
    "num_nodes",
    "register_all_handlers",
]


def zoo_methods() -> list[str]:
    """Sorted names of the registered methods without a task factory of their own (CNN zoo)."""
    return sorted(name for name, m in METHODS.items() if m.task_factory is None)


def build_strategy(config: RunConfig) -> Strategy:
    """The strategy of ``config.method`` on the run's agents (nothing is sent yet).

    Raises:
        ConfigError: an unknown method (named, with the valid ones).
    """
    method = get_method(config.method)
    return method.strategy(config, num_nodes(config, method))


def register_all_handlers(app: ClientApp, factory: TaskFactory) -> ClientApp:
    """Register every method's handlers on ``app`` once per action (its own task factory first)."""
    done = {name.split(".", 1)[1] for name in getattr(app, "_registered_funcs", {}) if "." in name}
    for m in list(METHODS.values()):  # a copy: a handler's import may register another method
        if m.action in done:
            continue
        m.handlers(app, m.task_factory() if m.task_factory is not None else factory)
        done.add(m.action)
    return app
