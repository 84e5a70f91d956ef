"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers.

Each method listens on its own action (``sheaf``, ``fedproto``, ``fedsaf``, ``noncooperative``), so
one ClientApp serves whatever the run config's ``method`` picks on the server.
"""

from flwr.clientapp import ClientApp

from .methods import register_all_handlers
from .scenario import cnn_task_factory

app = ClientApp()
register_all_handlers(app, cnn_task_factory)
