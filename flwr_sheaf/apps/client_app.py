"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers.

Each method listens on its own action (``sheaf``, ``fedproto``, ``fedsaf``, ``noncooperative``), so
one ClientApp serves whatever the run config's ``method`` picks on the server.
"""

from flwr.clientapp import ClientApp

from ..client.fedproto import register_fedproto_handlers
from ..client.fedsaf import register_fedsaf_handlers
from ..client.noncooperative import register_noncooperative_handlers
from ..client.sheaf import register_sheaf_handlers
from .scenario import cnn_task_factory

app = ClientApp()
register_sheaf_handlers(app, cnn_task_factory)
register_fedproto_handlers(app, cnn_task_factory)
register_fedsaf_handlers(app, cnn_task_factory)
register_noncooperative_handlers(app, cnn_task_factory)
