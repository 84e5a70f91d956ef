"""ComFed: learned projections into a shared space (docs/baselines.md, s7)."""

ACTION = "comfed"

from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_comfed_handlers  # noqa: E402
from .strategy import ComFed  # noqa: E402

METHOD = register(
    Method(
        "comfed",
        ACTION,
        lambda c, n: ComFed(n, comfed=c.comfed, **graph_args(c)),
        register_comfed_handlers,
    )
)
