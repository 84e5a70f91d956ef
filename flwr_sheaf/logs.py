"""The ``flwr_sheaf`` logger's default output: progress lines on stderr when nobody configured logging.

flwr-sheaf logs its progress (``[flwr-sheaf] round 1 | private 0.108 | ...``), discovery and
failures on the ``flwr_sheaf`` logger. Python prints nothing below WARNING from an unconfigured
logger, so one's own ServerApp built on :class:`~flwr_sheaf.GraphStrategy` used to run silently.
:func:`default_progress_handler` (called by the bundled ServerApp and by ``GraphStrategy.start``)
adds one stderr handler at INFO, only when neither the ``flwr_sheaf`` logger nor the root logger has
a handler: an app that configures logging (``logging.basicConfig(...)``, or a handler on
``flwr_sheaf``) keeps its own.
"""

from __future__ import annotations

import logging

__all__ = ["default_progress_handler", "LOGGER_NAME"]

LOGGER_NAME = "flwr_sheaf"


def default_progress_handler() -> bool:
    """Give the ``flwr_sheaf`` logger a ``[flwr-sheaf] <message>`` stderr handler at INFO when
    logging is not configured (no handler on it nor on the root logger). Returns whether one was
    added (False: the host app's configuration is left as it is)."""
    log = logging.getLogger(LOGGER_NAME)
    if log.handlers or logging.getLogger().handlers:
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[flwr-sheaf] %(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    log.propagate = False
    return True
