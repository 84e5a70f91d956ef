"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers.

Each method listens on its own action (``sheaf``, ``fedproto``, ``fedsaf``, ``noncooperative``), so
one ClientApp serves whatever the run config's ``method`` picks on the server. The
:func:`~flwr_sheaf.client.state.persist_state` mod makes node state durable when the SuperNode's
node config names a ``state-dir`` (docs/resume.md); without it, it does nothing.
"""

from flwr.clientapp import ClientApp

from ..client.state import persist_state
from .methods import register_all_handlers
from .scenario import cnn_task_factory

app = ClientApp(mods=[persist_state])
register_all_handlers(app, cnn_task_factory)
