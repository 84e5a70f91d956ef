"""The non-cooperative baseline: private cross-entropy only, post-hoc alignment at evaluation."""

ACTION = "noncooperative"

from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_noncooperative_handlers  # noqa: E402
from .strategy import NonCooperative  # noqa: E402

METHOD = register(
    Method(
        "non-cooperative",
        ACTION,
        lambda c, n: NonCooperative(n, **graph_args(c)),
        register_noncooperative_handlers,
    )
)
