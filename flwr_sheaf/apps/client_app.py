"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers.

Each method listens on its own action (``sheaf``, ``fedproto``, ``fedsaf``, ``noncooperative``, ...),
so one ClientApp serves whatever the run config's ``method`` picks on the server. Methods of a
researcher's own module (run-config ``method-module``) are imported and registered on the first
message that names them. The :func:`~flwr_sheaf.client.state.persist_state` mod makes node state
durable when the SuperNode's node config names a ``state-dir`` (docs/resume.md); without it, it
does nothing. The :func:`~flwr_sheaf.client.checks.refuse_what_the_server_refuses` mod (inside it) raises
instead of returning a train reply the server would refuse, so that state is never committed (nor persisted).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..client.checks import refuse_what_the_server_refuses
from ..client.state import persist_state
from ..methods import METHODS, import_method_modules
from .methods import register_all_handlers, register_handlers
from .scenario import cnn_task_factory

__all__ = ["MethodClientApp", "app"]


class MethodClientApp(ClientApp):
    """A ClientApp serving every registered method; it imports the run's ``method-module`` first."""

    def __call__(self, message: Message, context: Context) -> Message:
        """Import the run's method modules, register any method registered since, then dispatch as
        Flower does."""
        spec = context.run_config["method-module"] if "method-module" in context.run_config else ""
        if spec:
            import_method_modules(str(spec))
        register_handlers(self, cnn_task_factory, list(METHODS.values()))
        return super().__call__(message, context)


app = MethodClientApp(mods=[persist_state, refuse_what_the_server_refuses])
register_all_handlers(app, cnn_task_factory)
