"""The ClientApp that ``flwr run`` loads: the CNN-zoo scenario with every method's handlers."""

from flwr.clientapp import ClientApp

from ..client.sheaf import register_sheaf_handlers
from .scenario import cnn_task_factory

app = ClientApp()
register_sheaf_handlers(app, cnn_task_factory)
