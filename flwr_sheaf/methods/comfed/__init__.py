"""ComFed: learned projections into a shared space (notes/baselines-alignment.md, s7)."""

ACTION = "comfed"

# its message vocabulary (shared names: flwr_sheaf.protocol, flwr_sheaf.methods._shared.protocol)
#: ComFed: the mean of the neighbours' projected class prototypes (:func:`~flwr_sheaf.methods._shared.protocol.pack_prototypes` layout).
COMFED_TARGETS = "comfed-targets"
#: ComFed's evaluation arrays routed to neighbours: the projection ``(r, d_i)`` and raw latents ``(M, d_i)``.
COMFED_ROUTED: tuple[str, ...] = ("comfed-proj", "raw-test-latents", "raw-val-latents")

from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_comfed_handlers  # noqa: E402
from .config import ComFedConfig  # noqa: E402
from .strategy import ComFed  # noqa: E402


def report_lines(results: Mapping[str, Any], last: Mapping[str, Any] | None) -> list[str]:
    """The summary's line of ComFed's communication accuracy through its learned maps."""
    if last is None or "comfed_communication_accuracy_degree_weighted" not in last:
        return []
    value = last["comfed_communication_accuracy_degree_weighted"]
    return [
        "communication accuracy with ComFed's learned maps (degree-weighted): "
        + ("n/a" if value is None else f"{value:.3f}")
    ]


METHOD = register(
    Method(
        "comfed",
        ACTION,
        lambda c, n: ComFed(n, comfed=c.section(ComFedConfig), **graph_args(c)),
        register_comfed_handlers,
        report_keys=("comfed-lambda",),
        report_lines=report_lines,
    )
)
