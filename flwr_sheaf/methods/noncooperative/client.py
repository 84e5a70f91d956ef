"""Non-cooperative agents on the client: cross-entropy only, no traffic during training (notes/baselines.md)."""

from __future__ import annotations

from flwr.clientapp import ClientApp

from ...client.handlers import ClientMethod, register_method_handlers
from ...client.task import TaskFactory
from . import ACTION

__all__ = ["register_noncooperative_handlers"]


def register_noncooperative_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add the non-cooperative handlers (:class:`~flwr_sheaf.client.handlers.ClientMethod` defaults) under ``action``."""
    return register_method_handlers(app, factory, ClientMethod(action))
