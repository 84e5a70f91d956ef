"""ComFed: learned projections into a shared space (docs/baselines.md, s7)."""

ACTION = "comfed"

# its message vocabulary (record and config-entry names; the shared ones are in flwr_sheaf.protocol)
#: ComFed: the mean of the neighbours' projected class prototypes (:func:`~flwr_sheaf.protocol.pack_prototypes` layout).
COMFED_TARGETS = "comfed-targets"
#: ComFed's evaluation arrays routed to neighbours: the projection ``(r, d_i)`` and raw latents ``(M, d_i)``.
COMFED_ROUTED: tuple[str, ...] = ("comfed-proj", "raw-test-latents", "raw-val-latents")

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
