"""The ``flwr_sheaf`` logger's default output: progress lines on stderr when nobody configured logging
(:func:`default_progress_handler`; an app that configures logging keeps its own)."""

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
