"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers, the
run's ``method-module`` imported first, and the mods of :mod:`flwr_sheaf.client.state`."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..client.state import persist_state, refuse_what_the_server_refuses
from ..methods import import_method_modules
from .methods import register_all_handlers
from .scenario import cnn_task_factory

__all__ = ["MethodClientApp", "app"]


class MethodClientApp(ClientApp):
    """A ClientApp serving every registered method; it imports the run's ``method-module`` first."""

    def __call__(self, message: Message, context: Context) -> Message:
        """Import the run's method modules, register methods registered since, then dispatch."""
        spec = context.run_config["method-module"] if "method-module" in context.run_config else ""
        if spec:
            import_method_modules(str(spec))
        register_all_handlers(self, cnn_task_factory)
        return super().__call__(message, context)


app = MethodClientApp(mods=[persist_state, refuse_what_the_server_refuses])
register_all_handlers(app, cnn_task_factory)
